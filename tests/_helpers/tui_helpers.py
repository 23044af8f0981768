"""Helpers shared by the dashboard tests (a module of its own: test files cannot import
`conftest`, whose name every test folder's conftest shares)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from jobs_helpers import WorkerProcess  # shared with the jobs tests (tests/_helpers/)

REPO = Path(__file__).resolve().parents[2]

JOB_SCRIPT = REPO / "bench" / "tui_job.py"


def engine_job(name: str, steps: int = 30, rate: float = 10.0, *extra: str) -> dict[str, Any]:
    """A command job running bench/tui_job.py: the real engine on the CPU, writing its real stats."""
    return {"kind": "command", "name": name, "workdir": str(REPO),
            "command": [sys.executable, str(JOB_SCRIPT), "--steps", str(steps), "--rate", str(rate), *extra],
            "limits": {"stop_grace": 2}}


def make_app(worker: WorkerProcess, **kwargs: Any) -> Any:
    from tui.app import DashboardApp

    kwargs.setdefault("poll_s", 0.2)
    kwargs.setdefault("refresh_s", 0.2)
    token = kwargs.pop("token", worker.token)
    url = kwargs.pop("url", worker.url)
    from jobs.client import JobsClient

    return DashboardApp(lambda: JobsClient(url, token, timeout=10.0), url=url, start_dir=str(REPO), **kwargs)


async def until(pilot: Any, cond: Any, timeout: float = 60.0, what: str = "condition") -> None:
    """Let the app run until `cond()` holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        await pilot.pause(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def cell_text(table: Any, row: str, col: str) -> str:
    value = table.get_cell(row, col)
    return value.plain if hasattr(value, "plain") else str(value)
