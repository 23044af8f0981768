"""JobStore: schema, claim order and atomicity, transitions, attempts and events."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from jobs.errors import InvalidTransition, JobNotFound, StoreError
from jobs.store import SCHEMA_VERSION, JobStore


@pytest.fixture
def store(tmp_path: Path) -> JobStore:
    s = JobStore(tmp_path / "jobs.db")
    yield s
    s.close()


def _job(store: JobStore, name: str = "j", priority: int = 0, gpus: int = 0, max_attempts: int = 3) -> dict:
    return store.create_job({"kind": "command", "command": "true"}, kind="command", name=name,
                            priority=priority, gpus=gpus, max_attempts=max_attempts)


def test_wal_and_schema_version(store: JobStore, tmp_path: Path) -> None:
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000
    assert store.schema_version() == SCHEMA_VERSION
    _job(store)
    again = JobStore(tmp_path / "jobs.db")  # reopening migrates nothing and keeps the data
    assert again.schema_version() == SCHEMA_VERSION and len(again.list_jobs()) == 1
    again.close()


def test_newer_schema_is_refused(store: JobStore, tmp_path: Path) -> None:
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE schema_version SET version = 999"))
    with pytest.raises(StoreError, match="newer"):
        JobStore(tmp_path / "jobs.db")


def test_claim_order_is_priority_then_fifo(store: JobStore) -> None:
    a, b, c, d = _job(store, "a"), _job(store, "b", priority=5), _job(store, "c"), _job(store, "d", priority=5)
    order = []
    while (j := store.claim_next(gpu_slots=1, cpu_slots=10)) is not None:
        order.append(j["name"])
    assert order == ["b", "d", "a", "c"]
    assert {a["id"], b["id"], c["id"], d["id"]} == {j["id"] for j in store.list_jobs(status="STARTING")}


def test_claim_respects_gpu_and_cpu_slots(store: JobStore) -> None:
    _job(store, "gpu", gpus=1, priority=9)
    _job(store, "cpu")
    assert store.claim_next(gpu_slots=0, cpu_slots=1)["name"] == "cpu"
    assert store.claim_next(gpu_slots=0, cpu_slots=1) is None
    assert store.claim_next(gpu_slots=0, cpu_slots=0) is None
    assert store.claim_next(gpu_slots=1, cpu_slots=0)["name"] == "gpu"


def test_concurrent_claims_take_each_job_once(tmp_path: Path) -> None:
    s = JobStore(tmp_path / "jobs.db")
    ids = {_job(s, f"j{i}")["id"] for i in range(60)}
    stores = [JobStore(tmp_path / "jobs.db") for _ in range(4)]  # separate engines, like separate workers
    claimed: list[str] = []
    lock = threading.Lock()

    def run(st: JobStore) -> None:
        while (j := st.claim_next(gpu_slots=0, cpu_slots=1)) is not None:
            with lock:
                claimed.append(j["id"])

    threads = [threading.Thread(target=run, args=(st,)) for st in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == sorted(ids)  # every job once, none twice
    assert all(len(s.attempts(i)) == 1 for i in ids)


def test_attempts_and_requeue(store: JobStore) -> None:
    j = _job(store)
    c = store.claim_next(gpu_slots=0, cpu_slots=1)
    assert (c["status"], c["attempt"]) == ("STARTING", 1)
    assert store.mark_running(j["id"], 1, executor="process", pid=123, pgid=123, handle={"pid": 123})
    assert store.live_attempts()[0]["handle"] == {"pid": 123}
    r = store.finish_attempt(j["id"], 1, status="FAILED", reason="worker_lost", requeue=True)
    assert (r["status"], r["reason"], r["finished_at"]) == ("PENDING", "worker_lost", None)
    assert store.claim_next(gpu_slots=0, cpu_slots=1)["attempt"] == 2
    store.mark_running(j["id"], 2, executor="process")
    done = store.finish_attempt(j["id"], 2, status="SUCCEEDED", exit_code=0)
    assert (done["status"], done["reason"], done["exit_code"]) == ("SUCCEEDED", None, 0)
    att = store.attempts(j["id"])
    assert [(a["number"], a["status"], a["reason"]) for a in att] == [(1, "FAILED", "worker_lost"), (2, "SUCCEEDED", None)]
    assert store.live_attempts() == []


def test_cancel_transitions(store: JobStore) -> None:
    pending = _job(store, "p")
    assert store.request_cancel(pending["id"])["status"] == "CANCELLED"
    with pytest.raises(InvalidTransition):
        store.request_cancel(pending["id"])
    running = _job(store, "r")
    store.claim_next(gpu_slots=0, cpu_slots=1)
    store.mark_running(running["id"], 1, executor="process")
    assert store.request_cancel(running["id"])["status"] == "CANCELLING"
    assert store.request_cancel(running["id"])["status"] == "CANCELLING"  # idempotent
    # cancelled while STARTING: mark_running refuses to flip CANCELLING back to RUNNING
    starting = _job(store, "s")
    store.claim_next(gpu_slots=0, cpu_slots=1)
    store.request_cancel(starting["id"])
    assert store.mark_running(starting["id"], 1, executor="process") is False
    assert store.get_job(starting["id"])["status"] == "CANCELLING"


def test_manual_retry(store: JobStore) -> None:
    j = _job(store, max_attempts=1)
    store.claim_next(gpu_slots=0, cpu_slots=1)
    store.finish_attempt(j["id"], 1, status="FAILED", reason="exit_nonzero", exit_code=1)
    r = store.retry_job(j["id"], 2)
    assert (r["status"], r["max_attempts"], r["attempt"]) == ("PENDING", 3, 1)
    store.claim_next(gpu_slots=0, cpu_slots=1)
    store.finish_attempt(j["id"], 2, status="SUCCEEDED", exit_code=0)
    with pytest.raises(InvalidTransition):
        store.retry_job(j["id"], 1)


def test_events_are_monotonic_and_reported_after_commit(tmp_path: Path) -> None:
    seen: list[dict] = []
    s = JobStore(tmp_path / "jobs.db", on_event=seen.append)
    j = _job(s)
    s.claim_next(gpu_slots=0, cpu_slots=1)
    s.mark_running(j["id"], 1, executor="process")
    s.finish_attempt(j["id"], 1, status="SUCCEEDED", exit_code=0)
    evs = s.events_since(0)
    assert [e["status"] for e in evs] == ["PENDING", "STARTING", "RUNNING", "SUCCEEDED"]
    assert [e["id"] for e in evs] == sorted({e["id"] for e in evs})
    assert [e["id"] for e in seen] == [e["id"] for e in evs]
    assert s.events_since(evs[1]["id"])[0]["id"] == evs[2]["id"]
    assert s.last_event_id() == evs[-1]["id"]
    with pytest.raises(InvalidTransition):
        s.request_cancel(j["id"])  # a failed write reports no events
    assert len(seen) == 4


def test_get_by_prefix_and_not_found(store: JobStore) -> None:
    j = _job(store)
    assert store.get_job(j["id"][:5])["id"] == j["id"]
    with pytest.raises(JobNotFound):
        store.get_job("zzzzzz")
    with pytest.raises(JobNotFound):
        store.get_job(j["id"][:3])  # too short to be a prefix


def test_list_json_matches_list(store: JobStore) -> None:
    for i in range(5):
        _job(store, f"j{i}", priority=i)
    c = store.claim_next(gpu_slots=0, cpu_slots=1)
    store.set_last_metrics(c["id"], {"step": 3, "loss": 0.25})
    for status, limit in [(None, None), ("PENDING", None), (None, 2), (["STARTING", "PENDING"], 10)]:
        fast = json.loads(store.list_jobs_json(status, limit))["jobs"]
        slow = store.list_jobs(status, limit)
        assert [j["id"] for j in fast] == [j["id"] for j in slow]
        for a, b in zip(fast, slow):
            assert a.keys() == b.keys()
            assert a["created_at"] == pytest.approx(b["created_at"])
            assert {k: v for k, v in a.items() if k != "created_at"} == {k: v for k, v in b.items() if k != "created_at"}
    assert store.counts()["PENDING"] == 4 and store.counts()["STARTING"] == 1
