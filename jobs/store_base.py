"""What every part of the store shares: the engine for either backend, the write/read wrappers,
the database's clock, and the few lines that differ between SQLite and Postgres.

SQLite (the default, one worker per store): WAL, BEGIN IMMEDIATE for writers, the worker's clock.
Postgres (`OFFLOAD_JOBS_DB=postgresql+psycopg://...`, many workers on many hosts):
- the connection gives up on a dead network within seconds (TCP keepalives and
  `tcp_user_timeout`), so a cut link fails a heartbeat instead of hanging it;
- time for leases is the server's (`clock_timestamp()`), so workers' clocks may disagree;
- every transaction that writes an event takes one advisory lock just before the insert, until its
  commit: event ids then commit in id order, and an SSE client resuming from id N never skips an
  event that committed late with a smaller id. It is the last lock any transaction takes, so it
  cannot close a cycle with row locks;
- NOTIFY (`offload_jobs_queue` when a job becomes claimable or is being cancelled,
  `offload_jobs_events` with each event) is sent at commit, so idle workers and event streams wake
  at once (jobs/worker/listen.py).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Float, cast, create_engine, event, func, insert, literal, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, SQLAlchemyError

from jobs import strict_json
from jobs.errors import StoreError
from jobs.tables import MIGRATIONS, SCHEMA_VERSION, events_t, schema_version_t

__all__ = ["StoreBase", "LeaseLost", "writes", "reads", "db_message", "QUEUE_CHANNEL", "EVENTS_CHANNEL",
           "redact_url"]

log = logging.getLogger("offload_jobs.store")

QUEUE_CHANNEL = "offload_jobs_queue"
EVENTS_CHANNEL = "offload_jobs_events"
_EVENT_LOCK = 0x0FF10AD1  # advisory lock keys (any constants unique to offload-jobs)
_MIGRATE_LOCK = 0x0FF10AD2

# libpq settings for a worker whose link may be cut: fail within seconds, never hang.
PG_CONNECT_ARGS = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                   "keepalives_count": 2, "tcp_user_timeout": 8000, "application_name": "offload-jobs"}


class LeaseLost(Exception):
    """The attempt is no longer this worker's: its lease ran out and another worker's reaper closed it.

    Not a user error: the scheduler drops the attempt (stopping what is left of it) and records
    nothing, because the store already holds its end and maybe a retry.
    """


def db_message(exc: SQLAlchemyError) -> str:
    """The driver's own one-line message ("database or disk is full"), not SQLAlchemy's essay."""
    orig = getattr(exc, "orig", None)
    msg = str(orig) if orig is not None else str(exc)
    return msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__


def redact_url(url: str) -> str:
    """The URL with its password replaced, for messages and `ps`."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def writes(method: Callable[..., Any]) -> Callable[..., Any]:
    """A write: database errors become StoreError, and its events reach `on_event` after commit."""

    @functools.wraps(method)
    def wrapper(self: "StoreBase", *args: Any, **kwargs: Any) -> Any:
        self._pending.items = []
        try:
            result = method(self, *args, **kwargs)
            items = self._pending.items
        except SQLAlchemyError as exc:
            raise StoreError(f"store {self.path_label}: {db_message(exc)}") from None
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


