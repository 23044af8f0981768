"""A worker process in the background of this machine: start it detached, wait for health, stop it.

`up --local` starts `python -m jobs.worker` in its own session (so closing the terminal or
Ctrl-C in it does not reach the worker), with its output in the state dir's `worker.log`.
`down --local` finds it through the `pid` the worker records in `worker.json`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jobs._cli.output import CliError

__all__ = ["LOG_FILE", "start_local_worker", "stop_local_worker", "worker_healthy"]

LOG_FILE = "worker.log"


def worker_healthy(url: str, timeout: float = 1.0) -> bool:
    """Does a worker answer /healthz at `url`?"""
    from jobs.client import JobsClient
    from jobs.errors import JobsError

    try:
        with JobsClient(url, timeout=timeout) as client:
            client.health()
    except JobsError:
        return False
    return True


def start_local_worker(home: Path, host: str, port: int, wait_s: float = 30.0) -> str:
    """Start a detached worker on host:port over `home`; return its URL once /healthz answers."""
    from jobs.home import read_worker_info, secure_home

    secure_home(home)
    log_path = home / LOG_FILE
    cmd = [sys.executable, "-m", "jobs.worker", "--host", host, "--port", str(port), "--home", str(home)]
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(f"\n--- offload-jobs up --local: {' '.join(cmd)}\n".encode())
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise CliError(f"the worker exited with code {code} while starting: "
                           f"{_error_line(log_path, start) or 'no output'} (full log: {log_path})")
        # The worker publishes worker.json once its socket is bound (the real port, too, for --port 0).
        info = read_worker_info(home) or {}
        if info.get("pid") == proc.pid and info.get("url") and worker_healthy(str(info["url"]), timeout=0.5):
            return str(info["url"])
        time.sleep(0.1)
    raise CliError(f"the worker started (pid {proc.pid}) but did not answer within {wait_s:.0f}s; see {log_path}")


def stop_local_worker(home: Path, wait_s: float = 15.0) -> int | None:
    """Stop the worker recorded in `home`'s worker.json: SIGTERM, then SIGKILL after `wait_s`.

    Returns its pid, or None when no worker of ours is running there.
    """
    from jobs.home import read_worker_info

    info: dict[str, Any] = read_worker_info(home) or {}
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0 or not _alive(pid) or not _is_worker(pid):
        return None
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return pid
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.05)
    return pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] != "Z"


def _is_worker(pid: int) -> bool:
    # worker.json can outlive its worker, and the pid be reused: only stop what looks like ours.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc (macOS): trust worker.json
    return any(mark in cmdline for mark in ("jobs.worker", "jobs/worker", "offload-jobs"))


def _error_line(path: Path, start: int) -> str:
    """The line that says why the worker stopped: its own `error:` line, else the last line that
    is not a library's footnote (SQLAlchemy's "Background on this error at: ..." link)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:"):].strip()
    for ln in reversed(lines):
        if not ln.startswith("(Background on this error") and not ln.startswith("Traceback") and ln != "^":
            return ln
    return ""
