"""Several real workers (`python -m jobs.worker`) on one Postgres, each with its own state dir and
port; a ledger every job writes to outside the store, so what really ran is known independently."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from jobs_helpers import REPO, WorkerProcess, free_port

from jobs.client import JobsClient

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class ClusterWorker(WorkerProcess):
    """A worker on the shared store; `prefix` runs it under e.g. `ip netns exec NS`, `host` is where it listens."""

    def __init__(self, home: Path, worker_id: str, db_url: str, *extra: str, timeout: float = 6.0,
                 prefix: list[str] | None = None, host: str = "127.0.0.1") -> None:
        super().__init__(home, "--worker-id", worker_id, "--heartbeat-timeout", str(timeout), *extra,
                         env={"OFFLOAD_JOBS_DB": db_url})
        self.worker_id = worker_id
        self.prefix = list(prefix or [])
        self.listen = host
        self.url = f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0, wait: bool = True) -> "ClusterWorker":
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.update(self.extra_env)
        host_args = ["--host", self.listen, "--allow-host", self.listen] if self.listen != "127.0.0.1" else []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "jobs.worker", "--port", str(self.port), "--home", str(self.home),
                 "--log-level", "warning", *host_args, *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        return self.wait_healthy(timeout) if wait else self

    def client(self) -> JobsClient:
        return JobsClient(self.url, self.token, timeout=30.0)


def ledger_job(ledger: Path, *, seconds: float = 0.0, gate: Path | None = None, name: str = "j") -> dict:
    """A command job that logs `start N <ts> <worker>`, then `end N <ts>` (or `term N <ts>` on SIGTERM).

    `date` runs with SIGTERM ignored: it carries the job's tags, so a reaper stopping the job's
    processes one by one can TERM it mid-trap, and the line would lose its timestamp."""
    f = f'"{ledger}/$OFFLOAD_JOBS_JOB_ID"'
    ts = '$(trap "" TERM; date +%s.%N)'
    body = [f"trap 'echo \"term $OFFLOAD_JOBS_ATTEMPT {ts}\" >> {f}; exit 143' TERM",
            f'echo "start $OFFLOAD_JOBS_ATTEMPT {ts} $OFFLOAD_JOBS_WORKER_ID" >> {f}']
    if gate is not None:
        body.append(f'while [ ! -e "{gate}" ]; do sleep 0.1 & wait $!; done')
    if seconds:
        body.append(f"sleep {seconds} & wait $!")
    body.append(f'echo "end $OFFLOAD_JOBS_ATTEMPT {ts}" >> {f}')
    return {"kind": "command", "name": name, "command": "; ".join(body),
            "retry": {"max_attempts": 3, "on": ["worker_lost"]}, "limits": {"stop_grace": 2}}


def ledger(ledger_dir: Path, job_id: str) -> list[list[str]]:
    try:
        return [ln.split() for ln in (ledger_dir / job_id).read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return []


def wait_all(client: JobsClient, ids: list[str], timeout: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        jobs = {j["id"]: j for j in client.list(summary=True)}
        if all(jobs.get(i, {}).get("status") in TERMINAL for i in ids) or time.monotonic() > deadline:
            return jobs
        time.sleep(0.2)


def audit(client: JobsClient, ledger_dir: Path, ids: list[str]) -> dict[str, int]:
    """Counts that must all be 0: lost, stuck, completed twice (store), ended twice (ledger), overlapping runs."""
    jobs = {j["id"]: j for j in client.list(summary=True)}
    out = {"lost": 0, "stuck": 0, "completed_twice": 0, "ended_twice": 0, "overlapped": 0, "not_succeeded": 0}
    for i in ids:
        job = jobs.get(i)
        if job is None:
            out["lost"] += 1
            continue
        if job["status"] not in TERMINAL:
            out["stuck"] += 1
            continue
        if job["status"] != "SUCCEEDED":
            out["not_succeeded"] += 1
        atts = client.get(i)["attempts"]
        if sum(1 for a in atts if a["status"] == "SUCCEEDED") > 1:
            out["completed_twice"] += 1
        lines = ledger(ledger_dir, i)
        if sum(1 for ln in lines if ln[0] == "end") > 1:
            out["ended_twice"] += 1
        # runs of one job never overlap: each attempt's end (or term) comes before the next one's start
        open_run = False
        for ln in lines:
            if ln[0] == "start":
                if open_run:
                    out["overlapped"] += 1
                open_run = True
            else:
                open_run = False
    return out


__all__ = ["ClusterWorker", "ledger_job", "ledger", "wait_all", "audit", "free_port", "TERMINAL"]
