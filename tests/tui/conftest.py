"""Fixtures for the dashboard tests: a REAL worker process, real jobs (the engine on the CPU)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tui_helpers import WorkerProcess, engine_job


@pytest.fixture(scope="session", autouse=True)
def _venv_on_path() -> Iterator[None]:
    # Jobs such as examples/toy.yaml run `python`: the worker's children must find this venv's.
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), old])
    yield
    os.environ["PATH"] = old


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


