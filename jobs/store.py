"""`JobStore`: jobs, attempts and events in SQLAlchemy Core over SQLite (WAL).

The worker alone owns the store. Claims are a conditional UPDATE (`... WHERE status='PENDING'`),
with `FOR UPDATE SKIP LOCKED` on the candidate select where the dialect has it (Postgres), so the
same code can serve workers on several hosts. SQLite-only SQL lives in the functions marked
"SQLite only", each with a portable path beside it.

An attempt's life in the store, so that no attempt runs twice and no completion is lost:

    claim_next      job PENDING -> STARTING, attempt row STARTING (no process yet)
    mark_running    the held child's identity (pid, start time, cgroup / container) and RUNNING,
                    committed *before* the child is let go: a crash after this finds the child
    finish_attempt  once, conditional on the attempt still being live: replaying a completion
                    (after a failed write, or from exit.json at restart) records it once

Every JSON column is written with `strict_json.dumps` (no NaN, no Infinity) and read with
`strict_json.loads`, so one diverging loss cannot poison a query.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, case, create_engine, delete, event, func, insert, literal_column, select, update
from sqlalchemy.exc import DatabaseError, SQLAlchemyError

from jobs import strict_json
from jobs.errors import InvalidTransition, JobNotFound, StoreError
from jobs.tables import MIGRATIONS, SCHEMA_VERSION, attempts_t, events_t, jobs_t, schema_version_t
from jobs.vocab import LIVE, REASONS, STATES, TERMINAL

__all__ = ["JobStore", "STATES", "TERMINAL", "LIVE", "REASONS", "SCHEMA_VERSION", "SUMMARY_COLUMNS"]

log = logging.getLogger("offload_jobs.store")

METRICS_MAX_BYTES = 64 * 1024  # last_metrics is a summary for tables, not a data channel

_JOB_COLS = [c for c in jobs_t.c]
# What a table of jobs needs: no spec (up to 1 MiB each), no metrics.
SUMMARY_COLUMNS = ("id", "name", "kind", "status", "reason", "message", "priority", "gpus", "attempt",
                   "max_attempts", "run_dir", "created_at", "started_at", "finished_at", "exit_code")
_JSON_COLS = ("spec", "last_metrics")


def _writes(method: Callable[..., Any]) -> Callable[..., Any]:
    """A write: database errors become StoreError, and its events reach `on_event` after commit."""

    @functools.wraps(method)
    def wrapper(self: "JobStore", *args: Any, **kwargs: Any) -> Any:
        self._pending.items = []
        try:
            result = method(self, *args, **kwargs)
            items = self._pending.items
        except SQLAlchemyError as exc:
            raise StoreError(f"store {self.path_label}: {_db_message(exc)}") from None
        finally:
            self._pending.items = None
        if self.on_event is not None:
            for ev in items:
                try:
                    self.on_event(ev)
                except Exception:  # the write has committed; a listener must not undo that
                    log.exception("event listener failed for event %s", ev.get("id"))
        return result

    return wrapper


def _reads(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: "JobStore", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise StoreError(f"store {self.path_label}: {_db_message(exc)}") from None

    return wrapper


def _db_message(exc: SQLAlchemyError) -> str:
    """The driver's own one-line message ("database or disk is full"), not SQLAlchemy's essay."""
    orig = getattr(exc, "orig", None)
    text = str(orig) if orig is not None else str(exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


class JobStore:
    """Persistent jobs, attempts and events; every method is one transaction.

    `on_event`, if set, is called (in the writer's thread) with each event after its commit.
    Database failures surface as `StoreError` with the driver's message.
    """

    def __init__(self, url: str | Path, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.on_event = on_event
        self._pending = threading.local()
        url = str(url)
        self.path: Path | None = None
        if "://" not in url:
            self.path = Path(url)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            url = f"sqlite:///{url}"
        self.url = url
        self.path_label = str(self.path) if self.path is not None else url
        self.is_sqlite = url.startswith("sqlite")
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        try:
            self.engine = create_engine(url, **kwargs)
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot open store {self.path_label}: {_db_message(exc)}") from None
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
            # pysqlite's implicit transactions defeat BEGIN IMMEDIATE; take control of them.
            event.listen(self.engine, "begin", _sqlite_begin)
        self.migrate()

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ schema
    def migrate(self) -> int:
        """Apply pending migrations; returns the schema version."""
        try:
            with self.engine.begin() as conn:
                schema_version_t.create(conn, checkfirst=True)
                row = conn.execute(select(schema_version_t.c.version)).first()
                version = row[0] if row else 0
                if version > SCHEMA_VERSION:
                    raise StoreError(f"store {self.path_label} has schema {version}, newer than this code ({SCHEMA_VERSION})")
                for step in MIGRATIONS[version:]:
                    step(conn)
                if row is None:
                    conn.execute(insert(schema_version_t).values(version=SCHEMA_VERSION))
                elif version != SCHEMA_VERSION:
                    conn.execute(update(schema_version_t).values(version=SCHEMA_VERSION))
        except DatabaseError as exc:
            raise StoreError(
                f"{self.path_label} is not a readable job store ({_db_message(exc)}); restore it from a backup, "
                f"or move it aside (mv {self.path_label} {self.path_label}.broken) to start an empty store"
            ) from None
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot open or migrate store {self.path_label}: {_db_message(exc)}") from None
        return SCHEMA_VERSION

    def integrity_problem(self) -> str | None:
        """None when the store reads cleanly, else what is wrong (SQLite only: PRAGMA quick_check)."""
        if not self.is_sqlite:
            return None
        try:
            with self._read() as conn:
                rows = [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]
        except SQLAlchemyError as exc:
            return _db_message(exc)
        return None if rows == ["ok"] else "; ".join(str(r) for r in rows[:3])

    @_reads
    def schema_version(self) -> int:
        with self._read() as conn:
            return conn.execute(select(schema_version_t.c.version)).scalar_one()

    # ------------------------------------------------------------ jobs
    @_writes
    def create_job(self, spec: dict[str, Any], *, kind: str, name: str, priority: int = 0, gpus: int = 0,
                   max_attempts: int = 1, run_dir_for: Callable[[str], str] | None = None,
                   job_id: str | None = None) -> dict[str, Any]:
        now = time.time()
        job_id = job_id or self.new_id()
        with self.engine.begin() as conn:
            seq = (conn.execute(select(func.max(jobs_t.c.seq))).scalar() or 0) + 1
            conn.execute(insert(jobs_t).values(
                id=job_id, seq=seq, name=name, kind=kind, status="PENDING", priority=priority, gpus=gpus,
                attempt=0, max_attempts=max_attempts, spec=strict_json.dumps(spec), created_at=now,
                run_dir=run_dir_for(job_id) if run_dir_for else None,
            ))
            self._event(conn, job_id, "job.created", {"status": "PENDING", "name": name, "kind": kind, "attempt": 0})
            return self._get(conn, job_id)

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(6)

    @_reads
    def get_job(self, job_id: str) -> dict[str, Any]:
        """A job by id or by a unique id prefix (4+ characters)."""
        with self._read() as conn:
            return self._get(conn, job_id, prefix=True)

    @_reads
    def list_jobs(self, status: str | Iterable[str] | None = None, limit: int | None = None,
                  *, summary: bool = False) -> list[dict[str, Any]]:
        """Newest first; `summary` leaves out the spec and the metrics."""
        cols = [jobs_t.c[n] for n in SUMMARY_COLUMNS] if summary else _JOB_COLS
        q = self._filtered(select(*cols), status, limit)
        with self._read() as conn:
            return [_job_dict(r) for r in conn.execute(q).mappings()]

    @_reads
    def count_jobs(self, status: str | Iterable[str] | None = None) -> int:
        q = self._filtered(select(func.count()).select_from(jobs_t), status, None, order=False)
        with self._read() as conn:
            return int(conn.execute(q).scalar() or 0)

    @_reads
    def list_jobs_json(self, status: str | Iterable[str] | None = None, limit: int | None = None,
                       *, summary: bool = False) -> str:
        """`{"jobs": [...], "total": N}` as JSON text: the page `list_jobs` would give, and how many match.

        SQLite only: the rows are rendered by json_object() inside the database, about 6x faster
        than building dicts and dumping them. A JSON column that is not valid JSON (a NaN written
        by an older version) reads as null instead of failing the whole query.
        """
        total = self.count_jobs(status)
        if not self.is_sqlite:
            return strict_json.dumps({"jobs": self.list_jobs(status, limit, summary=summary), "total": total})
        args: list[Any] = []
        names = SUMMARY_COLUMNS if summary else [c.name for c in _JOB_COLS if c.name != "seq"]
        for name in names:
            c = jobs_t.c[name]
            value = case((func.json_valid(c), func.json(c)), else_=None) if name in _JSON_COLS else c
            args += [literal_column(f"'{name}'"), value]
        q = self._filtered(select(func.json_object(*args)), status, limit)
        with self._read() as conn:
            rows = conn.execute(q).scalars().all()
        return '{"jobs":[' + ",".join(rows) + f'],"total":{total}}}'

    @staticmethod
    def _filtered(q: Any, status: str | Iterable[str] | None, limit: int | None, order: bool = True) -> Any:
        if order:
            q = q.order_by(jobs_t.c.seq.desc())
        if status:
            wanted = [status] if isinstance(status, str) else list(status)
            q = q.where(jobs_t.c.status.in_([s.upper() for s in wanted]))
        if limit is not None:
            q = q.limit(max(0, int(limit)))
        return q

    @_reads
    def counts(self) -> dict[str, int]:
        with self._read() as conn:
            rows = conn.execute(select(jobs_t.c.status, func.count()).group_by(jobs_t.c.status)).all()
        out = dict.fromkeys(STATES, 0)
        out.update({s: n for s, n in rows})
        return out

    @_writes
    def claim_next(self, *, gpu_slots: int, cpu_slots: int) -> dict[str, Any] | None:
        """Atomically move the best PENDING job that fits the free slots to STARTING with a new attempt."""
        if gpu_slots <= 0 and cpu_slots <= 0:
            return None
        with self.engine.begin() as conn:
            q = select(jobs_t.c.id, jobs_t.c.attempt).where(jobs_t.c.status == "PENDING")
            if gpu_slots <= 0:
                q = q.where(jobs_t.c.gpus == 0)
            elif cpu_slots <= 0:
                q = q.where(jobs_t.c.gpus > 0)
            q = q.order_by(jobs_t.c.priority.desc(), jobs_t.c.seq).limit(1)
            if not self.is_sqlite:
                q = q.with_for_update(skip_locked=True)
            row = conn.execute(q).first()
            if row is None:
                return None
            now = time.time()
            number = row.attempt + 1
            res = conn.execute(update(jobs_t).where(jobs_t.c.id == row.id, jobs_t.c.status == "PENDING").values(
                status="STARTING", attempt=number, reason=None, message=None, exit_code=None, finished_at=None))
            if res.rowcount != 1:
                return None  # another worker won the race
            conn.execute(insert(attempts_t).values(job_id=row.id, number=number, status="STARTING", started_at=now))
            self._event(conn, row.id, "job.status", {"status": "STARTING", "attempt": number})
            return self._get(conn, row.id)

    @_writes
    def mark_running(self, job_id: str, number: int, *, executor: str, pid: int | None = None,
                     pgid: int | None = None, handle: dict[str, Any] | None = None, worker_pid: int | None = None) -> bool:
        """Record the held child's identity and move STARTING -> RUNNING, in one transaction.

        The caller lets the child run only after this returns True. False: the job was cancelled
        meanwhile (it stays CANCELLING, and the child must be stopped unrun); the identity is
        recorded either way, so a crash right after this still finds the child.
        """
        now = time.time()
        with self.engine.begin() as conn:
            conn.execute(update(attempts_t).where(attempts_t.c.job_id == job_id, attempts_t.c.number == number).values(
                status="RUNNING", executor=executor, pid=pid, pgid=pgid, worker_pid=worker_pid,
                handle=strict_json.dumps(handle) if handle else None, started_at=now))
            res = conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.status == "STARTING").values(
                status="RUNNING", started_at=now))
            if res.rowcount == 1:
                self._event(conn, job_id, "job.status", {"status": "RUNNING", "attempt": number, "pid": pid})
            return res.rowcount == 1

    @_writes
    def finish_attempt(self, job_id: str, number: int, *, status: str, reason: str | None = None,
                       exit_code: int | None = None, message: str | None = None, requeue: bool | None = None,
                       retry_on: Iterable[str] = (), never_ran: bool = False) -> dict[str, Any]:
        """Close attempt `number`; the job becomes `status`, or PENDING again when it is retried.

        The retry is decided here, in the same transaction: `requeue` forces it; otherwise a FAILED
        attempt whose `reason` is in `retry_on` is retried while attempts are left and the job is
        not being cancelled. `never_ran` (the child was stopped before it ran anything) retries
        it and gives the attempt back to the budget.

        Idempotent: an attempt that is already closed is left as it is (no second event), so a
        completion can be replayed safely.
        """
        if status not in TERMINAL:
            raise ValueError(f"finish_attempt needs a terminal status, got {status}")
        now = time.time()
        with self.engine.begin() as conn:
            job = self._get(conn, job_id)
            res = conn.execute(update(attempts_t).where(
                attempts_t.c.job_id == job_id, attempts_t.c.number == number,
                attempts_t.c.status.in_(["STARTING", "RUNNING"])).values(
                status=status, reason=reason, exit_code=exit_code, message=message, finished_at=now))
            if res.rowcount == 0:
                return job  # closed already (a replay) or never opened
            cancelling = job["status"] == "CANCELLING"
            if requeue is None:
                if never_ran:
                    requeue = not cancelling
                else:
                    requeue = (status == "FAILED" and reason in set(retry_on) and not cancelling
                               and number < job["max_attempts"])
            job_status = "PENDING" if requeue else status
            values: dict[str, Any] = dict(status=job_status, reason=reason, exit_code=exit_code, message=message,
                                          finished_at=None if requeue else now)
            if requeue and never_ran:
                values["max_attempts"] = jobs_t.c.max_attempts + 1
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.attempt == number).values(**values))
            data: dict[str, Any] = {"status": job_status, "reason": reason, "attempt": number, "exit_code": exit_code}
            if requeue:
                data["retry_of"] = status
            if message:
                data["message"] = message
            self._event(conn, job_id, "job.status", data)
            return self._get(conn, job_id)

    @_writes
    def request_cancel(self, job_id: str) -> dict[str, Any]:
        """PENDING -> CANCELLED at once; STARTING/RUNNING -> CANCELLING (the scheduler stops it)."""
        now = time.time()
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, prefix=True)
            jid, status = job["id"], job["status"]
            if status in TERMINAL:
                raise InvalidTransition(f"job {jid} is already {status}; nothing to cancel")
            if status == "CANCELLING":
                return job
            if status == "PENDING":
                conn.execute(update(jobs_t).where(jobs_t.c.id == jid, jobs_t.c.status == "PENDING").values(
                    status="CANCELLED", reason="cancelled", finished_at=now))
                self._event(conn, jid, "job.status", {"status": "CANCELLED", "reason": "cancelled", "attempt": job["attempt"]})
            else:
                conn.execute(update(jobs_t).where(jobs_t.c.id == jid, jobs_t.c.status.in_(["STARTING", "RUNNING"])).values(
                    status="CANCELLING"))
                self._event(conn, jid, "job.status", {"status": "CANCELLING", "attempt": job["attempt"]})
            return self._get(conn, jid)

    @_writes
    def retry_job(self, job_id: str, extra_attempts: int) -> dict[str, Any]:
        """Re-queue a FAILED or CANCELLED job with `extra_attempts` more attempts."""
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, prefix=True)
            if job["status"] not in ("FAILED", "CANCELLED"):
                raise InvalidTransition(f"job {job['id']} is {job['status']}; only FAILED or CANCELLED jobs can be retried")
            conn.execute(update(jobs_t).where(jobs_t.c.id == job["id"]).values(
                status="PENDING", finished_at=None, max_attempts=job["attempt"] + extra_attempts))
            self._event(conn, job["id"], "job.status", {"status": "PENDING", "attempt": job["attempt"], "manual_retry": True})
            return self._get(conn, job["id"])

    @_writes
    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Remove a finished job with its attempts and events; returns the job as it was.

        A job that is not finished is refused (cancel it first): its child may still be running.
        """
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, prefix=True)
            if job["status"] not in TERMINAL:
                raise InvalidTransition(f"job {job['id']} is {job['status']}; cancel it before deleting it")
            self._delete(conn, [job["id"]])
            self._event(conn, None, "job.deleted", {"deleted": [job["id"]]})
            return job

    @_writes
    def prune(self, finished_before: float, *, dry_run: bool = False) -> list[dict[str, Any]]:
        """Remove every finished job that finished before `finished_before` (epoch s); returns them."""
        with self.engine.begin() as conn:
            q = select(*[jobs_t.c[n] for n in SUMMARY_COLUMNS]).where(
                jobs_t.c.status.in_(sorted(TERMINAL)), jobs_t.c.finished_at < finished_before).order_by(jobs_t.c.seq)
            gone = [_job_dict(r) for r in conn.execute(q).mappings()]
            if gone and not dry_run:
                ids = [j["id"] for j in gone]
                for i in range(0, len(ids), 500):  # stay under any driver's bound-parameter limit
                    self._delete(conn, ids[i:i + 500])
                self._event(conn, None, "job.deleted", {"deleted": ids})
            return gone

    @staticmethod
    def _delete(conn: Connection, ids: list[str]) -> None:
        conn.execute(delete(events_t).where(events_t.c.job_id.in_(ids)))
        conn.execute(delete(attempts_t).where(attempts_t.c.job_id.in_(ids)))
        conn.execute(delete(jobs_t).where(jobs_t.c.id.in_(ids)))

    @_writes
    def set_run_dir(self, job_id: str, run_dir: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(run_dir=run_dir))

    @_writes
    def set_last_metrics(self, job_id: str, record: dict[str, Any]) -> None:
        text = strict_json.dumps(record)
        if len(text) > METRICS_MAX_BYTES:
            text = strict_json.dumps({"truncated": True, "bytes": len(text)})
        with self.engine.begin() as conn:
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id).values(last_metrics=text))

    # ------------------------------------------------------------ attempts
    @_reads
    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        q = select(attempts_t).where(attempts_t.c.job_id == job_id).order_by(attempts_t.c.number)
        with self._read() as conn:
            return [_attempt_dict(r) for r in conn.execute(q).mappings()]

    @_reads
    def live_attempts(self) -> list[dict[str, Any]]:
        """Attempts still STARTING or RUNNING (after a crash: left by a dead worker)."""
        q = select(attempts_t).where(attempts_t.c.status.in_(["STARTING", "RUNNING"])).order_by(attempts_t.c.id)
        with self._read() as conn:
            return [_attempt_dict(r) for r in conn.execute(q).mappings()]

    # ------------------------------------------------------------ events
    @_writes
    def add_event(self, job_id: str | None, type: str, data: dict[str, Any]) -> int:
        with self.engine.begin() as conn:
            return self._event(conn, job_id, type, data)

    @_reads
    def events_since(self, last_id: int = 0, limit: int = 500, job_id: str | None = None) -> list[dict[str, Any]]:
        q = select(events_t).where(events_t.c.id > last_id)
        if job_id is not None:
            q = q.where(events_t.c.job_id == job_id)
        q = q.order_by(events_t.c.id).limit(limit)
        with self._read() as conn:
            return [_event_dict(r) for r in conn.execute(q)]

    @_reads
    def last_event_id(self) -> int:
        with self._read() as conn:
            return conn.execute(select(func.max(events_t.c.id))).scalar() or 0

    # ------------------------------------------------------------ internals
    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(readonly=True)

    def _event(self, conn: Connection, job_id: str | None, type: str, data: dict[str, Any]) -> int:
        ts = time.time()
        data = strict_json.finite(data)
        res = conn.execute(insert(events_t).values(ts=ts, job_id=job_id, type=type, data=strict_json.dumps(data)))
        ev_id = int(res.inserted_primary_key[0])
        pending = getattr(self._pending, "items", None)
        if pending is not None:
            pending.append({"id": ev_id, "ts": ts, "job_id": job_id, "type": type, **data})
        return ev_id

    def _get(self, conn: Connection, job_id: str, prefix: bool = False) -> dict[str, Any]:
        row = conn.execute(select(*_JOB_COLS).where(jobs_t.c.id == job_id)).mappings().first()
        if row is None and prefix and len(job_id) >= 4:
            rows = conn.execute(select(*_JOB_COLS).where(jobs_t.c.id.startswith(job_id, autoescape=True)).limit(2)).mappings().all()
            if len(rows) == 1:
                row = rows[0]
        if row is None:
            raise JobNotFound(job_id)
        return _job_dict(row)


def _sqlite_begin(conn: Connection) -> None:
    # SQLite only. Writers take the lock up front (no upgrade deadlocks); readers never block writers in WAL.
    conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get("readonly") else "BEGIN IMMEDIATE")


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # SQLite only.
    dbapi_conn.isolation_level = None  # SQLAlchemy's "begin" listener issues BEGIN IMMEDIATE
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _json_col(text: str | None) -> Any:
    if not text:
        return None
    try:
        return strict_json.loads(text)
    except ValueError:  # not JSON at all: an old row or a hand edit; never fail the read for it
        return None


def _job_dict(r: Any) -> dict[str, Any]:
    d = dict(r)
    d.pop("seq", None)
    if "spec" in d:
        d["spec"] = _json_col(d["spec"]) or {}
    if "last_metrics" in d:
        d["last_metrics"] = _json_col(d["last_metrics"])
    return d


def _attempt_dict(r: Any) -> dict[str, Any]:
    d = dict(r)
    d["handle"] = _json_col(d["handle"])
    return d


def _event_dict(r: Any) -> dict[str, Any]:
    data = _json_col(r.data)
    return {"id": r.id, "ts": r.ts, "job_id": r.job_id, "type": r.type, **(data if isinstance(data, dict) else {})}
