"""Fixtures: a REAL worker (`python -m jobs.worker`) on a temporary state dir, and a client for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_helpers import WorkerProcess

from jobs.client import JobsClient


@pytest.fixture
def worker_factory(tmp_path: Path) -> Iterator:
    started: list[WorkerProcess] = []

    def make(*extra_args: str, home: Path | None = None) -> WorkerProcess:
        w = WorkerProcess(home or tmp_path / "home", *extra_args)
        started.append(w)
        return w.start()

    yield make
    for w in started:
        w.stop()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One worker shared by a test module (each test submits its own jobs)."""
    w = WorkerProcess(tmp_path_factory.mktemp("worker") / "home").start()
    yield w
    w.stop()


@pytest.fixture
def client(worker: WorkerProcess) -> Iterator[JobsClient]:
    with worker.client() as c:
        yield c
