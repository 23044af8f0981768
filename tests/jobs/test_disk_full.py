"""A full disk (issue 26): a worker started on it says so in one line and exits 2 (it used to answer
/healthz, then die of an uncaught OSError writing worker.json), and submits it refuses leave no
half-made run dirs or `.spec.yaml.tmp` files. The disk is a small tmpfs filled to its last byte
(root only; skipped where mounting is refused).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from jobs_helpers import REPO, WorkerProcess
from test_exactly_once import fill, small_tmpfs  # noqa: F401  (a fixture)

from jobs.errors import JobsError


def _run_worker(home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "jobs.worker", "--port", "0", "--home", str(home)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_a_worker_started_on_a_full_disk_says_so_in_one_line(small_tmpfs: Path) -> None:  # noqa: F811
    home = small_tmpfs / "home"
    WorkerProcess(home).start(timeout=120).stop()  # a state dir with its token and store, as after a restart
    filler = fill(small_tmpfs)
    try:
        res = _run_worker(home)
    finally:
        filler.unlink()
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "full" in last, last
    assert not (home / "worker.json").exists()


def test_refused_submits_leave_no_half_made_run_dirs(small_tmpfs: Path) -> None:  # noqa: F811
    home = small_tmpfs / "home"
    w = WorkerProcess(home).start(timeout=120)
    try:
        with w.client() as c:
            first = c.submit({"kind": "command", "name": "before", "command": "true"})["id"]
            assert c.wait(first, timeout=60)["status"] == "SUCCEEDED"
            filler = fill(small_tmpfs)
            refused = 0
            for i in range(5):
                spec = {"kind": "command", "name": f"full{i}", "command": "true", "env": {"PAD": "x" * 20000}}
                try:
                    c.submit(spec)
                except JobsError as exc:
                    refused += 1
                    assert "No space left" in str(exc) or "full" in str(exc), exc
            assert refused == 5
            assert sorted(p.name for p in (home / "runs").iterdir()) == [first]
            assert not list(home.rglob("*.tmp")), list(home.rglob("*.tmp"))
            filler.unlink()
            again = c.submit({"kind": "command", "name": "after", "command": "true"})
            assert c.wait(again["id"], timeout=60)["status"] == "SUCCEEDED"
    finally:
        w.stop()
