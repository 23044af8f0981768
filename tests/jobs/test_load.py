"""1,000 queued jobs: `GET /v1/jobs` latency at the API (reported; the target is p99 < 50 ms)."""

from __future__ import annotations

import time

import httpx


def test_list_latency_with_1000_queued_jobs(worker_factory) -> None:
    w = worker_factory()
    c = w.client()
    # gpus=1 jobs run one at a time; a high-priority blocker holds the slot so the rest stay queued.
    blocker = c.submit({"kind": "command", "command": "sleep 300", "resources": {"gpus": 1}, "priority": 1000})
    spec = {"kind": "command", "command": "echo queued", "resources": {"gpus": 1},
            "limits": {"max_duration": "10m"}, "env": {"A": "1"}}
    with httpx.Client(base_url=w.url, headers={"Authorization": f"Bearer {w.token}"}) as http:
        for i in range(999):
            assert http.post("/v1/jobs", json={"spec": {**spec, "name": f"q{i}"}}).status_code == 201
        samples = []
        for _ in range(100):
            t0 = time.perf_counter()
            r = http.get("/v1/jobs")
            samples.append(time.perf_counter() - t0)
            assert r.status_code == 200
    jobs = r.json()["jobs"]
    assert len(jobs) == 1000
    assert sum(j["status"] == "PENDING" for j in jobs) == 999
    samples.sort()
    p50, p99 = samples[49] * 1000, samples[98] * 1000
    print(f"\nGET /v1/jobs with 1,000 jobs: p50 {p50:.1f} ms, p99 {p99:.1f} ms (target p99 < 50 ms)")
    assert p99 < 500  # generous: shared CI machines are noisy; the figure above is the report
    c.cancel(blocker["id"])
