"""The co-scheduler's claims on a real store (issue 32): which queued infer jobs join a claimed one,
and how long a just-submitted batchable job waits for partners. No children run here."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from jobs.contract import JobState
from jobs.store import JobStore
from jobs.worker.cosched import BATCH_WINDOW_S, claim_members, hold_for_partners


def _infer(tmp: Path, prompt: str, **infer: Any) -> dict[str, Any]:
    (tmp / "model").mkdir(exist_ok=True)
    return {"kind": "infer", "model": {"path": str(tmp / "model")}, "resources": {"gpus": 0},
            "infer": {"prompt": prompt, "steps": 3, "width": 32, "height": 32, **infer}}


def _add(store: JobStore, spec: dict[str, Any]) -> str:
    return store.create_job(spec, kind=spec["kind"], name=spec["infer"]["prompt"] if "infer" in spec else "c")["id"]


def test_claim_members_takes_the_same_key_in_queue_order_up_to_max_batch(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    lead = _add(store, _infer(tmp_path, "a", max_batch=3))
    other_steps = _add(store, _infer(tmp_path, "b", max_batch=3, steps=4))
    opted_out = _add(store, _infer(tmp_path, "c", max_batch=3, share_stream=False))
    same1 = _add(store, _infer(tmp_path, "d", max_batch=3, seed=7))
    same2 = _add(store, _infer(tmp_path, "e", max_batch=3, num_images=2))
    same3 = _add(store, _infer(tmp_path, "f", max_batch=3))  # past max_batch: stays queued
    job = store.claim_next(gpu_slots=0, cpu_slots=1)
    assert job["id"] == lead
    members = claim_members(store, job)
    assert [m["id"] for m in members] == [same1, same2]
    assert all(store.get_job(m)["status"] == JobState.STARTING and store.get_job(m)["attempt"] == 1 for m in (same1, same2))
    for left in (other_steps, opted_out, same3):
        assert store.get_job(left)["status"] == JobState.PENDING
    assert store.claim_job(same1) is None  # no longer PENDING: never claimed twice
    assert claim_members(store, store.claim_next(gpu_slots=0, cpu_slots=1)) == []  # other_steps: no partner


def test_a_just_submitted_batchable_job_waits_for_partners_until_its_batch_is_full(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.db")
    _add(store, _infer(tmp_path, "a", max_batch=2))
    now = time.time()
    assert 0 < hold_for_partners(store, now) <= BATCH_WINDOW_S
    assert hold_for_partners(store, now + BATCH_WINDOW_S + 0.01) == 0  # waited long enough
    _add(store, _infer(tmp_path, "b", max_batch=2))
    assert hold_for_partners(store, now) == 0  # full: claim at once
    other = JobStore(tmp_path / "other.db")
    _add(other, _infer(tmp_path, "a", share_stream=False))
    assert hold_for_partners(other, time.time()) == 0  # runs alone: no reason to wait
    _add(other, {"kind": "command", "command": "true"})
    assert hold_for_partners(other, time.time()) == 0
