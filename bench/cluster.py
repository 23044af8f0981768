"""Claim throughput and submit-to-RUNNING latency of the shared store (issue 13), on one machine.

    python -m bench.cluster                              # a private PostgreSQL from Debian's initdb
    python -m bench.cluster --pg postgresql+psycopg://user@host/db --json out.json

1. store claims/s: N jobs in the store, K claimer processes (each its own engine, as workers are)
   each taking jobs with `claim_next` (SKIP LOCKED on Postgres) until none is left; then the same
   with the attempt's whole life in the store (claim, mark_running, finish_attempt). SQLite's
   single-writer path with one claimer is the baseline, measured in the same run.
2. submit -> RUNNING on an idle cluster: two real workers on one Postgres, one job at a time
   submitted over HTTP, the time from the job.created event to its RUNNING event (both written
   with this machine's clock); the same for one worker on SQLite as the baseline.
3. end to end: 200 `true` jobs through two real workers, jobs/s.

Numbers depend on the machine and on what else runs on it: a ratio against the baseline taken in
the same run says more than the absolute figure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "_helpers"), str(REPO / "tests" / "jobs" / "cluster")]

SPEC = {"kind": "command", "command": "true", "retry": {"max_attempts": 1}}


def _claimer(url: str, wid: str, full: bool, start: Any, out: Any) -> None:
    from jobs.store import JobStore

    s = JobStore(url)
    start.wait()
    n, t0 = 0, time.perf_counter()
    while (j := s.claim_next(gpu_slots=0, cpu_slots=1, worker_id=wid, lease_s=30 if s.shared else None)) is not None:
        if full:
            s.mark_running(j["id"], j["attempt"], executor="process", worker_id=wid if s.shared else None)
            s.finish_attempt(j["id"], j["attempt"], status="SUCCEEDED", exit_code=0,
                             worker_id=wid if s.shared else None)
        n += 1
    out.put((n, t0, time.perf_counter()))
    s.close()


def claims_per_second(url: str, jobs: int, claimers: int, full: bool) -> dict[str, Any]:
    from jobs.store import JobStore

    s = JobStore(url)
    for i in range(jobs):
        s.create_job(SPEC, kind="command", name=f"b{i}")
    s.close()
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(url, f"w{k}", full, start, out)) for k in range(claimers)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # every process has its engine and has migrated
    start.set()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    n = sum(r[0] for r in results)
    span = max(r[2] for r in results) - min(r[1] for r in results)
    return {"jobs": n, "claimers": claimers, "full_attempt": full, "seconds": span, "per_second": n / span}


def submit_to_running(workers: list[Any], store_url: str, n: int) -> dict[str, Any]:
    from jobs.store import JobStore

    store = JobStore(store_url)
    lat = []
    with workers[0].client() as c:
        for i in range(n):
            job = c.submit({"kind": "command", "command": "sleep 0.2", "name": f"lat{i}"})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                evs = store.events_since(0, 50, job["id"])
                created = next((e["ts"] for e in evs if e["type"] == "job.created"), None)
                running = next((e["ts"] for e in evs if e.get("status") == "RUNNING"), None)
                if created and running:
                    lat.append(running - created)
                    break
                time.sleep(0.02)
            c.wait(job["id"], timeout=30)
            time.sleep(0.3)  # idle again before the next one
    store.close()
    lat.sort()
    return {"n": len(lat), "median_s": statistics.median(lat), "p95_s": lat[int(0.95 * (len(lat) - 1))],
            "max_s": lat[-1]}


def end_to_end(workers: list[Any], n: int) -> dict[str, Any]:
    from cluster_helpers import wait_all

    with workers[0].client() as c:
        t0 = time.monotonic()
        ids = [c.submit({"kind": "command", "command": "true", "name": f"e{i}"})["id"] for i in range(n)]
        jobs = wait_all(c, ids, timeout=600)
        took = time.monotonic() - t0
    ok = sum(1 for i in ids if jobs[i]["status"] == "SUCCEEDED")
    return {"jobs": n, "succeeded": ok, "seconds": took, "per_second": n / took}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.splitlines()[0])
    p.add_argument("--pg", default=os.environ.get("OFFLOAD_JOBS_TEST_PG"), help="admin URL of a PostgreSQL "
                                                                                "(default: start a private one)")
    p.add_argument("--jobs", type=int, default=2000, help="jobs per claim measurement")
    p.add_argument("--claimers", default="1,2,4,8")
    p.add_argument("--latency-jobs", type=int, default=30)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--claims-only", action="store_true", help="only the store's claim rates (no workers)")
    a = p.parse_args(argv)

    from cluster_helpers import ClusterWorker
    from jobs_helpers import WorkerProcess
    from pg_helpers import PostgresServer

    server = PostgresServer(a.pg) if a.pg else PostgresServer.start_private()
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()[0]}}
    tmp = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    try:
        rows = []
        sqlite_url = str(tmp / "claims.db")
        base = claims_per_second(sqlite_url, a.jobs, 1, False)
        rows.append({"store": "sqlite", **base})
        base_full = claims_per_second(str(tmp / "claims-full.db"), a.jobs, 1, True)
        rows.append({"store": "sqlite", **base_full})
        for k in [int(x) for x in a.claimers.split(",")]:
            for full in (False, True):
                name, url = server.fresh_database()
                rows.append({"store": "postgres", **claims_per_second(url, a.jobs, k, full)})
                server.drop_database(name)
        results["claims"] = rows
        print("store claims (one machine):")
        for r in rows:
            what = "claim+run+finish" if r["full_attempt"] else "claim"
            ratio = r["per_second"] / (base_full if r["full_attempt"] else base)["per_second"]
            print(f"  {r['store']:8} {r['claimers']} claimer(s) {what:17} {r['per_second']:7.0f}/s "
                  f"({r['jobs']} jobs in {r['seconds']:.2f}s; x{ratio:.2f} SQLite's one writer)")

        if a.claims_only:
            return 0
        name, url = server.fresh_database()
        ws = [ClusterWorker(tmp / f"w{i}", f"w{i}", url, timeout=10.0).start() for i in range(2)]
        try:
            results["latency_postgres"] = submit_to_running(ws, url, a.latency_jobs)
            results["end_to_end_postgres"] = end_to_end(ws, 200)
        finally:
            for w in ws:
                w.stop()
            server.drop_database(name)
        single = WorkerProcess(tmp / "single").start()
        try:
            results["latency_sqlite"] = submit_to_running([single], str(tmp / "single" / "jobs.db"), a.latency_jobs)
            results["end_to_end_sqlite"] = end_to_end([single], 200)
        finally:
            single.stop()
        for key in ("latency_postgres", "latency_sqlite"):
            r = results[key]
            print(f"submit -> RUNNING, idle, {key.split('_')[1]:8}: median {1000 * r['median_s']:.0f} ms, "
                  f"p95 {1000 * r['p95_s']:.0f} ms, max {1000 * r['max_s']:.0f} ms over {r['n']} jobs")
        for key in ("end_to_end_postgres", "end_to_end_sqlite"):
            r = results[key]
            who = "two workers on Postgres" if "postgres" in key else "one worker on SQLite"
            print(f"end to end, {who}: {r['jobs']} jobs in {r['seconds']:.1f}s ({r['per_second']:.1f}/s, "
                  f"{r['succeeded']} succeeded)")
    finally:
        if not a.pg:
            server.stop()
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
