"""`JobStore`: jobs, attempts and events in SQLAlchemy Core, on SQLite (WAL) or Postgres.

SQLite is the default: one worker owns the store. With `OFFLOAD_JOBS_DB=postgresql+psycopg://...`
many workers on many hosts share one store: a claim selects its candidate `FOR UPDATE SKIP LOCKED`
(workers never wait on each other's candidates) and moves it with a conditional UPDATE
(`... WHERE status='PENDING'`). SQLite-only SQL lives in the functions marked "SQLite only", each
with a portable path beside it; the backend differences are in `store_base.py`.

An attempt's life in the store, so that no attempt runs twice and no completion is lost:

    claim_next      job PENDING -> STARTING, attempt row STARTING (no process yet), held by the
                    claiming worker with a lease (shared stores)
    mark_running    the held child's identity (pid, start time, cgroup / container / Slurm job)
                    and RUNNING, committed *before* the child is let go: a crash after this finds it
    finish_attempt  once, conditional on the attempt still being live (and, from its worker, still
                    that worker's): replaying a completion records it once, and a worker whose lease
                    was taken over (the reaper closed the attempt, maybe retried the job) records
                    nothing over the retry

The fencing token is the attempt itself: (job, attempt number, worker) while the attempt is live.
`jobs.attempt` grows by one at every claim, and a closed attempt is never reopened, so a write
conditional on it can land only while its writer still holds the lease. Workers, heartbeats and
the reaper are `store_cluster.py`; shipped logs and metrics `store_output.py`.

Every JSON column is written with `strict_json.dumps` (no NaN, no Infinity) and read with
`strict_json.loads`, so one diverging loss cannot poison a query.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, String, and_, case, delete, func, insert, literal, literal_column, or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from jobs import strict_json
from jobs.errors import InvalidTransition, JobNotFound
from jobs.store_base import LeaseLost, StoreBase, db_message, reads, writes
from jobs.store_cluster import ClusterMixin
from jobs.store_output import OutputMixin, note_bytes as _note_bytes
from jobs.tables import SCHEMA_VERSION, attempts_t, events_t, jobs_t, log_chunks_t, metric_rows_t, schema_version_t
from jobs.contract import JobState, LIVE, REASONS, Reason, STATES, TERMINAL

__all__ = ["JobStore", "LeaseLost", "STATES", "TERMINAL", "LIVE", "REASONS", "SCHEMA_VERSION", "SUMMARY_COLUMNS"]

METRICS_MAX_BYTES = 64 * 1024  # last_metrics is a summary for tables, not a data channel

_JOB_COLS = [c for c in jobs_t.c]
# What a table of jobs needs: no spec (up to 1 MiB each), no metrics.
SUMMARY_COLUMNS = ("id", "name", "kind", "status", "reason", "message", "priority", "gpus", "attempt",
                   "max_attempts", "run_dir", "created_at", "started_at", "finished_at", "exit_code", "worker_id")
_JSON_COLS = ("spec", "last_metrics")
_HELD = (JobState.STARTING, JobState.RUNNING)  # attempt statuses of a live attempt

_writes, _reads = writes, reads


class JobStore(ClusterMixin, OutputMixin, StoreBase):
    """Persistent jobs, attempts and events; every method is one transaction.

    `on_event`, if set, is called (in the writer's thread) with each event after its commit.
    Database failures surface as `StoreError` with the driver's message.
    """

    def __init__(self, url: str | Path, on_event: Callable[[dict[str, Any]], None] | None = None) -> None:
        super().__init__(url, on_event)

    def integrity_problem(self) -> str | None:
        """None when the store reads cleanly, else what is wrong (SQLite only: PRAGMA quick_check)."""
        if not self.is_sqlite:
            return None
        try:
            with self._read() as conn:
                rows = [r[0] for r in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]
        except SQLAlchemyError as exc:
            return db_message(exc)
        return None if rows == ["ok"] else "; ".join(str(r) for r in rows[:3])

    @_reads
    def schema_version(self) -> int:
        with self._read() as conn:
            return conn.execute(select(schema_version_t.c.version)).scalar_one()

    # ------------------------------------------------------------ jobs
    @_writes
    def create_job(self, spec: dict[str, Any], *, kind: str, name: str, priority: int = 0, gpus: int = 0,
                   max_attempts: int = 1, run_dir_for: Callable[[str], str] | None = None,
                   job_id: str | None = None, min_vram: int = 0, executor: str = "process",
                   submit_key: str | None = None) -> dict[str, Any]:
        """A new PENDING job; with `submit_key`, the job already made for that key when there is one
        (returned with `existing: True`), so a client that retries a submit never makes two."""
        now = time.time()
        job_id = job_id or self.new_id()
        with self.engine.begin() as conn:
            if self.is_postgres:  # submits on several workers at once: seq stays unique and in order
                conn.execute(select(func.pg_advisory_xact_lock(0x0FF10AD3)))
            if submit_key is not None:  # the lock above (Postgres) or the writer lock (SQLite) makes this race-free
                prior = conn.execute(select(jobs_t.c.id).where(jobs_t.c.submit_key == submit_key)).scalar()
                if prior is not None:
                    return {**self._get(conn, prior), "existing": True}
            seq = (conn.execute(select(func.max(jobs_t.c.seq))).scalar() or 0) + 1
            conn.execute(insert(jobs_t).values(
                id=job_id, seq=seq, name=name, kind=kind, status=JobState.PENDING, priority=priority, gpus=gpus,
                attempt=0, max_attempts=max_attempts, spec=strict_json.dumps(spec), created_at=now,
                run_dir=run_dir_for(job_id) if run_dir_for else None, min_vram=int(min_vram or 0),
                executor=executor, submit_key=submit_key,
            ))
            self.notify_queue(conn)
            self._event(conn, job_id, "job.created", {"status": JobState.PENDING, "name": name, "kind": kind, "attempt": 0})
            return self._get(conn, job_id)

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(6)

    @_reads
    def job_by_key(self, submit_key: str) -> dict[str, Any] | None:
        """The job a submit with this idempotency key made, if any."""
        with self._read() as conn:
            prior = conn.execute(select(jobs_t.c.id).where(jobs_t.c.submit_key == submit_key)).scalar()
            return self._get(conn, prior) if prior is not None else None

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
            return strict_json.dumps({"jobs": self.list_jobs(status, limit, summary=summary), "total": total,
                                      "shared": self.shared})
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
    def claim_next(self, *, gpu_slots: int, cpu_slots: int, gpu_vram: list[int] | None = None,
                   slurm_slots: int = 0, worker_id: str | None = None, lease_s: float | None = None,
                   run_root: str | None = None) -> dict[str, Any] | None:
        """Atomically move the best PENDING job that fits to STARTING with a new attempt.

        It fits when it needs no GPU and a CPU slot is free; or `g` GPUs and `g` free GPUs each
        have at least its `min_vram` (`gpu_vram`: the free GPUs' memory in bytes, unknown = 0);
        or it is an `executor: slurm` job and `slurm_slots` > 0 (Slurm places it). Best is
        highest priority, then oldest. With `worker_id` the attempt is that worker's, with a
        lease of `lease_s` seconds on the database's clock, and its run dir `run_root/<id>`.
        """
        vram = sorted(gpu_vram if gpu_vram is not None else [0] * max(0, gpu_slots), reverse=True)
        if not vram and cpu_slots <= 0 and slurm_slots <= 0:
            return None
        c = jobs_t.c
        local = [c.gpus == 0] if cpu_slots > 0 else []
        local += [and_(c.gpus == g, c.min_vram <= vram[g - 1]) for g in range(1, len(vram) + 1)]
        fits = [and_(c.executor != "slurm", or_(*local))] if local else []
        if slurm_slots > 0:
            fits.append(c.executor == "slurm")
        if not fits:
            return None
        # One statement: the best candidate, skipping rows another worker is claiming (Postgres), moved
        # to STARTING only if still PENDING. The (status, priority DESC, seq) index serves the order.
        cand = (select(c.id).where(c.status == JobState.PENDING, or_(*fits))
                .order_by(c.priority.desc(), c.seq).limit(1))
        if not self.is_sqlite:
            cand = cand.with_for_update(skip_locked=True)
        return self._claim(cand.scalar_subquery(), worker_id=worker_id, lease_s=lease_s, run_root=run_root)

    @_writes
    def claim_job(self, job_id: str, *, worker_id: str | None = None, lease_s: float | None = None,
                  run_root: str | None = None) -> dict[str, Any] | None:
        """Move one named PENDING job to STARTING with a new attempt, as `claim_next` does (None when it
        is no longer PENDING: cancelled, or another worker took it). The co-scheduler claims a batch's
        other members this way: they share the claimed job's slot, so no slot is checked here."""
        cand = select(jobs_t.c.id).where(jobs_t.c.id == job_id, jobs_t.c.status == JobState.PENDING)
        if not self.is_sqlite:
            cand = cand.with_for_update(skip_locked=True)
        return self._claim(cand.scalar_subquery(), worker_id=worker_id, lease_s=lease_s, run_root=run_root)

    @_reads
    def pending_jobs(self, kind: str | None = None, limit: int = 200) -> list[dict[str, Any]]:
        """PENDING jobs (of `kind`) with their specs, in claim order (highest priority, then oldest)."""
        c = jobs_t.c
        q = select(*_JOB_COLS).where(c.status == JobState.PENDING)
        if kind is not None:
            q = q.where(c.kind == kind)
        q = q.order_by(c.priority.desc(), c.seq).limit(limit)
        with self._read() as conn:
            return [_job_dict(r) for r in conn.execute(q).mappings()]

    def _claim(self, cand: Any, *, worker_id: str | None, lease_s: float | None,
               run_root: str | None) -> dict[str, Any] | None:
        c = jobs_t.c
        run_dir = literal(run_root.rstrip("/") + "/", String) + c.id if run_root else None
        values: dict[str, Any] = dict(status=JobState.STARTING, attempt=c.attempt + 1, reason=None, message=None,
                                      exit_code=None, finished_at=None)
        if worker_id is not None:
            values["worker_id"] = worker_id
        if run_dir is not None:
            values["run_dir"] = run_dir
        now = time.time()
        with self.engine.begin() as conn:
            row = conn.execute(update(jobs_t).where(c.id == cand, c.status == JobState.PENDING)
                               .values(**values).returning(*_JOB_COLS)).mappings().first()
            if row is None:
                return None  # nothing fits, or another worker won the race
            job = _job_dict(row)
            lease = self.now_expr() + lease_s if lease_s else None
            res = conn.execute(insert(attempts_t).values(
                job_id=job["id"], number=job["attempt"], status=JobState.STARTING, started_at=now, worker_id=worker_id,
                lease_until=lease, run_dir=job["run_dir"] if run_root else None).returning(attempts_t.c.lease_until))
            data: dict[str, Any] = {"status": JobState.STARTING, "attempt": job["attempt"]}
            if worker_id is not None:
                data["worker_id"] = worker_id
            self._event(conn, job["id"], "job.status", data)
            job["lease_until"] = res.scalar()
            return job

    @_writes
    def mark_running(self, job_id: str, number: int, *, executor: str, pid: int | None = None,
                     pgid: int | None = None, handle: dict[str, Any] | None = None, worker_pid: int | None = None,
                     worker_id: str | None = None) -> bool:
        """Record the held child's identity and move STARTING -> RUNNING, in one transaction.

        The caller lets the child run only after this returns True. False: the job was cancelled
        meanwhile (it stays CANCELLING, and the child must be stopped unrun); the identity is
        recorded either way, so a crash right after this still finds the child. Raises LeaseLost
        when the attempt is no longer live (a reaper closed it) or, with `worker_id`, not that
        worker's: the child must then be stopped unrun, and nothing recorded.
        """
        now = time.time()
        with self.engine.begin() as conn:
            self.lock_job(conn, job_id)
            a = attempts_t.c
            cond = [a.job_id == job_id, a.number == number, a.status == JobState.STARTING]
            if worker_id is not None:
                cond.append(a.worker_id == worker_id)
            res = conn.execute(update(attempts_t).where(*cond).values(
                status=JobState.RUNNING, executor=executor, pid=pid, pgid=pgid, worker_pid=worker_pid,
                handle=strict_json.dumps(handle) if handle else None, started_at=now))
            if res.rowcount != 1:
                raise LeaseLost(f"job {job_id} attempt {number} is no longer held here")
            res = conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.status == JobState.STARTING,
                                                    jobs_t.c.attempt == number).values(status=JobState.RUNNING, started_at=now))
            if res.rowcount == 1:
                data: dict[str, Any] = {"status": JobState.RUNNING, "attempt": number, "pid": pid}
                if worker_id is not None:
                    data["worker_id"] = worker_id
                self._event(conn, job_id, "job.status", data)
            return res.rowcount == 1

    @_writes
    def finish_attempt(self, job_id: str, number: int, *, status: str, reason: str | None = None,
                       exit_code: int | None = None, message: str | None = None, requeue: bool | None = None,
                       retry_on: Iterable[str] = (), never_ran: bool = False, worker_id: str | None = None,
                       only_if_expired: bool = False, output: dict[str, Any] | None = None,
                       note: str | None = None) -> dict[str, Any]:
        """Close attempt `number`; the job becomes `status`, or PENDING again when it is retried.

        The retry is decided here, in the same transaction: `requeue` forces it; otherwise a FAILED
        attempt whose `reason` is in `retry_on` is retried while attempts are left and the job is
        not being cancelled. `never_ran` (the child was stopped before it ran anything) retries
        it and gives the attempt back to the budget.

        Idempotent and fenced: an attempt that is already closed is left as it is (no second
        event), so a completion can be replayed safely, and one `worker_id` no longer holds (a
        reaper took it) is not recorded over what the reaper wrote. `only_if_expired` (the
        reaper) closes it only while its lease is still past due on the database's clock.
        `output` ({"log": bytes, "metrics": [records]}) is the attempt's last shipped output,
        written in the same transaction, so a finished job's log in the store is complete.
        The job is returned with `recorded`: whether this call closed the attempt.
        """
        if status not in TERMINAL:
            raise ValueError(f"finish_attempt needs a terminal status, got {status}")
        with self.engine.begin() as conn:
            job, closed = self._finish(conn, job_id, number, status=status, reason=reason, exit_code=exit_code,
                                       message=message, requeue=requeue, retry_on=retry_on, never_ran=never_ran,
                                       worker_id=worker_id, only_if_expired=only_if_expired, output=output,
                                       note=note)
            return {**job, "recorded": closed}

    @_writes
    def record_late_end(self, job_id: str, number: int, *, worker_id: str, status: str, reason: str | None,
                        exit_code: int | None, message: str | None, retry_on: Iterable[str] = (),
                        found_by: str) -> dict[str, Any] | None:
        """The real end of an attempt a reaper closed as worker_lost (its worker had lost its lease),
        found later in its run dir (exit.json) by `found_by`.

        The attempt gets its real result. When the job's retry has not been claimed yet (PENDING,
        still at this attempt), the job takes that result too, as if the end had been recorded in
        time: it ran once. Otherwise the retry stands and is recorded as a re-run (a `job.rerun`
        event and a log note), with this attempt's result kept. Once only: returns the job, or
        None when there was nothing to record (not closed by a reaper, or recorded already).
        """
        if status not in TERMINAL:
            raise ValueError(f"record_late_end needs a terminal status, got {status}")
        now = time.time()
        a = attempts_t.c
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, lock=True)
            res = conn.execute(update(attempts_t).where(
                a.job_id == job_id, a.number == number, a.worker_id == worker_id, a.status == JobState.FAILED,
                a.reason == Reason.WORKER_LOST, a.exit_code.is_(None)).values(
                status=status, reason=reason, exit_code=exit_code, message=message))
            if res.rowcount == 0:
                return None
            data: dict[str, Any] = {"attempt": number, "status": status, "reason": reason, "exit_code": exit_code,
                                    "found_by": found_by}
            if job["status"] == JobState.PENDING and job["attempt"] == number:
                requeue = (status == JobState.FAILED and reason in set(retry_on) and number < job["max_attempts"])
                if not requeue:
                    conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.attempt == number,
                                                      jobs_t.c.status == JobState.PENDING).values(
                        status=status, reason=reason, exit_code=exit_code, message=message, finished_at=now))
                    note = (f"[offload-jobs] attempt {number} ended {status} while its worker {worker_id} had lost "
                            f"its lease; found in its run dir (exit.json) by {found_by}, recorded; no re-run\n")
                    self._append_output(conn, job_id, number, _note_bytes(conn, job_id, note.strip()), [])
                    self._event(conn, job_id, "job.status", {**data, "late": True})
                    return self._get(conn, job_id)
            rerun = f"attempt {job['attempt']}" if job["attempt"] > number else "a retry"
            note = (f"[offload-jobs] attempt {number} had ended {status}" + (f" ({reason})" if reason else "")
                    + f" while its worker {worker_id} had lost its lease (found in its run dir by {found_by}); "
                    f"{rerun} is a re-run")
            self._append_output(conn, job_id, number, _note_bytes(conn, job_id, note), [])
            self._event(conn, job_id, "job.rerun", {**data, "rerun_attempt": job["attempt"],
                                                    "why": "its worker lost its lease before recording its end"})
            return self._get(conn, job_id)

    @_reads
    def reaped_attempts(self, worker_id: str, limit: int = 200) -> list[dict[str, Any]]:
        """`worker_id`'s attempts that a reaper closed as worker_lost with no exit: their real end may
        still be in the run dir (`record_late_end`)."""
        a = attempts_t.c
        q = (select(attempts_t).where(a.worker_id == worker_id, a.status == JobState.FAILED, a.reason == Reason.WORKER_LOST,
                                      a.exit_code.is_(None)).order_by(a.id.desc()).limit(limit))
        with self._read() as conn:
            return [_attempt_dict(r) for r in conn.execute(q).mappings()]

    @_writes
    def reap_attempt(self, job_id: str, number: int, *, retry_on: Iterable[str], never_ran: bool, message: str,
                     note: str | None = None) -> dict[str, Any] | None:
        """The reaper: close an attempt whose lease ran out as worker_lost and retry it per policy.

        Returns the job when this call closed it; None when it was not (or no longer) past due:
        its worker renewed in time, or another worker's reaper was first. `note` goes to the log.
        A job being cancelled ends CANCELLED: its worker is gone, and so is the attempt.
        """
        with self.engine.begin() as conn:
            self.lock_job(conn, job_id)
            cancelling = conn.execute(select(jobs_t.c.status).where(jobs_t.c.id == job_id)).scalar() == JobState.CANCELLING
            status, reason = (JobState.CANCELLED, Reason.CANCELLED) if cancelling else (JobState.FAILED, Reason.WORKER_LOST)
            job, closed = self._finish(conn, job_id, number, status=status, reason=reason, exit_code=None,
                                       message=None if cancelling else message, requeue=None, retry_on=retry_on,
                                       never_ran=never_ran, worker_id=None, only_if_expired=True, output=None,
                                       note=note)
            return job if closed else None

    def _finish(self, conn: Connection, job_id: str, number: int, *, status: str, reason: str | None,
                exit_code: int | None, message: str | None, requeue: bool | None, retry_on: Iterable[str],
                never_ran: bool, worker_id: str | None, only_if_expired: bool, output: dict[str, Any] | None,
                note: str | None = None) -> tuple[dict[str, Any], bool]:
        now = time.time()
        job = self._get(conn, job_id, lock=True)
        a = attempts_t.c
        cond = [a.job_id == job_id, a.number == number, a.status.in_(_HELD)]
        if worker_id is not None:
            cond.append(a.worker_id == worker_id)
        if only_if_expired:
            cond.append(a.lease_until < self.now_expr())
        res = conn.execute(update(attempts_t).where(*cond).values(
            status=status, reason=reason, exit_code=exit_code, message=message, finished_at=now))
        if res.rowcount == 0:
            return job, False  # closed already (a replay, or the reaper's), never opened, or not ours
        if output:
            self._append_output(conn, job_id, number, output.get("log") or b"", output.get("metrics") or [])
        if note:
            self._append_output(conn, job_id, number, _note_bytes(conn, job_id, note), [])
        cancelling = job["status"] == JobState.CANCELLING
        if requeue is None:
            if never_ran:
                requeue = not cancelling
            else:
                requeue = (status == JobState.FAILED and reason in set(retry_on) and not cancelling
                           and number < job["max_attempts"])
        job_status = JobState.PENDING if requeue else status
        values: dict[str, Any] = dict(status=job_status, reason=reason, exit_code=exit_code, message=message,
                                      finished_at=None if requeue else now)
        if requeue and never_ran:
            values["max_attempts"] = jobs_t.c.max_attempts + 1
        conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.attempt == number).values(**values))
        data: dict[str, Any] = {"status": job_status, "reason": reason, "attempt": number, "exit_code": exit_code}
        if requeue:
            data["retry_of"] = status
            self.notify_queue(conn)
        if message:
            data["message"] = message
        self._event(conn, job_id, "job.status", data)
        return self._get(conn, job_id), True

    @_writes
    def request_cancel(self, job_id: str) -> dict[str, Any]:
        """PENDING -> CANCELLED at once; STARTING/RUNNING -> CANCELLING (the scheduler stops it)."""
        now = time.time()
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, prefix=True)
            jid, status = job["id"], job["status"]
            if status in TERMINAL:
                raise InvalidTransition(f"job {jid} is already {status}; nothing to cancel")
            if status == JobState.CANCELLING:
                return job
            if status == JobState.PENDING:
                conn.execute(update(jobs_t).where(jobs_t.c.id == jid, jobs_t.c.status == JobState.PENDING).values(
                    status=JobState.CANCELLED, reason=Reason.CANCELLED, finished_at=now))
                self._event(conn, jid, "job.status", {"status": JobState.CANCELLED, "reason": Reason.CANCELLED, "attempt": job["attempt"]})
            else:
                conn.execute(update(jobs_t).where(jobs_t.c.id == jid, jobs_t.c.status.in_([JobState.STARTING, JobState.RUNNING])).values(
                    status=JobState.CANCELLING))
                self.notify_queue(conn)  # the worker holding it wakes and stops it
                self._event(conn, jid, "job.status", {"status": JobState.CANCELLING, "attempt": job["attempt"]})
            return self._get(conn, jid)

    @_writes
    def retry_job(self, job_id: str, extra_attempts: int) -> dict[str, Any]:
        """Re-queue a FAILED or CANCELLED job with `extra_attempts` more attempts."""
        with self.engine.begin() as conn:
            job = self._get(conn, job_id, prefix=True)
            if job["status"] not in (JobState.FAILED, JobState.CANCELLED):
                raise InvalidTransition(f"job {job['id']} is {job['status']}; only FAILED or CANCELLED jobs can be retried")
            conn.execute(update(jobs_t).where(jobs_t.c.id == job["id"]).values(
                status=JobState.PENDING, finished_at=None, max_attempts=job["attempt"] + extra_attempts))
            self.notify_queue(conn)
            self._event(conn, job["id"], "job.status", {"status": JobState.PENDING, "attempt": job["attempt"], "manual_retry": True})
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
        conn.execute(delete(log_chunks_t).where(log_chunks_t.c.job_id.in_(ids)))
        conn.execute(delete(metric_rows_t).where(metric_rows_t.c.job_id.in_(ids)))
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
    def attempt(self, job_id: str, number: int) -> dict[str, Any] | None:
        q = select(attempts_t).where(attempts_t.c.job_id == job_id, attempts_t.c.number == number)
        with self._read() as conn:
            row = conn.execute(q).mappings().first()
        return _attempt_dict(row) if row is not None else None

    @_reads
    def shipped(self, job_id: str, number: int) -> tuple[int, int]:
        """(log bytes, metrics records) shipped so far for attempt `number` (to resume after a restart)."""
        with self._read() as conn:
            log_bytes = conn.execute(select(func.coalesce(func.sum(func.length(log_chunks_t.c.data)), 0)).where(
                log_chunks_t.c.job_id == job_id, log_chunks_t.c.attempt == number)).scalar()
            rows = conn.execute(select(func.count()).select_from(metric_rows_t).where(
                metric_rows_t.c.job_id == job_id, metric_rows_t.c.attempt == number)).scalar()
        return int(log_bytes or 0), int(rows or 0)

    @_reads
    def live_attempts(self, worker_id: str | None = None) -> list[dict[str, Any]]:
        """Attempts still STARTING or RUNNING (after a crash: left by a dead worker); `worker_id`'s only."""
        q = select(attempts_t).where(attempts_t.c.status.in_(_HELD))
        if worker_id is not None:
            q = q.where(attempts_t.c.worker_id == worker_id)
        with self._read() as conn:
            return [_attempt_dict(r) for r in conn.execute(q.order_by(attempts_t.c.id)).mappings()]

    # ------------------------------------------------------------ events
    @_writes
    def add_event(self, job_id: str | None, type: str, data: dict[str, Any]) -> int:
        with self.engine.begin() as conn:
            return self._event(conn, job_id, type, data)

    @_reads
    def events_since(self, last_id: int = 0, limit: int = 500, job_id: str | None = None,
                     types: Iterable[str] | None = None) -> list[dict[str, Any]]:
        q = select(events_t).where(events_t.c.id > last_id)
        if job_id is not None:
            q = q.where(events_t.c.job_id == job_id)
        if types is not None:
            q = q.where(events_t.c.type.in_(list(types)))
        q = q.order_by(events_t.c.id).limit(limit)
        with self._read() as conn:
            return [_event_dict(r) for r in conn.execute(q)]

    @_reads
    def last_event_id(self) -> int:
        with self._read() as conn:
            return conn.execute(select(func.max(events_t.c.id))).scalar() or 0

    # ------------------------------------------------------------ internals
    def _get(self, conn: Connection, job_id: str, prefix: bool = False, lock: bool = False) -> dict[str, Any]:
        q = select(*_JOB_COLS).where(jobs_t.c.id == job_id)
        if lock and self.is_postgres:  # held until commit: the job's row is the first lock every writer takes
            q = q.with_for_update()
        row = conn.execute(q).mappings().first()
        if row is None and prefix and len(job_id) >= 4:
            rows = conn.execute(select(*_JOB_COLS).where(jobs_t.c.id.startswith(job_id, autoescape=True)).limit(2)).mappings().all()
            if len(rows) == 1:
                row = rows[0]
        if row is None:
            raise JobNotFound(job_id)
        return _job_dict(row)


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
