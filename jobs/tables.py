"""The store's tables and their migrations (SQLAlchemy Core; the same on SQLite and Postgres).

An attempt row carries the identity of its child (`handle`: launcher pid and start time, process
group, cgroup, container id or Slurm job id) before the child may run, and, since schema 3, the
worker that holds it (`worker_id`) and its lease (`lease_until`, the database's clock). A worker
renews the leases of its attempts with its heartbeat; any worker's reaper closes an attempt whose
lease ran out as `worker_lost` (see jobs/store_cluster.py).

Migrations are our own short, append-only list rather than alembic: two backends, a handful of
columns, one transaction each (Postgres DDL is transactional; SQLite's ADD COLUMN too), guarded by
an advisory lock on Postgres so that workers starting together migrate once. Each step checks what
exists, so it is safe on a fresh store (created from this file's tables) and on an old one.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import (
    BigInteger, Column, Connection, Float, ForeignKey, Index, Integer, LargeBinary, MetaData, String, Table, Text,
    inspect, text,
)

__all__ = ["metadata", "jobs_t", "attempts_t", "events_t", "workers_t", "log_chunks_t", "metric_rows_t",
           "schema_version_t", "MIGRATIONS", "SCHEMA_VERSION"]

metadata = MetaData()

jobs_t = Table(
    "jobs", metadata,
    Column("id", String(32), primary_key=True),
    Column("seq", Integer, nullable=False),  # submit order, the FIFO tie-break
    Column("name", String(200), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("reason", String(32)),
    Column("message", Text),
    Column("priority", Integer, nullable=False, default=0),
    Column("gpus", Integer, nullable=False, default=0),
    Column("attempt", Integer, nullable=False, default=0),  # also the fencing epoch: +1 at every claim
    Column("max_attempts", Integer, nullable=False, default=1),
    Column("spec", Text, nullable=False),
    Column("run_dir", Text),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("exit_code", Integer),
    Column("last_metrics", Text),
    # schema 3
    Column("min_vram", BigInteger, nullable=False, default=0),  # bytes per GPU the job needs
    Column("executor", String(16), nullable=False, default="process"),
    Column("worker_id", String(64)),  # the worker of the current (or last) attempt
    # schema 4
    Column("submit_key", String(64)),  # the client's idempotency key: a repeated submit gets this job back
    Index("ix_jobs_claim", "status", "priority", "seq"),
)

attempts_t = Table(
    "attempts", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(32), ForeignKey("jobs.id"), nullable=False, index=True),
    Column("number", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("reason", String(32)),
    Column("message", Text),
    Column("executor", String(16)),
    Column("pid", Integer),
    Column("pgid", Integer),
    Column("handle", Text),  # the executor's identity of the child (pid + start time, cgroup, container id)
    Column("worker_pid", Integer),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("exit_code", Integer),
    # schema 3
    Column("worker_id", String(64)),
    Column("lease_until", Float),  # epoch seconds on the database's clock
    Column("run_dir", Text),  # on the holder's host
)

events_t = Table(
    "events", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("job_id", String(32), index=True),
    Column("type", String(32), nullable=False),
    Column("data", Text, nullable=False),
    sqlite_autoincrement=True,  # ids are never reused: they are SSE ids
)

# schema 3: the workers sharing a store, and the output they ship to it.
workers_t = Table(
    "workers", metadata,
    Column("id", String(64), primary_key=True),
    Column("instance", String(32), nullable=False),  # random per process start: tells restarts apart
    Column("host", String(255), nullable=False),
    Column("boot_id", String(64)),
    Column("pid", Integer),
    Column("url", Text),
    Column("status", String(16), nullable=False),  # up, lost, stopped
    Column("started_at", Float, nullable=False),
    Column("heartbeat_at", Float),  # the database's clock
    Column("lease_until", Float),
    Column("heartbeat_timeout", Float),
    Column("info", Text),  # JSON: gpus, cpu slots, executors, version
)

log_chunks_t = Table(
    "log_chunks", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(32), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("pos", BigInteger, nullable=False),  # byte offset in the job's log as the API serves it
    Column("data", LargeBinary, nullable=False),
    Index("ix_log_chunks_job", "job_id", "pos"),
)

metric_rows_t = Table(
    "metric_rows", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(32), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("n", Integer, nullable=False),  # 0, 1, 2... per job: the API's metrics offset
    Column("data", Text, nullable=False),
    Index("ix_metric_rows_job", "job_id", "n"),
)

schema_version_t = Table("schema_version", metadata, Column("version", Integer, nullable=False))

def _m1_initial(conn: Connection) -> None:
    # A fresh store gets today's tables; the later steps below then find their columns present.
    for t in (jobs_t, attempts_t, events_t):
        t.create(conn, checkfirst=True)


def _m2_seq_index(conn: Connection) -> None:
    # `ps` pages the newest jobs first; the seq index makes that a short index walk.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_seq ON jobs (seq)"))  # SQLite and Postgres alike


def _add_column(conn: Connection, table: str, name: str, ddl: str) -> None:
    if name not in {c["name"] for c in inspect(conn).get_columns(table)}:
        conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}"))


def _m3_workers_and_leases(conn: Connection) -> None:
    """Several workers on one store: resources, the holder and lease of each attempt, shipped output."""
    _add_column(conn, "jobs", "min_vram", "BIGINT NOT NULL DEFAULT 0")
    _add_column(conn, "jobs", "executor", "VARCHAR(16) NOT NULL DEFAULT 'process'")
    _add_column(conn, "jobs", "worker_id", "VARCHAR(64)")
    _add_column(conn, "attempts", "worker_id", "VARCHAR(64)")
    _add_column(conn, "attempts", "lease_until", "DOUBLE PRECISION")
    _add_column(conn, "attempts", "run_dir", "TEXT")
    # Live attempts are few among all attempts ever made; the reaper and the heartbeat find them here.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_attempts_live ON attempts (status, worker_id)"))
    # Claims take the best PENDING job: priority high to low, then oldest; this index is that order.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_claim_order ON jobs (status, priority DESC, seq)"))
    for t in (workers_t, log_chunks_t, metric_rows_t):
        t.create(conn, checkfirst=True)


def _m4_submit_key(conn: Connection) -> None:
    """Idempotent submits: a key the client sends with a submit, unique among jobs (NULLs allowed)."""
    _add_column(conn, "jobs", "submit_key", "VARCHAR(64)")
    conn.execute(text("CREATE UNIQUE INDEX IF NOT EXISTS ux_jobs_submit_key ON jobs (submit_key)"))


# Append-only: entry N brings the schema from version N to N+1.
MIGRATIONS: list[Callable[[Connection], None]] = [_m1_initial, _m2_seq_index, _m3_workers_and_leases,
                                                  _m4_submit_key]
SCHEMA_VERSION = len(MIGRATIONS)
