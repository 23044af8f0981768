"""Exactly once through crashes, the committed fault tests of issue 10. Each counts, and prints:

    lost       a job missing from the store, or recorded otherwise than it really ended
    run twice  a job whose command started more than once
    stuck      a job not finished once the last worker has had time to settle it
    orphans    processes or cgroups of these jobs left when all is done

and all four must be 0, for:
- 10 kill -9s of the worker (50 under `-m slow`) at random moments, half inside the launch window (a child
  prepared but not yet recorded, or recorded but not yet let go), while jobs stream through;
- 10 jobs that finish while the worker is down;
- 10 completions while the store's disk is full (a small tmpfs), then space is freed; and 5
  more whose worker dies while it is full (replayed from exit.json at restart).

Every job appends `start` and `end` lines to its own ledger file outside the state dir, so what
really ran is known independently of the store.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from jobs_helpers import WorkerProcess, tagged_processes, wait_until

from jobs.client import JobsClient
from jobs.errors import JobsError
from jobs.executors import proctree

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def ledger_command(ledger: Path, seconds: float, code: int) -> str:
    f = f'"{ledger}/$OFFLOAD_JOBS_JOB_ID"'
    return (f'echo "start $OFFLOAD_JOBS_ATTEMPT $$" >> {f}; sleep {seconds}; '
            f'echo "end $OFFLOAD_JOBS_ATTEMPT {code}" >> {f}; exit {code}')


def gated_command(ledger: Path, gate: Path, code: int) -> str:
    """Starts, then waits for `gate` to exist, then ends with `code`."""
    f = f'"{ledger}/$OFFLOAD_JOBS_JOB_ID"'
    return (f'echo "start $OFFLOAD_JOBS_ATTEMPT $$" >> {f}; while [ ! -e "{gate}" ]; do sleep 0.05; done; '
            f'echo "end $OFFLOAD_JOBS_ATTEMPT {code}" >> {f}; exit {code}')


def ledger_lines(ledger: Path, job_id: str) -> list[list[str]]:
    try:
        return [ln.split() for ln in (ledger / job_id).read_text().splitlines() if ln.strip()]
    except FileNotFoundError:
        return []


def audit(client: JobsClient, ledger: Path, expected: dict[str, int], wait_s: float = 90.0) -> dict[str, int]:
    """Wait for every job to finish (up to `wait_s`), then count lost / run twice / stuck."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        jobs = {j["id"]: j for j in client.list(summary=True)}
        if all(jobs.get(i, {}).get("status") in TERMINAL for i in expected):
            break
        time.sleep(0.2)
    jobs = {j["id"]: j for j in client.list(summary=True)}
    lost = twice = stuck = 0
    for job_id, code in expected.items():
        job = jobs.get(job_id)
        lines = ledger_lines(ledger, job_id)
        starts = [ln for ln in lines if ln[0] == "start"]
        ends = [ln for ln in lines if ln[0] == "end"]
        if len(starts) > 1:
            twice += 1
        if job is None:
            lost += 1
            continue
        if job["status"] not in TERMINAL:
            stuck += 1
            continue
        want = ("SUCCEEDED", None) if code == 0 else ("FAILED", "exit_nonzero")
        ran_to_the_end = len(ends) == 1
        if not ran_to_the_end or (job["status"], job["reason"]) != want or job["exit_code"] != code:
            lost += 1  # it ran to its end (or should have), and the store says otherwise
    return {"lost": lost, "run twice": twice, "stuck": stuck}


def orphans(job_ids: set[str]) -> int:
    procs = tagged_processes(job_ids)
    root = proctree.cgroup_root()
    cgroups = [d for d in os.listdir(root) if d.split(".")[0] in job_ids] if root else []
    return len(procs) + len(cgroups)


