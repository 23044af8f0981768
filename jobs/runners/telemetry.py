"""What a runner tells the world while it works: metrics, events, a progress bar, host memory.

- `MetricsWriter`: one JSON object per line in metrics.jsonl; NaN and infinities are written as
  null (strict JSON every reader can parse). `write_step` writes a step row: the contract's
  `StepMetrics` plus the engine stats it forwards (jobs/contract.py, the names every reader uses).
- `emit_event`: a line in the run dir's events.jsonl (`runner.*` types), e.g. host memory warnings,
  skipped checkpoints, cache counts.
- `progress_bar`: tqdm, written to the log as whole lines (no carriage returns in output.log).
- `HostMemoryWatch`: a thread that samples this process's RSS (psutil), keeps the peak per phase,
  and writes an event once when the box's free memory runs low, before the kernel's OOM killer acts.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import psutil

from jobs.contract import StepMetrics, engine_stats

__all__ = ["MetricsWriter", "emit_event", "progress_bar", "HostMemoryWatch", "json_safe", "quiet_libraries"]


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats replaced by None, recursively (tensors become numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        return json_safe(value.item())
    return value


class MetricsWriter:
    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        env = os.environ.get("OFFLOAD_JOBS_METRICS")
        self.path = Path(path) if path is not None else (Path(env) if env else None)

    def write_step(self, row: StepMetrics, stats: Mapping[str, Any] | None = None) -> None:
        """One step's row: `row` and every engine stat the screens chart (from `handle.stats()`)."""
        self.write({**row, **engine_stats(stats or {})})

    def write(self, record: Mapping[str, Any]) -> None:
        if self.path is None:
            return
        append_line(self.path, json.dumps(json_safe(record), allow_nan=False, separators=(",", ":")))


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append ``line`` and its newline with one write(2) on an O_APPEND descriptor (a short write
    continues it), not through a buffered file that may split a long line. A reader tailing the file
    while it grows must still take only lines that end in a newline (tui.feed, the tests)."""
    data = memoryview((line + "\n").encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def emit_event(run_dir: Path | None, type: str, **data: Any) -> None:
    """Append a `runner.<type>` record to events.jsonl (and echo it to the log)."""
    record = {"ts": time.time(), "type": f"runner.{type}", **json_safe(data)}
    print(f"[offload-jobs] {type}: " + ", ".join(f"{k}={v}" for k, v in data.items()), flush=True)
    if run_dir is None:
        return
    append_line(Path(run_dir) / "events.jsonl", json.dumps(record, allow_nan=False))


def quiet_libraries() -> None:
    """diffusers and transformers print progress bars and advice meant for notebooks; keep the log ours."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torchvision.*")
    try:
        import diffusers.utils.logging as dlog

        dlog.set_verbosity_error()
        dlog.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        import transformers.utils.logging as tlog

        tlog.set_verbosity_error()
        tlog.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


class _LineWriter:
    """tqdm writes '\\r'-refreshed lines; a log file wants one line per refresh."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").replace("\x1b[A", "")
        if text.strip():
            self.stream.write(text.rstrip("\n") + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int, initial: int = 0, desc: str = "train") -> Any:
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, file=sys.stderr if interactive else _LineWriter(sys.stderr),
                mininterval=0.5 if interactive else 5.0, ascii=not interactive, ncols=100, dynamic_ncols=False)


class HostMemoryWatch:
    """Samples RSS every `interval` s; `phase(name)` starts a new peak; warns once near the box's RAM."""

    def __init__(self, run_dir: Path | None, interval: float = 0.05, warn_fraction: float = 0.92) -> None:
        self.run_dir = run_dir
        self.interval = interval
        self.warn_fraction = warn_fraction
        self.proc = psutil.Process()
        self.total = psutil.virtual_memory().total
        self.peaks: dict[str, int] = {}
        self.current = "start"
        self.peak = 0
        self.warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-memory-watch", daemon=True)

    def __enter__(self) -> "HostMemoryWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sample()

    def rss(self) -> int:
        try:
            return int(self.proc.memory_info().rss)
        except psutil.Error:
            return 0

    def sample(self) -> int:
        rss = self.rss()
        self.peak = max(self.peak, rss)
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), rss)
        return rss

    def phase(self, name: str) -> None:
        self.sample()
        self.current = name
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = self.sample()
            if self.warned:
                continue
            vm = psutil.virtual_memory()
            used = 1.0 - vm.available / vm.total
            if used >= self.warn_fraction:
                self.warned = True
                emit_event(self.run_dir, "host_memory", message=(
                    f"host memory nearly full: {used:.0%} of {vm.total / 2**30:.1f} GiB in use, "
                    f"this job holds {rss / 2**30:.2f} GiB; the kernel may kill it (host_oom)"),
                    rss_bytes=rss, available_bytes=vm.available, total_bytes=vm.total, phase=self.current)
