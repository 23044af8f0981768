"""1,000 queued jobs: `GET /v1/jobs` lists every one. Its latency is measured by
`python -m bench.api_latency` (tests assert no timings)."""

from __future__ import annotations

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
        r = http.get("/v1/jobs")
        assert r.status_code == 200
    jobs = r.json()["jobs"]
    assert len(jobs) == 1000
    assert sum(j["status"] == "PENDING" for j in jobs) == 999
    c.cancel(blocker["id"])