def report(label: str, counts: dict[str, int]) -> None:
    print(f"\n[fault] {label}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


@pytest.mark.parametrize("n_kills", [10, pytest.param(50, marks=pytest.mark.slow)])
def test_worker_kills_at_random_moments(tmp_path: Path, n_kills: int) -> None:
    rng = random.Random(10)
    home, ledger = tmp_path / "home", tmp_path / "ledger"
    ledger.mkdir()
    env = {"OFFLOAD_JOBS_FAULTS": "prepared=0.15,recorded=0.15"}
    expected: dict[str, int] = {}
    kills = {"prepared": 0, "recorded": 0, "random": 0, "startup": 0}
    worker = WorkerProcess(home, "--max-cpu-jobs", "4", env=env)
    t0 = time.monotonic()
    for n in range(n_kills):
        mode = ("prepared", "recorded", "random", "random", "startup")[n % 5] if n else "random"
        if mode == "startup":  # during import, recovery or the first launches
            worker.start(wait=False)
            time.sleep(rng.uniform(0.2, 1.5))
        else:
            worker.start()
            with worker.client() as c:
                for _ in range(2 if n < 10 else 1):
                    code = 3 if rng.random() < 0.2 else 0
                    job = c.submit({"kind": "command", "command": ledger_command(ledger, rng.uniform(0.1, 1.2), code),
                                    "retry": {"max_attempts": 5}})
                    expected[job["id"]] = code
            if mode == "random":
                time.sleep(rng.uniform(0.0, 0.8))
            else:
                marker = home / f"fault-{mode}"
                if not any(j["status"] == "PENDING" for j in worker.client().list(summary=True)):
                    mode = "random"  # nothing left to launch: a plain kill
                else:
                    try:
                        wait_until(marker.exists, 10.0, 0.005, what=f"a launch at {mode}")
                    except AssertionError:
                        mode = "random"
        worker.kill9()
        kills[mode] += 1
    worker.extra_env = {}
    worker.start()
    with worker.client() as c:
        counts = audit(c, ledger, expected)
    worker.stop()
    counts["orphans"] = orphans(set(expected))
    report(f"{n_kills} kills in {time.monotonic() - t0:.0f}s ({kills['prepared']} with a child prepared and unrecorded, "
           f"{kills['recorded']} recorded and not yet let go, {kills['startup']} during start-up, "
           f"{kills['random']} at random), {len(expected)} jobs", counts)
    assert kills["prepared"] >= n_kills // 10 and kills["recorded"] >= n_kills // 10, kills
    assert counts == {"lost": 0, "run twice": 0, "stuck": 0, "orphans": 0}


def test_10_jobs_that_finish_while_the_worker_is_down(tmp_path: Path) -> None:
    home, ledger, gate = tmp_path / "home", tmp_path / "ledger", tmp_path / "gate"
    ledger.mkdir()
    worker = WorkerProcess(home, "--max-cpu-jobs", "10").start()
    expected = {}
    with worker.client() as c:
        for i in range(10):
            code = 0 if i % 2 == 0 else 3
            expected[c.submit({"kind": "command", "command": gated_command(ledger, gate, code)})["id"]] = code
        wait_until(lambda: all(len(ledger_lines(ledger, j)) == 1 for j in expected), 30, what="all 10 running")
    worker.kill9()
    gate.touch()
    wait_until(lambda: all(len(ledger_lines(ledger, j)) == 2 for j in expected), 30, what="all 10 ended")
    wait_until(lambda: not tagged_processes(set(expected)), 30, what="the launchers to record and exit")
    worker.start()
    with worker.client() as c:
        counts = audit(c, ledger, expected)
        for job_id in expected:
            job = c.get(job_id)
            assert job["attempt"] == 1 and [a["reason"] for a in job["attempts"]] != ["worker_lost"]
            assert "ended while no worker watched" in c.logs(job_id)["data"]
    worker.stop()
    counts["orphans"] = orphans(set(expected))
    report("10 jobs finished while the worker was down", counts)
    assert counts == {"lost": 0, "run twice": 0, "stuck": 0, "orphans": 0}


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for the full-disk test needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: Path) -> Path:
    """Fill the filesystem to the last byte; returns the filler file."""
    filler = mnt / "filler"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return filler


def start_gated(c: JobsClient, ledger: Path, gate: Path, codes: list[int]) -> dict[str, int]:
    """Submit one gated job per exit code; return {job id: code} once all of them run."""
    jobs = {c.submit({"kind": "command", "command": gated_command(ledger, gate, code)})["id"]: code for code in codes}
    wait_until(lambda: all(c.get(j)["status"] == "RUNNING" and ledger_lines(ledger, j) for j in jobs), 30,
               what=f"all {len(jobs)} running")
    return jobs


def test_completions_while_the_store_disk_is_full(small_tmpfs: Path, tmp_path: Path) -> None:
    home, ledger = small_tmpfs / "home", tmp_path / "ledger"
    ledger.mkdir()
    worker = WorkerProcess(home, "--max-cpu-jobs", "10").start()
    c = worker.client()

    # 1. ten jobs complete while the disk is full; the worker keeps their completions and
    #    records them once space is freed.
    gate = tmp_path / "gate1"
    expected = start_gated(c, ledger, gate, [0 if i % 3 else 3 for i in range(10)])
    filler = fill(small_tmpfs)
    with pytest.raises(JobsError):  # the store really is full: a new job cannot be written
        c.submit({"kind": "command", "command": "true"})
    gate.touch()
    wait_until(lambda: all(len(ledger_lines(ledger, j)) == 2 for j in expected), 30, what="all 10 ended")
    time.sleep(2.0)  # several retries fail meanwhile
    while_full = {j: c.get(j) for j in expected}
    waiting = [j for j, job in while_full.items() if job["status"] == "RUNNING"]
    for j, job in while_full.items():  # what did get written (SQLite reuses WAL space) is right
        assert job["status"] == "RUNNING" or job["exit_code"] == expected[j], job
    filler.unlink()
    counts = audit(c, ledger, expected, wait_s=60)
    counts["orphans"] = orphans(set(expected))
    report(f"10 completions while the store's disk was full ({len(waiting)} refused by the store until "
           f"space was freed)", counts)
    assert len(waiting) >= 5, "the disk was not full enough to refuse the store's writes"
    assert counts == {"lost": 0, "run twice": 0, "stuck": 0, "orphans": 0}

    # 2. five more complete while full, and the worker dies before it could record them:
    #    the next worker replays them from exit.json.
    gate = tmp_path / "gate2"
    more = start_gated(c, ledger, gate, [0 if i % 2 else 3 for i in range(5)])
    filler = fill(small_tmpfs)
    gate.touch()
    wait_until(lambda: all(len(ledger_lines(ledger, j)) == 2 for j in more), 30, what="all 5 ended")
    wait_until(lambda: not tagged_processes(set(more)), 30, what="the launchers to exit")
    c.close()
    worker.kill9()
    filler.unlink()
    worker.start()
    with worker.client() as c2:
        counts = audit(c2, ledger, more, wait_s=60)
    worker.stop()
    counts["orphans"] = orphans(set(more))
    report("5 completions while full, worker killed, replayed from exit.json", counts)
    assert counts == {"lost": 0, "run twice": 0, "stuck": 0, "orphans": 0}
    shutil.rmtree(home, ignore_errors=True)
