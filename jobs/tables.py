"""The store's tables and their migrations (SQLAlchemy Core; the same on SQLite and Postgres).

An attempt row carries the identity of its child (`handle`: launcher pid and start time, process
group, cgroup, or container id) before the child may run; a lease and heartbeat for workers on
several hosts would be two more columns here (`lease_until`, `heartbeat_at`) and a migration.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import Column, Connection, Float, ForeignKey, Index, Integer, MetaData, String, Table, Text, text

__all__ = ["metadata", "jobs_t", "attempts_t", "events_t", "schema_version_t", "MIGRATIONS", "SCHEMA_VERSION"]

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
    Column("attempt", Integer, nullable=False, default=0),
    Column("max_attempts", Integer, nullable=False, default=1),
    Column("spec", Text, nullable=False),
    Column("run_dir", Text),
    Column("created_at", Float, nullable=False),
    Column("started_at", Float),
    Column("finished_at", Float),
    Column("exit_code", Integer),
    Column("last_metrics", Text),
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

schema_version_t = Table("schema_version", metadata, Column("version", Integer, nullable=False))


def _m1_initial(conn: Connection) -> None:
    for t in (jobs_t, attempts_t, events_t):
        t.create(conn, checkfirst=True)


def _m2_seq_index(conn: Connection) -> None:
    # `ps` pages the newest jobs first; the seq index makes that a short index walk.
    conn.execute(text("CREATE INDEX IF NOT EXISTS ix_jobs_seq ON jobs (seq)"))  # SQLite and Postgres alike


# Append-only: entry N brings the schema from version N to N+1.
MIGRATIONS: list[Callable[[Connection], None]] = [_m1_initial, _m2_seq_index]
SCHEMA_VERSION = len(MIGRATIONS)

