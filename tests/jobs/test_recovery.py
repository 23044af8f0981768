"""kill -9 the worker mid-job, restart it: the running attempt is adopted and finishes once, with no
line lost; an attempt that died with the worker is worker_lost and retried; SIGTERM stops jobs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from jobs_helpers import pgid_alive

from jobs.store import JobStore

LINES = 15
# Each attempt prints numbered lines, and after line 5 waits for the test's go-ahead (a file in its
# run dir), so the worker dies and comes back in its middle.
COMMAND = (
    'n=0; while [ "$n" -lt %d ]; do n=$((n + 1)); echo "attempt $OFFLOAD_JOBS_ATTEMPT line $n"; '
    'if [ "$n" = 5 ]; then while [ ! -e "$OFFLOAD_JOBS_RUN_DIR/go-on" ]; do sleep 0.05; done; fi; done' % LINES
)


def _attempt_lines(log: str, attempt: int) -> list[int]:
    prefix = f"attempt {attempt} line "
    return [int(ln[len(prefix):]) for ln in log.splitlines() if ln.startswith(prefix)]


def test_kill9_worker_mid_job_then_restart_adopts_the_attempt(worker_factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    w = worker_factory(home=home)
    c = w.client()
    other = c.wait(c.submit({"kind": "command", "command": "echo earlier"})["id"], timeout=30)
    job = c.submit({"kind": "command", "name": "survivor", "command": COMMAND})
    log_path = Path(job["run_dir"]) / "output.log"
    while len(_attempt_lines(log_path.read_text(), 1)) < 5:
        time.sleep(0.05)
    pgid = c.get(job["id"])["attempts"][0]["pgid"]
    c.close()

    w.kill9()
    time.sleep(0.5)
    assert pgid_alive(pgid), "the attempt keeps running (and writing its log) while no worker is up"

    w2 = worker_factory(home=home)
    c2 = w2.client()
    assert c2.get(job["id"])["status"] == "RUNNING"
    (Path(job["run_dir"]) / "go-on").touch()
    done = c2.wait(job["id"], timeout=60)
    assert done["status"] == "SUCCEEDED" and done["attempt"] == 1, "adopted and finished, not run again"
    assert [(a["status"], a["reason"]) for a in done["attempts"]] == [("SUCCEEDED", None)]
    assert pgid_alive(pgid) == []

    log = "".join(c2.follow_logs(job["id"]))
    assert _attempt_lines(log, 1) == list(range(1, LINES + 1)), "every line of the one attempt, in order"
    assert _attempt_lines(log, 2) == []
    assert "still running and was adopted" in log

    # no record lost: both jobs and every event survive, ids strictly increasing
    ids = {j["id"] for j in c2.list()}
    assert {other["id"], job["id"]} <= ids
    assert c2.get(other["id"])["status"] == "SUCCEEDED"
    store = JobStore(home / "jobs.db")
    events = [e for e in store.events_since(0) if e["job_id"] == job["id"]]
    store.close()
    assert [e["status"] for e in events] == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)


def test_attempt_lost_with_the_worker_is_retried_or_fails_as_worker_lost(worker_factory, tmp_path: Path) -> None:
    # The whole attempt dies with the worker (as in a host crash): the launcher left no exit.json.
    home = tmp_path / "home"
    w = worker_factory(home=home)
    c = w.client()
    once = c.submit({"kind": "command", "command": "echo up; sleep 60", "retry": {"max_attempts": 1}})
    twice = c.submit({"kind": "command", "command": 'echo "up $OFFLOAD_JOBS_ATTEMPT"; [ "$OFFLOAD_JOBS_ATTEMPT" = 2 ] || sleep 60'})
    while "up" not in c.logs(once["id"])["data"] or "up 1" not in c.logs(twice["id"])["data"]:
        time.sleep(0.05)
    attempts = [c.get(j["id"])["attempts"][0] for j in (once, twice)]
    w.kill9()
    for a in attempts:
        os.kill(a["handle"]["launcher_pid"], signal.SIGKILL)  # the launcher first: no exit record
        os.killpg(a["pgid"], signal.SIGKILL)
    w2 = worker_factory(home=home)
    c2 = w2.client()
    done = c2.wait(once["id"], timeout=30)
    assert (done["status"], done["reason"], done["attempt"]) == ("FAILED", "worker_lost", 1)
    again = c2.wait(twice["id"], timeout=30)
    assert (again["status"], again["attempt"]) == ("SUCCEEDED", 2)
    assert [a["reason"] for a in again["attempts"]] == ["worker_lost", None]
    assert all(pgid_alive(a["pgid"]) == [] for a in attempts)


def test_second_worker_on_same_state_dir_is_refused(worker_factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    worker_factory(home=home)
    import pytest

    with pytest.raises(RuntimeError, match="already owns"):
        worker_factory(home=home)


def test_sigterm_ends_event_streams_and_requeues_running_jobs(worker_factory, tmp_path: Path) -> None:
    import threading

    home = tmp_path / "home"
    w = worker_factory(home=home)
    c = w.client()
    job = c.submit({"kind": "command", "command": 'echo "run $OFFLOAD_JOBS_ATTEMPT"; sleep 60', "limits": {"stop_grace": 1}})
    while "run 1" not in c.logs(job["id"])["data"]:
        time.sleep(0.05)
    pgid = c.get(job["id"])["attempts"][0]["pgid"]
    got: list[dict] = []
    ended = threading.Event()

    def listen() -> None:
        for ev in c.events(last_event_id=0):
            got.append(ev)
        ended.set()

    threading.Thread(target=listen, daemon=True).start()
    while not got:
        time.sleep(0.02)
    t0 = time.monotonic()
    w.stop()  # SIGTERM
    assert w.proc.returncode == 0
    assert ended.wait(10), "the event stream ended with the worker"
    assert time.monotonic() - t0 < 10
    assert pgid_alive(pgid) == []
    assert not (home / "worker.json").exists()

    w2 = worker_factory(home=home)
    c2 = w2.client()
    while c2.get(job["id"])["attempt"] < 2:
        time.sleep(0.05)
    j = c2.get(job["id"])
    assert j["attempts"][0]["reason"] == "worker_lost"
    c2.cancel(job["id"])
    assert c2.wait(job["id"], timeout=30)["status"] == "CANCELLED"
