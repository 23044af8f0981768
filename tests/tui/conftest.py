"""Fixtures for the dashboard tests: a REAL worker process, real jobs (the engine on the CPU)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "jobs"))  # WorkerProcess, shared with the jobs tests

from jobs_helpers import WorkerProcess  # noqa: E402

JOB_SCRIPT = REPO / "bench" / "tui_job.py"


@pytest.fixture(scope="session", autouse=True)
def _venv_on_path() -> Iterator[None]:
    # Jobs such as examples/toy.yaml run `python`: the worker's children must find this venv's.
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), old])
    yield
    os.environ["PATH"] = old


def engine_job(name: str, steps: int = 30, rate: float = 10.0, *extra: str) -> dict[str, Any]:
    """A command job running bench/tui_job.py: the real engine on the CPU, writing its real stats."""
    return {"kind": "command", "name": name, "workdir": str(REPO),
            "command": [sys.executable, str(JOB_SCRIPT), "--steps", str(steps), "--rate", str(rate), *extra],
            "limits": {"stop_grace": 2}}


# Jobs that tests only need finished: submitted when the worker starts, so they run (mostly
# importing torch) while the tests before them run, instead of one after the other.
EARLY = {
    "report": engine_job("tui-report", 20, 40, "--samples"),
}
_early_ids: dict[str, str] = {}


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory, _venv_on_path: None) -> Iterator[WorkerProcess]:
    """One real worker for the whole session (each test uses its own jobs on it)."""
    w = WorkerProcess(tmp_path_factory.mktemp("tui-worker") / "home").start()
    with w.client() as c:
        for name, spec in EARLY.items():
            _early_ids[name] = c.submit(spec)["id"]
    yield w
    w.stop()


@pytest.fixture(scope="session")
def finished_job(worker: WorkerProcess) -> Callable[[str], str]:
    """`finished_job("report")`: the id of that EARLY job, once it has SUCCEEDED."""

    def get(name: str) -> str:
        with worker.client() as c:
            job = c.wait(_early_ids[name], timeout=180)
        assert job["status"] == "SUCCEEDED", job
        return job["id"]

    return get


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
