"""A worker of its own store reads it while its children run only when there is something to read."""

from __future__ import annotations

from pathlib import Path

from jobs_helpers import wait_until

from jobs.spec import parse_spec
from jobs.store import JobStore
from jobs.worker.intake import submit_job
from jobs.worker.scheduler import Scheduler


def test_a_running_job_is_polled_every_tick_but_the_store_is_read_when_woken(tmp_path: Path) -> None:
    """With a tick of 10 ms, a job running ~1.5 s is polled ~150 times; the store's queue and its
    cancellations are read when a submit, a cancel or the job's end wakes the loop, and once a second
    besides (every tick: ~150 claims). A cancel still stops the next job at once."""
    store = JobStore(tmp_path / "jobs.db")
    reads: list[str] = []
    for name in ("claim_next", "list_jobs"):
        real = getattr(store, name)
        setattr(store, name, lambda *a, _real=real, _name=name, **k: (reads.append(_name), _real(*a, **k))[1])
    sched = Scheduler(store, tmp_path, tick=0.01)
    sched.start()

    def submit(command: str) -> str:
        raw = {"kind": "command", "name": "held", "command": command}
        spec = parse_spec(raw)
        job, _ = submit_job(store, tmp_path, spec, spec.model_dump(mode="json", exclude_unset=True), None)
        sched.wake()  # what the API's submit does
        return job["id"]

    def status(job_id: str) -> str:
        return store.get_job(job_id)["status"]

    try:
        first = submit("sleep 1.5")
        wait_until(lambda: status(first) == "SUCCEEDED", timeout=60, what="the job's end")
        assert 1 <= reads.count("claim_next") < 20, reads
        assert reads.count("list_jobs") < 20, reads
        second = submit("sleep 60")
        wait_until(lambda: status(second) == "RUNNING", timeout=60, what="the second job to run")
        sched.cancel(second)
        wait_until(lambda: status(second) == "CANCELLED", timeout=30, what="the cancel")
    finally:
        sched.stop(timeout=10)
