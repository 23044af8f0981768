"""The worker's API latency, moved here from two timed tests (tests/jobs/test_load.py,
tests/jobs/test_worker_api.py), which now check only behaviour.

A real worker process (tests/_helpers/jobs_helpers.py) on a temporary state dir. Measured:

- `GET /v1/jobs` with a few jobs and with `--jobs` (default 1,000) queued: p50 and p99 over
  `--samples` calls, and the ratio p99(1,000) / p99(few): how listing scales with the queue
  (the target is p99 < 50 ms at 1,000 jobs);
- submit to RUNNING for a `sleep` command job, `--runs` times: the median, and the ratio of that
  median to a bare `GET /healthz` round trip on the same worker (what the scheduler adds to one
  HTTP call).

Ratios hold across machines better than milliseconds; both are printed.

    python -m bench.api_latency [--jobs 1000] [--samples 100] [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "_helpers")]

from jobs_helpers import WorkerProcess  # noqa: E402

QUEUED = {"kind": "command", "command": "echo queued", "resources": {"gpus": 1},
          "limits": {"max_duration": "10m"}, "env": {"A": "1"}}


def _timed(fn: Any, n: int) -> list[float]:
    """Seconds per call of `fn`, sorted."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return sorted(out)


def _pct(samples: list[float], q: float) -> float:
    return samples[min(len(samples) - 1, int(q * len(samples)))] * 1000


def measure(jobs: int, samples: int, runs: int) -> dict[str, float]:
    import httpx

    with tempfile.TemporaryDirectory() as tmp:
        w = WorkerProcess(Path(tmp) / "home").start()
        try:
            c = w.client()
            with httpx.Client(base_url=w.url, headers={"Authorization": f"Bearer {w.token}"}) as http:
                def get_jobs() -> None:
                    assert http.get("/v1/jobs").status_code == 200

                health = _timed(lambda: http.get("/healthz"), samples)
                # submit -> RUNNING on an idle worker
                to_running = []
                for _ in range(runs):
                    t0 = time.perf_counter()
                    job = c.submit({"kind": "command", "command": "sleep 1"})
                    while c.get(job["id"])["status"] not in ("RUNNING", "SUCCEEDED", "FAILED"):
                        time.sleep(0.002)
                    to_running.append(time.perf_counter() - t0)
                    c.cancel(job["id"])
                    c.wait(job["id"], timeout=30)
                few = _timed(get_jobs, samples)
                # gpus=1 jobs run one at a time; a high-priority blocker keeps the rest queued
                blocker = c.submit({"kind": "command", "command": "sleep 600", "resources": {"gpus": 1},
                                    "priority": 1000})
                have = len(c.list(summary=True))
                for i in range(jobs - have):
                    assert http.post("/v1/jobs", json={"spec": {**QUEUED, "name": f"q{i}"}}).status_code == 201
                many = _timed(get_jobs, samples)
                c.cancel(blocker["id"])
        finally:
            w.stop()
    return {
        "jobs": jobs,
        "list_few_p50_ms": _pct(few, 0.5), "list_few_p99_ms": _pct(few, 0.99),
        "list_many_p50_ms": _pct(many, 0.5), "list_many_p99_ms": _pct(many, 0.99),
        "list_p99_ratio": _pct(many, 0.99) / _pct(few, 0.99),
        "healthz_median_ms": statistics.median(health) * 1000,
        "submit_to_running_median_ms": statistics.median(to_running) * 1000,
        "submit_to_running_max_ms": max(to_running) * 1000,
        "submit_to_running_over_healthz": statistics.median(to_running) / statistics.median(health),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.api_latency", description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000, help="jobs in the queue for the second listing")
    ap.add_argument("--samples", type=int, default=100, help="GET calls per measurement")
    ap.add_argument("--runs", type=int, default=5, help="submit -> RUNNING runs")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    a = ap.parse_args(argv)
    r = measure(a.jobs, a.samples, a.runs)
    print(f"GET /v1/jobs, a few jobs: p50 {r['list_few_p50_ms']:.1f} ms, p99 {r['list_few_p99_ms']:.1f} ms")
    print(f"GET /v1/jobs, {a.jobs:,} jobs: p50 {r['list_many_p50_ms']:.1f} ms, p99 {r['list_many_p99_ms']:.1f} ms "
          f"(target p99 < 50 ms)")
    print(f"  ratio p99 {a.jobs:,} / few: {r['list_p99_ratio']:.2f}x")
    print(f"submit -> RUNNING: median {r['submit_to_running_median_ms']:.1f} ms, max "
          f"{r['submit_to_running_max_ms']:.1f} ms (target < 500 ms); GET /healthz median "
          f"{r['healthz_median_ms']:.1f} ms")
    print(f"  ratio submit->RUNNING / healthz: {r['submit_to_running_over_healthz']:.1f}x")
    if a.json:
        a.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
