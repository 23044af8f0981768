"""Issue 13's acceptance on one machine: two workers (separate state dirs and ports) on one Postgres.

- 200 short jobs each run exactly once, spread over both workers;
- kill -9 of one worker mid-job: its jobs are retried by the other within heartbeat_timeout + 5 s,
  the dead worker's orphans are stopped (by their launchers, from the lease file) before the retry
  starts, and nothing is lost or completed twice; a worker restarted in time adopts its jobs instead;
- GPUs and VRAM: a job pinned to `resources.min_vram` goes only to a worker whose GPUs have it;
- `ps`, logs, metrics and controls of a job running on the other worker, through this one's API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import ClusterWorker, audit, ledger, ledger_job, wait_all
from jobs_helpers import REPO, tagged_processes, wait_until

from jobs.errors import SpecError

# leases and heartbeats of a few seconds: run after the parallel part, away from its load (see pyproject)
pytestmark = pytest.mark.serial

TIMEOUT = 6.0  # heartbeat_timeout of these workers


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str):
    started: list[ClusterWorker] = []

    def add(name: str, *extra: str) -> ClusterWorker:
        w = ClusterWorker(tmp_path / name, name, pg_url, *extra, timeout=TIMEOUT)
        started.append(w)
        return w.start()

    yield add
    for w in started:
        w.stop()


def test_200_short_jobs_run_exactly_once_across_two_workers(cluster, tmp_path: Path) -> None:
    a, b = cluster("wa", "--max-cpu-jobs", "4"), cluster("wb", "--max-cpu-jobs", "4")
    book = tmp_path / "ledger"
    book.mkdir()
    with a.client() as ca, b.client() as cb:
        t0 = time.monotonic()
        ids = [(ca if i % 2 else cb).submit(ledger_job(book, name=f"s{i}"))["id"] for i in range(200)]
        jobs = wait_all(cb, ids, timeout=120)
        took = time.monotonic() - t0
        counts = audit(cb, book, ids)
        by_worker = {w: sum(1 for i in ids if jobs[i].get("worker_id") == w) for w in ("wa", "wb")}
        print(f"\n[two workers] 200 jobs in {took:.1f}s; ran on {by_worker}; {counts}")
        assert counts == dict.fromkeys(counts, 0)
        assert all(jobs[i]["attempt"] == 1 for i in ids)
        assert min(by_worker.values()) >= 20, by_worker  # both claimed, side by side
        for i in ids:  # the ledger (outside the store) agrees: one start, one end, on the worker the store names
            lines = ledger(book, i)
            assert [ln[0] for ln in lines] == ["start", "end"]
            assert lines[0][3] == jobs[i]["worker_id"]


def test_kill_9_mid_job_is_retried_by_the_other_worker(cluster, tmp_path: Path) -> None:
    a = cluster("wa", "--max-cpu-jobs", "3")
    book, gate = tmp_path / "ledger", tmp_path / "gate"
    book.mkdir()
    with a.client() as ca:
        on_a = [ca.submit(ledger_job(book, gate=gate, name=f"a{i}"))["id"] for i in range(3)]
        wait_until(lambda: all(ca.get(i)["status"] == "RUNNING" for i in on_a), 30, what="3 jobs running on wa")
    b = cluster("wb", "--max-cpu-jobs", "6")  # room for its own jobs and wa's retries
    with b.client() as cb:
        on_b = [cb.submit(ledger_job(book, gate=gate, name=f"b{i}"))["id"] for i in range(3)]
        ids = on_a + on_b
        wait_until(lambda: all(cb.get(i)["status"] == "RUNNING" for i in on_b), 30, what="3 jobs running on wb")
        assert {cb.get(i)["worker_id"] for i in on_a} == {"wa"} and {cb.get(i)["worker_id"] for i in on_b} == {"wb"}
        a.kill9()
        t_kill = time.monotonic()
        retried: dict[str, float] = {}
        while len(retried) < len(on_a) and time.monotonic() - t_kill < TIMEOUT + 20:
            for j in cb.list(summary=True):
                if j["id"] in on_a and j["id"] not in retried and j["attempt"] == 2 and j["status"] == "RUNNING":
                    retried[j["id"]] = time.monotonic() - t_kill
            time.sleep(0.05)
        print(f"\n[kill -9] retried by wb after {sorted(round(v, 1) for v in retried.values())} s "
              f"(heartbeat_timeout {TIMEOUT:g} s)")
        assert set(retried) == set(on_a)
        assert max(retried.values()) <= TIMEOUT + 5
        # the dead worker's orphans were stopped where they ran before the retry began
        assert not tagged_processes(set(on_a)) or all(
            len([ln for ln in ledger(book, i) if ln[0] == "start"]) == 2 for i in on_a)
        for i in on_a:
            lines = ledger(book, i)
            kinds = [ln[0] for ln in lines]
            retry = kinds.index("start", 1)
            assert kinds[0] == "start" and set(kinds[1:retry]) == {"term"}, kinds  # SIGTERM'd, never ended
            assert max(float(ln[2]) for ln in lines[1:retry]) < float(lines[retry][2])
        gate.touch()
        jobs = wait_all(cb, ids, timeout=60)
        counts = audit(cb, book, ids)
        print(f"[kill -9] {counts}")
        assert counts == dict.fromkeys(counts, 0)
        for i in on_a:
            atts = cb.get(i)["attempts"]
            assert [(x["number"], x["status"], x["reason"], x["worker_id"]) for x in atts] == [
                (1, "FAILED", "worker_lost", "wa"), (2, "SUCCEEDED", None, "wb")]
            assert "stopped renewing its lease" in cb.logs(i)["data"]
        assert {jobs[i]["worker_id"] for i in ids} == {"wb"}
        lost = {w["id"]: w["status"] for w in cb._request("GET", "/v1/workers")["workers"]}
        assert lost == {"wa": "lost", "wb": "up"}
        # the dead worker comes back: it finds nothing of its own to settle, and changes nothing
        a.start()
        time.sleep(1.0)
        assert audit(cb, book, ids) == counts
        assert all(cb.get(i)["status"] == "SUCCEEDED" for i in ids)
    assert tagged_processes(set(ids)) == []


def test_a_worker_restarted_in_time_adopts_its_jobs(cluster, tmp_path: Path) -> None:
    a, b = cluster("wa", "--max-cpu-jobs", "2"), cluster("wb", "--max-cpu-jobs", "1")
    book, gate = tmp_path / "ledger", tmp_path / "gate"
    book.mkdir()
    with b.client() as cb:
        ids = [cb.submit(ledger_job(book, gate=gate, name=f"r{i}"))["id"] for i in range(3)]
        wait_until(lambda: sum(1 for j in cb.list(summary=True) if j["status"] == "RUNNING") == 3, 30,
                   what="3 running jobs")
        on_a = [j["id"] for j in cb.list(summary=True) if j["worker_id"] == "wa"]
        a.kill9()
        a.start()  # well within its lease: the same worker id, the same state dir
        time.sleep(TIMEOUT + 2)  # past the old lease: still held, renewed by the new process
        gate.touch()
        wait_all(cb, ids, timeout=30)
        assert audit(cb, book, ids) == dict.fromkeys(audit(cb, book, ids), 0)
        for i in on_a:
            atts = cb.get(i)["attempts"]
            assert [(x["number"], x["status"], x["worker_id"]) for x in atts] == [(1, "SUCCEEDED", "wa")]
            assert [ln[0] for ln in ledger(book, i)] == ["start", "end"]


def test_gpus_and_min_vram_pick_the_worker(cluster, tmp_path: Path) -> None:
    big = cluster("big", "--gpu-vram", "24GiB")
    small = cluster("small", "--gpu-vram", "8GiB,8GiB")
    probe = 'echo "gpus=$CUDA_VISIBLE_DEVICES worker=$OFFLOAD_JOBS_WORKER_ID"; sleep 0.3'
    with small.client() as c:
        def job(name: str, gpus: int, vram: str | None = None) -> str:
            res: dict = {"gpus": gpus} | ({"min_vram": vram} if vram else {})
            return c.submit({"kind": "command", "name": name, "command": probe, "resources": res})["id"]

        ids = {"one24": job("one24", 1, "20GiB"), "two8": job("two8", 2, "8GiB"), "any": job("any", 1),
               "one24b": job("one24b", 1, "16GiB")}
        jobs = wait_all(c, list(ids.values()), timeout=60)
        where = {k: jobs[i]["worker_id"] for k, i in ids.items()}
        assert where["one24"] == where["one24b"] == "big" and where["two8"] == "small"
        assert "gpus=0,1 worker=small" in c.logs(ids["two8"])["data"]
        assert "gpus=0 worker=big" in c.logs(ids["one24"])["data"]  # read through small's API: shipped
        with pytest.raises(SpecError, match="resources.min_vram"):
            job("none", 1, "40GiB")
        with pytest.raises(SpecError, match="resources.gpus"):
            job("none", 3)
        workers = {w["id"]: w for w in c._request("GET", "/v1/workers")["workers"]}
        assert [g["memory_total"] for g in workers["small"]["gpus"]] == [8 * 2**30] * 2
        assert workers["big"]["gpus"][0]["memory_total"] == 24 * 2**30


def test_ps_logs_metrics_and_controls_of_a_job_on_the_other_worker(cluster, tmp_path: Path) -> None:
    # one job each: whichever claims the blocker is full, so the next job can only start on the other
    # (with wa unbounded, wa claiming the blocker ran the job beside it and the wait below timed out)
    a, b = cluster("wa", "--max-cpu-jobs", "1"), cluster("wb", "--max-cpu-jobs", "1")
    gate = tmp_path / "gate"
    metrics_cmd = ('for i in 1 2 3; do echo "{\\"step\\": $i, \\"loss\\": 0.$i}" >> "$OFFLOAD_JOBS_METRICS"; '
                   'echo line $i; done; '
                   f'while [ ! -e "{gate}" ]; do sleep 0.05; done; cat "$OFFLOAD_JOBS_RUN_DIR/control.jsonl"')
    with b.client() as cb, a.client() as ca:
        blocker = cb.submit({"kind": "command", "command": f'while [ ! -e "{gate}" ]; do sleep 0.05; done'})["id"]
        wait_until(lambda: cb.get(blocker)["status"] == "RUNNING", 20, what="blocker running")
        holder = cb.get(blocker)["worker_id"]
        other = "wa" if holder == "wb" else "wb"
        job = cb.submit({"kind": "command", "name": "remote", "command": metrics_cmd})["id"]
        wait_until(lambda: cb.get(job)["status"] == "RUNNING" and cb.get(job)["worker_id"] == other, 20,
                   what="the job on the other worker")
        asker = cb if other == "wa" else ca  # the API of the worker that does NOT run it
        wait_until(lambda: "line 3" in asker.logs(job)["data"], 10, what="shipped log lines")
        wait_until(lambda: len(asker.metrics(job)["records"]) == 3, 10, what="shipped metrics")
        assert [r["step"] for r in asker.metrics(job)["records"]] == [1, 2, 3]
        assert asker.metrics(job, 2)["records"] == [{"step": 3, "loss": 0.3}]
        # a control through the store reaches the run dir where the job runs
        asker_store_event = {"ts": time.time(), "action": "save", "attempt": 1, "worker_id": other}
        from jobs.store import JobStore

        store = JobStore(b.extra_env["OFFLOAD_JOBS_DB"])
        store.add_event(job, "job.control", asker_store_event)
        store.close()
        run_dir = Path(cb.get(job)["run_dir"])
        wait_until(lambda: (run_dir / "control.jsonl").exists(), 10, what="control delivered")
        # ps through the console script shows the worker column
        env = {**os.environ, "OFFLOAD_JOBS_URL": asker.url, "OFFLOAD_JOBS_TOKEN": asker.token,
               "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-m", "jobs", "ps"], capture_output=True, text=True, env=env,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        header, *rows = out.stdout.splitlines()
        assert "WORKER" in header.split()
        assert any(job in r and other in r for r in rows)
        ws = subprocess.run([sys.executable, "-m", "jobs", "workers", "--json"], capture_output=True, text=True,
                            env=env, timeout=30)
        assert ws.returncode == 0, ws.stderr
        assert {w["id"] for w in json.loads(ws.stdout)} == {"wa", "wb"}
        gate.touch()
        done = cb.wait(job, timeout=20)
        assert done["status"] == "SUCCEEDED"
        text = asker.logs(job)["data"]
        assert '"action": "save"' in text or '"action":"save"' in text  # the job read what was delivered
        assert text.rstrip().endswith("ended: SUCCEEDED")  # complete once terminal: shipped with the end
