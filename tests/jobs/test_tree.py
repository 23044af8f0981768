"""Process trees through a real worker: cancel leaves no process of the job behind, setsid,
double-fork and nohup included, with a cgroup per attempt and with the subreaper alone; and a
SIGKILL is `host_oom` only when the kernel's OOM killer sent it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from jobs_helpers import tagged_processes, wait_until

from jobs.executors import proctree

ESCAPES = (
    'setsid sleep 300 & '                      # a new session: out of the job's process group
    '(setsid sh -c "sleep 300 &" &) ; '        # double fork: its parent is gone at once
    'nohup sleep 300 >/dev/null 2>&1 & '       # immune to SIGHUP
    'sh -c "trap \'\' TERM; exec sleep 300" & '  # ignores SIGTERM: needs the SIGKILL
    'echo started; wait'
)


@pytest.mark.parametrize("mode", ["cgroup", "subreaper"])
def test_cancel_leaves_no_descendant(worker_factory, tmp_path: Path, mode: str) -> None:
    if mode == "cgroup" and proctree.cgroup_root() is None:
        pytest.skip("no writable cgroup v2 here; the subreaper case covers it")
    args = ("--max-cpu-jobs", "2")
    w = worker_factory(*args, home=tmp_path / mode) if mode == "cgroup" else None
    if mode == "subreaper":
        from jobs_helpers import WorkerProcess

        w = WorkerProcess(tmp_path / mode, *args, env={"OFFLOAD_JOBS_NO_CGROUP": "1"}).start()
    try:
        c = w.client()
        job = c.submit({"kind": "command", "command": ESCAPES, "limits": {"stop_grace": 1}})
        wait_until(lambda: "started" in c.logs(job["id"])["data"], 30, what="the job to start")
        wait_until(lambda: len(tagged_processes({job["id"]})) >= 6, 10, what="every descendant to start")
        attempt = c.get(job["id"])["attempts"][0]
        assert bool(attempt["handle"]["cgroup"]) == (mode == "cgroup")
        sessions = {proctree.proc_stat(p).pgid for p in tagged_processes({job["id"]}) if proctree.proc_stat(p)}
        assert len(sessions) > 2, "some descendants really left the job's process group"
        c.cancel(job["id"])
        done = c.wait(job["id"], timeout=30)
        assert done["status"] == "CANCELLED"
        wait_until(lambda: not tagged_processes({job["id"]}), 10, what="no process of the job left")
        if attempt["handle"]["cgroup"]:
            wait_until(lambda: not os.path.exists(attempt["handle"]["cgroup"]), 10, what="its cgroup removed")
    finally:
        w.stop()


def test_sigkill_from_outside_is_killed(worker) -> None:
    with worker.client() as c:
        job = c.submit({"kind": "command", "command": "echo up; sleep 300"})
        wait_until(lambda: "up" in c.logs(job["id"])["data"], 30, what="the job to start")
        os.kill(c.get(job["id"])["attempts"][0]["pid"], signal.SIGKILL)
        done = c.wait(job["id"], timeout=30)
    assert (done["status"], done["reason"]) == ("FAILED", "killed")
    assert "neither the worker nor the OOM killer" in done["message"]


def _memory_cgroup() -> str | None:
    """A memory cgroup we may make children in: v1's memory hierarchy, or v2 with +memory."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
        own = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fields = right.split()
        if len(fields) >= 3 and fields[0] == "cgroup" and "memory" in fields[2].split(","):
            for entry in own:
                _, controllers, path = entry.split(":", 2)
                if "memory" in controllers.split(","):
                    base = os.path.join(left.split()[4], path.lstrip("/"))
                    if os.access(base, os.W_OK):
                        return base
    return None


def test_a_real_oom_kill_is_host_oom(worker, tmp_path: Path) -> None:
    base = _memory_cgroup()
    if base is None or proctree.vmstat_oom_kills() is None:
        pytest.skip("needs a writable memory cgroup (root, cgroup v1 memory) and /proc/vmstat oom_kill")
    cg = os.path.join(base, f"offload-jobs-oom-test-{os.getpid()}")
    os.makedirs(cg, exist_ok=True)
    try:
        Path(cg, "memory.limit_in_bytes").write_text(str(64 << 20))
        # The job moves itself into a 64 MiB cgroup, then asks for 512 MiB: the kernel OOM-kills it.
        hog = (f'echo $$ > {cg}/cgroup.procs; exec python3 -c "b = bytearray(512 << 20); '
               'b[::4096] = bytes(len(b[::4096]))"')
        with worker.client() as c:
            done = c.wait(c.submit({"kind": "command", "command": hog, "retry": {"max_attempts": 1}})["id"], timeout=60)
        assert (done["status"], done["reason"]) == ("FAILED", "host_oom"), done
        assert "OOM" in done["message"]
    finally:
        for _ in range(50):
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.1)


@pytest.mark.gpu
def test_cancel_frees_the_vram_of_a_setsid_descendant(worker_factory, tmp_path: Path) -> None:
    """The issue's case: a GPU job's setsid'd child kept its VRAM after cancel."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    def used() -> int:  # device-wide, every process's allocations included
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    marker = tmp_path / "allocated"
    hog = (f'setsid python -c "import torch, time, pathlib; x = torch.empty(4 << 30, dtype=torch.uint8, device=\'cuda\'); '
           f'torch.cuda.synchronize(); pathlib.Path(\'{marker}\').touch(); time.sleep(600)" & echo started; wait')
    w = worker_factory("--gpus", "1")
    c = w.client()
    baseline = used()
    job = c.submit({"kind": "command", "command": hog, "resources": {"gpus": 1}, "limits": {"stop_grace": 2}})
    wait_until(marker.exists, 120, what="the descendant to hold 4 GiB of VRAM")
    assert used() - baseline > 3 << 30
    c.cancel(job["id"])
    assert c.wait(job["id"], timeout=60)["status"] == "CANCELLED"
    wait_until(lambda: not tagged_processes({job["id"]}), 30, what="no process of the job left")
    wait_until(lambda: used() - baseline < 512 << 20, 30, what="the VRAM given back")
    print(f"\n[gpu] VRAM used: baseline {baseline >> 20} MiB, after cancel {used() >> 20} MiB")