def reads(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: "StoreBase", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except SQLAlchemyError as exc:
            raise StoreError(f"store {self.path_label}: {db_message(exc)}") from None

    return wrapper


class StoreBase:
    """The engine, migrations and dialect helpers under `JobStore`."""

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
        self.path_label = str(self.path) if self.path is not None else redact_url(url)
        self.is_sqlite = url.startswith("sqlite")
        # Shared: many workers may hold attempts in this store, so leases, reaping and fencing apply.
        self.shared = not self.is_sqlite
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        elif url.startswith("postgresql"):
            given = set(make_url(url).query)
            kwargs["connect_args"] = {k: v for k, v in PG_CONNECT_ARGS.items() if k not in given}
            kwargs.update(pool_pre_ping=True, pool_size=int(os.environ.get("OFFLOAD_JOBS_DB_POOL", "8")),
                          max_overflow=8, pool_recycle=1800)
        try:
            self.engine = create_engine(url, **kwargs)
        except (SQLAlchemyError, ImportError) as exc:
            msg = db_message(exc) if isinstance(exc, SQLAlchemyError) else str(exc)
            raise StoreError(f"cannot open store {self.path_label}: {msg}") from None
        self.is_postgres = self.engine.dialect.name == "postgresql"
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
            # pysqlite's implicit transactions defeat BEGIN IMMEDIATE; take control of them.
            event.listen(self.engine, "begin", _sqlite_begin)
        self.migrate()
        self._file_id = self._stat_file()

    def _stat_file(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def check_file(self) -> None:
        """SQLite: raise StoreError when the store's file is no longer the one this process opened (deleted,
        or replaced by another file): what is written now would land in a file no one reads again."""
        if self.path is None or self._file_id is None:
            return
        now = self._stat_file()
        if now == self._file_id:
            return
        how = "deleted" if now is None else "replaced by another file"
        raise StoreError(f"the store file {self.path} was {how} under this running worker; it accepts no "
                         "submits: stop it, then restore the file, or start it with --rebuild-store to rebuild "
                         "the store from the run dirs")

    def close(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------ schema
    def migrate(self) -> int:
        """Apply pending migrations; returns the schema version."""
        try:
            with self.engine.begin() as conn:
                if self.is_postgres:  # workers starting together: one migrates, the others wait and find it done
                    conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATE_LOCK})
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
            if not self.is_sqlite:
                raise StoreError(f"cannot open or migrate store {self.path_label}: {db_message(exc)}") from None
            if self.path is not None and _disk_full(self.path.parent):
                # Not a damaged store: SQLite says "disk I/O error" when it cannot make its -wal/-shm files.
                raise StoreError(f"cannot open store {self.path_label} ({db_message(exc)}): the disk is full "
                                 f"({self.path.parent} has no free space); free some space and start again") from None
            raise StoreError(
                f"{self.path_label} is not a readable job store ({db_message(exc)}); restore it from a backup, "
                f"or move it aside (mv {self.path_label} {self.path_label}.broken) to start an empty store"
            ) from None
        except SQLAlchemyError as exc:
            raise StoreError(f"cannot open or migrate store {self.path_label}: {db_message(exc)}") from None
        return SCHEMA_VERSION

    # ------------------------------------------------------------ dialect helpers
    def db_now(self, conn: Connection) -> float:
        """Epoch seconds on the database's clock (the worker's own for SQLite: one host)."""
        if self.is_postgres:
            return float(conn.execute(text("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8")).scalar_one())
        return time.time()

    def now_expr(self) -> Any:
        """The database's clock in a statement (epoch seconds): leases computed where they are stored."""
        if self.is_postgres:
            return cast(func.extract("epoch", func.clock_timestamp()), Float)
        return literal(time.time(), Float)

    def lock_job(self, conn: Connection, job_id: str) -> None:
        """Postgres: hold the job's row until commit (SQLite's writer lock already serializes)."""
        if self.is_postgres:
            conn.execute(text("SELECT 1 FROM jobs WHERE id = :id FOR UPDATE"), {"id": job_id})

    def notify_queue(self, conn: Connection) -> None:
        """Wake idle workers at commit: a job became claimable, or a running one is being cancelled."""
        if self.is_postgres:
            conn.execute(text("SELECT pg_notify(:c, '')"), {"c": QUEUE_CHANNEL})

    def _event(self, conn: Connection, job_id: str | None, type: str, data: dict[str, Any]) -> int:
        if self.is_postgres:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k), pg_notify(:c, '')"), {"k": _EVENT_LOCK,
                                                                                     "c": EVENTS_CHANNEL})
        ts = time.time()
        data = strict_json.finite(data)
        res = conn.execute(insert(events_t).values(ts=ts, job_id=job_id, type=type, data=strict_json.dumps(data)))
        ev_id = int(res.inserted_primary_key[0])
        pending = getattr(self._pending, "items", None)
        if pending is not None:
            pending.append({"id": ev_id, "ts": ts, "job_id": job_id, "type": type, **data})
        return ev_id

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn.execution_options(readonly=True)


def _disk_full(path: Path, floor: int = 1 << 20) -> bool:
    """Less than `floor` bytes free for us on `path`'s filesystem."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < floor


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
