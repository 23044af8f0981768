"""A worker that dies in the middle of a delete (the store row gone, the run dir not yet): its next
start finishes the delete instead of taking the run dir for a lost store and refusing to start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_helpers import WorkerProcess

from jobs.contract import JobState
from jobs.store import JobStore
from jobs.store_rebuild import DELETING


def _two_finished_jobs(w: WorkerProcess) -> list[str]:
    with w.client() as c:
        ids = [c.submit({"kind": "command", "name": f"j{i}", "command": "true"})["id"] for i in range(2)]
        for i in ids:
            assert c.wait(i, timeout=60)["status"] == JobState.SUCCEEDED
    return ids


def _die_mid_delete(home: Path, job_id: str, *, row_deleted: bool) -> None:
    """What a delete leaves when its worker is killed: the marker, and the row gone or not."""
    (home / DELETING).mkdir(exist_ok=True)
    (home / DELETING / job_id).touch()
    if row_deleted:
        store = JobStore(home / "jobs.db")
        try:
            store.delete_job(job_id)
        finally:
            store.close()


@pytest.fixture
def w(tmp_path: Path) -> Iterator[WorkerProcess]:
    worker = WorkerProcess(tmp_path / "home").start()
    yield worker
    worker.stop()


def test_a_restart_finishes_a_delete_its_worker_died_in(w: WorkerProcess) -> None:
    home = w.home
    gone, kept = _two_finished_jobs(w)
    w.stop()
    _die_mid_delete(home, gone, row_deleted=True)  # killed between the row and the run dir
    _die_mid_delete(home, kept, row_deleted=False)  # killed before the row went
    assert (home / "runs" / gone).is_dir()
    w.start()  # without the marker this start would refuse: a run dir the store does not hold
    with w.client() as c:
        assert [j["id"] for j in c.list()] == [kept]
    assert not (home / "runs" / gone).exists() and (home / "runs" / kept).is_dir()
    assert list((home / DELETING).iterdir()) == []


def test_delete_and_prune_leave_no_marker(w: WorkerProcess) -> None:
    a, b = _two_finished_jobs(w)
    with w.client() as c:
        c.delete(a[:6])  # a prefix: the marker still names the whole id
        assert not (w.home / "runs" / a).exists()
        c.prune(0)
        assert c.list() == [] and not (w.home / "runs" / b).exists()
    assert list((w.home / DELETING).iterdir()) == []
