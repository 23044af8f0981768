"""kill -9 the worker mid-job, restart it: worker_lost, retried, succeeded, nothing lost."""

from __future__ import annotations

import time
from pathlib import Path

from jobs_helpers import pgid_alive

from jobs.store import JobStore

LINES = 15
# Each attempt prints numbered lines; attempt 1 is slow, so the worker dies in its middle.
COMMAND = (
    'n=0; while [ "$n" -lt %d ]; do n=$((n + 1)); echo "attempt $OFFLOAD_JOBS_ATTEMPT line $n"; '
    'if [ "$OFFLOAD_JOBS_ATTEMPT" = 1 ]; then sleep 0.2; fi; done' % LINES
)


def _attempt_lines(log: str, attempt: int) -> list[int]:
    prefix = f"attempt {attempt} line "
    return [int(ln[len(prefix):]) for ln in log.splitlines() if ln.startswith(prefix)]


def test_kill9_worker_mid_job_then_restart_retries_and_succeeds(worker_factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    w = worker_factory(home=home)
    c = w.client()
    other = c.wait(c.submit({"kind": "command", "command": "echo earlier"})["id"], timeout=30)
    job = c.submit({"kind": "command", "name": "survivor", "command": COMMAND})
    log_path = Path(job["run_dir"]) / "output.log"
    while len(_attempt_lines(log_path.read_text(), 1)) < 3:
        time.sleep(0.05)
    pgid = c.get(job["id"])["attempts"][0]["pgid"]
    c.close()

    w.kill9()
    time.sleep(0.5)
    assert pgid_alive(pgid), "the orphaned attempt keeps running (and writing its log) while no worker is up"
    before_restart = _attempt_lines(log_path.read_text(), 1)

    w2 = worker_factory(home=home)
    c2 = w2.client()
    done = c2.wait(job["id"], timeout=60)
    assert done["status"] == "SUCCEEDED" and done["attempt"] == 2
    assert [(a["status"], a["reason"]) for a in done["attempts"]] == [("FAILED", "worker_lost"), ("SUCCEEDED", None)]
    assert pgid_alive(pgid) == [], "recovery killed the orphaned process group"

    log = "".join(c2.follow_logs(job["id"]))
    first = _attempt_lines(log, 1)
    assert first[: len(before_restart)] == before_restart == list(range(1, len(before_restart) + 1))
    assert first == list(range(1, len(first) + 1)), "attempt 1's lines are all there, in order"
    assert _attempt_lines(log, 2) == list(range(1, LINES + 1))
    assert "lost: the worker died" in log

    # no record lost: both jobs and every event survive, ids strictly increasing
    ids = {j["id"] for j in c2.list()}
    assert {other["id"], job["id"]} <= ids
    assert c2.get(other["id"])["status"] == "SUCCEEDED"
    store = JobStore(home / "jobs.db")
    events = [e for e in store.events_since(0) if e["job_id"] == job["id"]]
    store.close()
    assert [e["status"] for e in events] == ["PENDING", "STARTING", "RUNNING", "PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    assert events[3]["reason"] == "worker_lost"
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)


def test_lost_attempt_without_retry_budget_fails_as_worker_lost(worker_factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    w = worker_factory(home=home)
    c = w.client()
    job = c.submit({"kind": "command", "command": "echo up; sleep 60", "retry": {"max_attempts": 1}})
    while "up" not in c.logs(job["id"])["data"]:
        time.sleep(0.05)
    pgid = c.get(job["id"])["attempts"][0]["pgid"]
    w.kill9()
    w2 = worker_factory(home=home)
    done = w2.client().wait(job["id"], timeout=30)
    assert (done["status"], done["reason"], done["attempt"]) == ("FAILED", "worker_lost", 1)
    assert pgid_alive(pgid) == []


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
