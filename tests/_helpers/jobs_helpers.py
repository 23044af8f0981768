"""Helpers for the jobs tests: a real worker process, /proc checks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from jobs.client import JobsClient

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcess:
    """`python -m jobs.worker` as a child; start, kill -9 and restart it on the same state dir."""

    def __init__(self, home: Path, *extra_args: str, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.extra_env = dict(env or {})
        self.port = free_port()
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home / "worker-test.log"

    def start(self, timeout: float = 30.0, wait: bool = True) -> "WorkerProcess":
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        env.update(self.extra_env)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jobs.worker", "--port", str(self.port), "--home", str(self.home),
                 "--log-level", "warning", *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
            )
        return self.wait_healthy(timeout) if wait else self

    def wait_healthy(self, timeout: float) -> "WorkerProcess":
        """Until /healthz answers 200; the worker's log in the error when it exits or times out."""
        deadline = time.monotonic() + timeout
        # One client for all the polls: httpx.get makes a client (and its SSL context) per call, about
        # 30 ms of CPU each, 20 times a second while a worker starts.
        with httpx.Client(timeout=0.5) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log.read_text()}")
                try:
                    if http.get(f"{self.url}/healthz").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()  # a worker that comes up after the test gave up on it would run on, unowned
        raise RuntimeError(f"worker did not become healthy in {timeout:g} s:\n{self.log.read_text()}")

    @property
    def token(self) -> str:
        return (self.home / "token").read_text().strip()

    def client(self) -> JobsClient:
        return JobsClient(self.url, self.token, timeout=30.0)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def pgid_alive(pgid: int) -> list[int]:
    """Pids (not zombies) still in process group `pgid`, read from /proc."""
    alive = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(d.name))
    return alive


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tagged_processes(job_ids: set[str]) -> list[int]:
    """Live pids whose environment says they belong to one of `job_ids` (launchers and jobs alike)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2:].split()[0] == "Z":
            continue
        for item in env:
            if item.startswith(b"OFFLOAD_JOBS_JOB_ID=") and item[20:].decode(errors="replace") in job_ids:
                found.append(int(d.name))
                break
    return found


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
