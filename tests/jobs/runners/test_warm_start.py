"""Warm starts (jobs/executors/warm.py): runner jobs forked from a process that imported their libraries
once are the same jobs as cold ones, bitwise, and their launchers keep every promise of the cold path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from jobs_helpers import WorkerProcess, wait_until
from runner_helpers import infer_spec, pictures, run_dir, run_job, step_records, train_spec
from safetensors.torch import load_file

from jobs.executors import Exit, Launch, proctree
from jobs.executors.process import ProcessExecutor
from jobs.executors import warm
from jobs.executors.warm import warm_enabled
from jobs.rundir import RunDir


def _warm_pids(parent: int) -> set[int]:
    found = set()
    for pid in proctree.children_map().get(parent, []):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"jobs.executors.warm" in f.read():
                    found.add(pid)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def wex():
    ex = ProcessExecutor(use_cgroups=False, warm=True)
    yield ex
    ex._warm.close()


def _launch(tmp_path: Path, argv: list[str], job_id: str = "w") -> Launch:
    rd = RunDir(tmp_path / "run").create({"kind": "command", "command": argv})
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
           "OFFLOAD_JOBS_JOB_ID": job_id, "OFFLOAD_JOBS_ATTEMPT": "1"}
    return Launch(job_id=job_id, attempt=1, argv=argv, env=env, cwd=str(rd.path), run_dir=rd, warm=True)


def _ended(ex: ProcessExecutor, h, timeout: float = 30.0) -> Exit:
    return wait_until(lambda: ex.poll(h), timeout, what="the attempt's end")


def test_a_warm_launcher_holds_its_child_until_released_and_reports_its_exit(wex, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    launch = _launch(tmp_path, ["/bin/sh", "-c", f"touch {marker}; echo out; exit 5"])
    h = wex.prepare(launch)
    assert h.info["warm"] is True
    launcher = proctree.proc_stat(h.info["launcher_pid"])
    assert launcher is not None and launcher.ppid != os.getpid()  # forked by the warm process, not the worker
    assert launcher.pgid == h.info["launcher_pid"] and h.pgid == h.pid  # its own session, the job its own group
    time.sleep(0.3)
    assert not marker.exists()  # nothing runs before the go byte
    wex.release(h)
    assert _ended(wex, h) == Exit(exit_code=5)
    assert marker.exists() and "out" in launch.run_dir.log_file.read_text()
    rec = launch.run_dir.read_exit(1)
    assert rec is not None and (rec["exit_code"], rec["ran"]) == (5, True)
    assert h.obj.popen.wait(10) == 5  # the warm process told the worker the launcher's status
    wex.cleanup(h)


def test_an_aborted_warm_attempt_never_runs(wex, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    h = wex.prepare(_launch(tmp_path, ["/bin/sh", "-c", f"touch {marker}"]))
    wex.abort(h)
    ex = _ended(wex, h)
    assert ex.ran is False and not marker.exists()
    wex.cleanup(h)


def test_a_warm_attempt_is_killed_with_its_tree(wex, tmp_path: Path) -> None:
    h = wex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 60 & sleep 60"]))
    wait_until(lambda: len(proctree.descendants(h.info["launcher_pid"])) >= 2, 10, what="the job's processes")
    wex.kill(h)
    assert _ended(wex, h).signal == signal.SIGKILL
    wex.cleanup(h)
    assert proctree.descendants(h.info["launcher_pid"]) == []


def test_a_warm_process_with_a_running_launcher_is_never_evicted(wex, tmp_path: Path, monkeypatch) -> None:
    """A full pool whose warm processes all have launchers to report on starts another environment's
    attempt cold, rather than closing one (its launchers' exit statuses would be lost)."""
    monkeypatch.setattr(wex._warm, "size", 1)
    a = wex.start(_launch(tmp_path / "a", ["/bin/sh", "-c", "sleep 3"]))
    other = _launch(tmp_path / "b", ["/bin/sh", "-c", "exit 0"])
    other.env["SOMETHING_ELSE"] = "1"  # another environment: another warm process's key
    b = wex.start(other)
    assert (a.info["warm"], b.info["warm"]) == (True, False)
    assert _ended(wex, b).exit_code == 0 and _ended(wex, a).exit_code == 0
    assert a.obj.popen.wait(10) == 0 and not a.obj.popen._z.closed  # still there, and told a's status
    wex.cleanup(a)
    wex.cleanup(b)


def test_the_warm_process_is_closed_when_idle_and_never_under_a_running_launcher(wex, tmp_path: Path,
                                                                                  monkeypatch) -> None:
    monkeypatch.setattr(warm, "IDLE_S", 1.0)  # read at each check (every IDLE_CHECK_S, 5 s)
    h = wex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 7"]))
    z = h.obj.popen._z
    time.sleep(6)  # past IDLE_S since the request, and a check has run: its launcher still runs
    assert not z.closed and z.popen.poll() is None
    assert _ended(wex, h).exit_code == 0
    wait_until(lambda: z.popen.poll() is not None, 20, what="the idle warm process's exit")
    assert z.closed  # closed by the worker's side (under its request lock), then it read EOF and left
    wex.cleanup(h)


def test_the_worker_switch() -> None:
    assert warm_enabled({}) and not warm_enabled({"OFFLOAD_JOBS_WARM_START": "0"})
    assert ProcessExecutor(warm=False)._warm is None


def test_warm_jobs_are_the_cold_jobs_bitwise_and_the_warm_process_leaves_with_its_worker(
        tiny: dict[str, Path], tmp_path: Path) -> None:
    """The same train and infer jobs on a cold worker and a warm one: the same losses, LoRA bytes and
    pictures; the warm worker forked both from one warm process, which exits when its worker is killed."""
    specs = [train_spec(tiny, steps=2, save_every=2), infer_spec(tiny, steps=2, prompt="a red square")]
    for s in specs:
        s["env"] = {}  # as a user's job: torch's own thread count (a warm process whose pool had run would hang)
    done: dict[str, list[dict]] = {}
    warm_pid: set[int] = set()
    for mode in ("0", "1"):
        w = WorkerProcess(tmp_path / f"home{mode}", env={"OFFLOAD_JOBS_WARM_START": mode}).start()
        try:
            with w.client() as c:
                done[mode] = [run_job(c, dict(s)) for s in specs]
            if mode == "1":
                warm_pid = _warm_pids(w.proc.pid)
                assert len(warm_pid) == 1
                w.kill9()
                wait_until(lambda: not any(proctree.alive(p) for p in warm_pid), 15, what="the warm process's exit")
        finally:
            w.stop()
    for mode, jobs in done.items():
        assert [j["status"] for j in jobs] == ["SUCCEEDED"] * 2, [j.get("message") for j in jobs]
        assert [j["attempts"][-1]["handle"]["warm"] for j in jobs] == [mode == "1"] * 2
    cold, warm = done["0"], done["1"]
    assert [r["loss"] for r in step_records(warm[0])] == [r["loss"] for r in step_records(cold[0])]
    lora = [load_file(run_dir(j) / "outputs" / "lora.safetensors") for j in (cold[0], warm[0])]
    assert lora[0].keys() == lora[1].keys() and lora[0]
    assert all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])
    assert pictures(warm[1]) == pictures(cold[1]) and pictures(cold[1])


