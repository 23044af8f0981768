"""Jobs' output in a shared store: log chunks and metrics rows, shipped by the worker that runs them.

With workers on several hosts, the API that a user asks may not be on the host that runs the job.
Workers ship what their jobs write (output.log bytes, metrics.jsonl records) to the store every
half second, and the last of it in the same transaction as the attempt's completion; every API
serves logs and metrics from the store. We ship rather than proxy because the store is the one
place every worker already reaches (no worker-to-worker ports, tokens or TLS), and because the
output of a worker that died or was cut off is what a user most wants to read.

A job's log is one byte stream across its attempts (`pos` is the offset the API serves); its
metrics are numbered records (`n`, the API's metrics offset). Writes are fenced like completions:
only the worker that holds a live attempt appends to it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, func, insert, select, update

from jobs import strict_json
from jobs.contract import JobState
from jobs.store_base import LeaseLost, reads, writes
from jobs.tables import attempts_t, jobs_t, log_chunks_t, metric_rows_t

__all__ = ["OutputMixin", "CHUNK_BYTES", "note_bytes"]

CHUNK_BYTES = 256 * 1024  # one row of log_chunks at most
METRICS_MAX_BYTES = 64 * 1024


class OutputMixin:
    @writes
    def append_output(self, job_id: str, number: int, worker_id: str, *, log: bytes = b"",
                      metrics: list[dict[str, Any]] | None = None) -> None:
        """Append attempt `number`'s new output; raises LeaseLost when `worker_id` no longer holds it."""
        if not log and not metrics:
            return
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            self.lock_job(conn, job_id)  # type: ignore[attr-defined]
            a = attempts_t.c
            held = conn.execute(select(a.id).where(a.job_id == job_id, a.number == number, a.worker_id == worker_id,
                                                   a.status.in_((JobState.STARTING, JobState.RUNNING)))).first()
            if held is None:
                raise LeaseLost(f"job {job_id} attempt {number} is no longer held by {worker_id}")
            self._append_output(conn, job_id, number, log, metrics or [])

    def _append_output(self, conn: Connection, job_id: str, number: int, log: bytes,
                       metrics: list[dict[str, Any]]) -> None:
        """Inside the caller's transaction, which holds the job's row."""
        if log:
            pos = self._log_size(conn, job_id)
            for i in range(0, len(log), CHUNK_BYTES):
                piece = log[i:i + CHUNK_BYTES]
                conn.execute(insert(log_chunks_t).values(job_id=job_id, attempt=number, pos=pos, data=piece))
                pos += len(piece)
        if metrics:
            n = conn.execute(select(func.max(metric_rows_t.c.n)).where(metric_rows_t.c.job_id == job_id)).scalar()
            n = -1 if n is None else int(n)
            conn.execute(insert(metric_rows_t), [
                {"job_id": job_id, "attempt": number, "n": n + 1 + i, "data": strict_json.dumps(r)}
                for i, r in enumerate(metrics)])
            last = strict_json.dumps(metrics[-1])
            if len(last) > METRICS_MAX_BYTES:
                last = strict_json.dumps({"truncated": True, "bytes": len(last)})
            conn.execute(update(jobs_t).where(jobs_t.c.id == job_id, jobs_t.c.attempt == number).values(last_metrics=last))

    @writes
    def append_log_note(self, job_id: str, number: int, text: str) -> None:
        """A line from the workers themselves (the reaper's why), whoever holds the job."""
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            self.lock_job(conn, job_id)  # type: ignore[attr-defined]
            self._append_output(conn, job_id, number, note_bytes(conn, job_id, text), [])

    @staticmethod
    def _log_size(conn: Connection, job_id: str) -> int:
        c = log_chunks_t.c
        row = conn.execute(select(c.pos, func.length(c.data)).where(c.job_id == job_id)
                           .order_by(c.pos.desc()).limit(1)).first()
        return 0 if row is None else int(row[0]) + int(row[1])

    @reads
    def read_log(self, job_id: str, offset: int = 0, limit: int | None = None) -> tuple[int, bytes, int]:
        """(start, bytes, size) of the job's shipped log, like `RunDir.read_log` (negative: from the end)."""
        c = log_chunks_t.c
        with self._read() as conn:  # type: ignore[attr-defined]
            size = self._log_size(conn, job_id)
            start = max(0, size + offset) if offset < 0 else min(offset, size)
            end = size if limit is None else min(size, start + limit)
            if end <= start:
                return start, b"", size
            rows = conn.execute(select(c.pos, c.data).where(c.job_id == job_id, c.pos < end,
                                                            c.pos > start - CHUNK_BYTES).order_by(c.pos)).all()
        out = bytearray()
        for pos, data in rows:
            data = bytes(data)
            lo, hi = max(start, pos), min(end, pos + len(data))
            if hi > lo:
                out += data[lo - pos:hi - pos]
        return start, bytes(out), size

    @reads
    def metric_records(self, job_id: str, offset: int = 0, limit: int = 5000) -> tuple[list[dict[str, Any]], int]:
        """(records, next_offset): shipped metrics records from number `offset` on."""
        c = metric_rows_t.c
        with self._read() as conn:  # type: ignore[attr-defined]
            rows = conn.execute(select(c.n, c.data).where(c.job_id == job_id, c.n >= offset)
                                .order_by(c.n).limit(limit)).all()
        records = []
        for _, data in rows:
            try:
                rec = strict_json.loads(data)
            except ValueError:
                rec = None
            records.append(rec if isinstance(rec, dict) else {})
        return records, (int(rows[-1][0]) + 1 if rows else max(0, offset))


def note_bytes(conn: Connection, job_id: str, text: str) -> bytes:
    """`text` as a line of its own: after a newline if the log so far does not end with one."""
    data = text.encode("utf-8", "replace")
    c = log_chunks_t.c
    row = conn.execute(select(c.data).where(c.job_id == job_id).order_by(c.pos.desc()).limit(1)).first()
    if row is not None and bytes(row[0])[-1:] != b"\n":
        data = b"\n" + data
    return data if data.endswith(b"\n") else data + b"\n"
