"""The launcher enforces the worker's lease where the job runs, even with no worker left to do it."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from jobs.executors import Launch
from jobs.executors.process import ProcessExecutor
from jobs.rundir import RunDir
from jobs.worker.heartbeat import LeaseFiles


def _launch(tmp_path: Path, command: str, lease: Path) -> tuple[ProcessExecutor, object, RunDir]:
    rd = RunDir(tmp_path / "run").create({"kind": "command"})
    ex = ProcessExecutor()
    h = ex.start(Launch(job_id="leasejob", attempt=1, argv=["/bin/sh", "-c", command], env={"PATH": "/usr/bin:/bin"},
                        cwd=str(rd.path), run_dir=rd, lease_file=str(lease)))
    return ex, h, rd


def _wait(ex: ProcessExecutor, h: object, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = ex.poll(h)
        if out is not None:
            return out
        time.sleep(0.05)
    raise AssertionError("the attempt did not end")


def test_a_lease_that_is_not_renewed_stops_the_job_sigterm_first(tmp_path: Path) -> None:
    leases = LeaseFiles(tmp_path)
    leases.write("leasejob", 1, time.monotonic() + 1.5, grace=1.0)
    t0 = time.monotonic()
    ex, h, rd = _launch(tmp_path, "trap 'echo termed; exit 9' TERM; sleep 60 & wait", leases.path("leasejob", 1))
    ended = _wait(ex, h, 10)
    took = time.monotonic() - t0
    ex.cleanup(h)
    assert ended.fenced and ended.exit_code == 9 and took < 5  # SIGTERM at until - grace: it saved and left
    assert json.loads(rd.exit_file.read_text())["fenced"] == "lease"
    log = rd.log_file.read_text()
    assert "termed" in log and "stopped renewing its lease" in log


def test_a_job_that_ignores_sigterm_is_killed_at_the_deadline(tmp_path: Path) -> None:
    leases = LeaseFiles(tmp_path)
    leases.write("leasejob", 1, time.monotonic() + 1.0, grace=0.5)
    ex, h, rd = _launch(tmp_path, "trap '' TERM; sleep 60", leases.path("leasejob", 1))
    ended = _wait(ex, h, 10)
    ex.cleanup(h)
    assert ended.fenced and ended.signal == 9


def test_a_renewed_lease_lets_the_job_finish(tmp_path: Path) -> None:
    leases = LeaseFiles(tmp_path)
    leases.write("leasejob", 1, time.monotonic() + 1.0, grace=0.5)
    stop = threading.Event()

    def renew() -> None:  # what the heartbeat does after each renewal the store accepted
        while not stop.wait(0.2):
            leases.write("leasejob", 1, time.monotonic() + 1.0, grace=0.5, create=False)

    t = threading.Thread(target=renew)
    t.start()
    try:
        ex, h, rd = _launch(tmp_path, "sleep 3; echo finished", leases.path("leasejob", 1))
        ended = _wait(ex, h, 15)
        ex.cleanup(h)
    finally:
        stop.set()
        t.join()
    assert not ended.fenced and ended.exit_code == 0
    assert "finished" in rd.log_file.read_text()