_POOL = """
from jobs.executors.warm import _threads, _unsafe
before = _threads()
import numpy  # as _preload: OpenBLAS's thread server starts here
blas = _threads() - before
import torch
print(repr(_unsafe(blas)))
x = torch.randn(1000, 1000)
(x @ x).exp().sum()  # torch's OpenMP pool starts
print(repr(_unsafe(blas)))
"""


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: OpenMP starts no thread")
def test_a_process_whose_openmp_pool_ran_refuses_to_serve() -> None:
    """torch's import leaves only OpenBLAS's thread (fork-safe; the warm executor above serves without
    OMP_NUM_THREADS); once torch's OpenMP pool has run, a fork would hang at its first parallel op, so the
    process says why it cannot serve."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    res = subprocess.run([sys.executable, "-c", _POOL], capture_output=True, text=True, env=env, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    before, after = res.stdout.splitlines()[-2:]
    assert before == "''" and "threads besides the main one" in after


_PRELOAD = """
import os
from jobs.executors.warm import _NVML_CHECK, _cuda_started, _preload, _unsafe
os.environ.pop(_NVML_CHECK, None)
blas = _preload()
from diffusers.utils.torch_utils import TorchDeviceBackend
print(repr(_unsafe(blas)), _cuda_started(), os.environ.get(_NVML_CHECK), TorchDeviceBackend._detect_device_type.cache_info().currsize)
"""


def test_the_warm_imports_leave_no_cuda_and_no_trace_in_the_environment() -> None:
    """The imports leave the job's environment (the NVML switch they ran under) and diffusers' cached
    device answer as a fresh interpreter has them (a job may see other devices), and the process can
    serve. That a fork then uses CUDA is test_runners_gpu's to show (a warm infer job on a card)."""
    res = subprocess.run([sys.executable, "-c", _PRELOAD], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.splitlines()[-1] == "'' False None 0"
