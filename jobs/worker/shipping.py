"""Shipping a running attempt's output to a shared store (see jobs/store_output.py for why).

For each attempt this worker runs, `Shipment` remembers where in the local output.log and
metrics.jsonl the attempt's output starts and how far it was shipped. Every half second the
scheduler ships what is new (one transaction per attempt, fenced: a worker that lost the lease
ships nothing more); the rest goes in the completion's own transaction. Offsets move only after
a write committed, so a failed write is shipped again, never twice. After a worker restart an
adopted attempt resumes from what the store already has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from jobs import strict_json
from jobs.errors import RunDirError
from jobs.rundir import RunDir

__all__ = ["Shipment", "LOG_SHIP_MAX", "SHIP_EVERY_S"]

log = logging.getLogger("offload_jobs.shipping")

SHIP_EVERY_S = 0.5
LOG_SHIP_MAX = 64 << 20  # per attempt; the rest stays in the run dir on the worker's host
READ_MAX = 4 << 20  # per shipment
METRICS_SHIP_MAX = 500_000  # records per attempt


@dataclass
class Shipment:
    log_start: int  # offsets in the local files where this attempt's output begins
    metrics_start: int
    log_sent: int = 0  # bytes of this attempt's log shipped
    metrics_offset: int = 0  # local metrics.jsonl offset shipped up to
    metrics_sent: int = 0
    capped: bool = False
    last: float = 0.0

    @classmethod
    def begin(cls, run_dir: RunDir) -> "Shipment":
        """Before the attempt writes anything (its first log line is the worker's 'starting' note)."""
        log_size = _size(run_dir, "output.log")
        metrics_size = _size(run_dir, "metrics.jsonl")
        return cls(log_size, metrics_size, metrics_offset=metrics_size)

    @classmethod
    def resume(cls, run_dir: RunDir, info: dict, shipped: tuple[int, int]) -> "Shipment":
        """An adopted attempt: its starts were recorded with its identity; the store says how far it got."""
        log_start = int(info.get("log_start") or 0)
        metrics_start = int(info.get("metrics_start") or 0)
        s = cls(log_start, metrics_start, log_sent=shipped[0], metrics_offset=metrics_start, metrics_sent=shipped[1])
        if shipped[1]:
            s.metrics_offset = _offset_after(run_dir, metrics_start, shipped[1])
        return s

    def take(self, run_dir: RunDir, final: bool = False) -> tuple[bytes, list[dict], int]:
        """(new log bytes, new metrics records, the metrics offset they reach): not yet marked as sent."""
        data = b""
        if not self.capped:
            want = READ_MAX if not final else LOG_SHIP_MAX
            want = min(want, LOG_SHIP_MAX - self.log_sent)
            if want > 0:
                try:
                    _, data, _ = run_dir.read_log(self.log_start + self.log_sent, want)
                except Exception as exc:  # an unsafe output.log (a planted symlink): nothing to ship
                    log.warning("cannot read %s: %s", run_dir.log_file, exc)
                    data = b""
            if self.log_sent + len(data) >= LOG_SHIP_MAX:
                note = (f"\n[offload-jobs] the rest of this attempt's output (past {LOG_SHIP_MAX >> 20} MiB) is in "
                        f"{run_dir.log_file} on the worker's host\n").encode()
                data = data[: LOG_SHIP_MAX - self.log_sent] + note
        records: list[dict] = []
        offset = self.metrics_offset
        if self.metrics_sent < METRICS_SHIP_MAX:
            records, offset = run_dir.read_metrics(self.metrics_offset)
            records = records[: METRICS_SHIP_MAX - self.metrics_sent]
        return data, records, offset

    def sent(self, data: bytes, records: list[dict], offset: int) -> None:
        self.log_sent += len(data)
        if self.log_sent >= LOG_SHIP_MAX:
            self.capped = True
        self.metrics_sent += len(records)
        self.metrics_offset = offset


def _size(run_dir: RunDir, name: str) -> int:
    try:  # fstat of the safe descriptor: a planted FIFO or link counts as empty, never blocks
        return run_dir.size_of(name)
    except (OSError, RunDirError):
        return 0


def _offset_after(run_dir: RunDir, start: int, n: int) -> int:
    """The byte offset just past the `n`-th record `read_metrics` would give from `start`."""
    offset, count = start, 0
    try:
        data, _ = run_dir.read_bytes("metrics.jsonl", start)
    except (OSError, RunDirError):
        return offset
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            break
        offset += len(line)
        try:
            rec = strict_json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            count += 1
            if count == n:
                break
    return offset
