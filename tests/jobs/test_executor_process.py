"""The process executor on real children (launcher, held start, exit.json, adoption), and how an
ended attempt is classified. Each test runs with a cgroup per attempt where the kernel allows it
(`cgroup`) and with the launcher's subreaper alone (`subreaper`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from jobs_helpers import pgid_alive

from jobs.executors import Exit, Launch, SetupFailed, classify, proctree
from jobs.executors.process import ProcessExecutor
from jobs.rundir import RunDir
from jobs.runners import get_runner
from jobs.spec import parse_spec


@pytest.fixture(params=["cgroup", "subreaper"])
def ex(request: pytest.FixtureRequest) -> ProcessExecutor:
    executor = ProcessExecutor(use_cgroups=request.param == "cgroup")
    if request.param == "cgroup" and executor.cgroup_root is None:
        pytest.skip("no writable cgroup v2 here (not root, or no cgroup2 mount): the subreaper case covers it")
    return executor


def _launch(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None, job_id: str = "j",
            attempt: int = 1) -> Launch:
    rd = RunDir(tmp_path / "run").create({"kind": "command", "command": argv})
    env = {"PATH": os.environ["PATH"], "OFFLOAD_JOBS_JOB_ID": job_id, "OFFLOAD_JOBS_ATTEMPT": str(attempt), **(env or {})}
    return Launch(job_id=job_id, attempt=attempt, argv=argv, env=env, cwd=str(rd.path), run_dir=rd)


def _wait(ex: ProcessExecutor, h, timeout: float = 15.0) -> Exit:
    deadline = time.monotonic() + timeout
    while (res := ex.poll(h)) is None:
        assert time.monotonic() < deadline, "child did not end"
        time.sleep(0.01)
    return res


def test_child_writes_output_log_in_its_own_process_group(tmp_path: Path, ex: ProcessExecutor) -> None:
    launch = _launch(tmp_path, ["/bin/sh", "-c", "echo out; echo err >&2; ps -o pgid= -p $$; exit 4"])
    launch.run_dir.append_log("before\n")
    h = ex.start(launch)
    assert h.pgid == h.pid != os.getpgrp()
    assert _wait(ex, h) == Exit(exit_code=4)
    lines = launch.run_dir.log_file.read_text().split()
    assert lines[:3] == ["before", "out", "err"]  # appended after what was there; stderr too
    assert int(lines[3]) == h.pid  # the child leads its own group
    assert isinstance(h.info["starttime"], int) and isinstance(h.info["launcher_starttime"], int)
    rec = launch.run_dir.read_exit(1)
    assert rec is not None and (rec["exit_code"], rec["ran"], rec["pid"]) == (4, True, h.pid)


def test_a_held_child_runs_nothing_until_released(tmp_path: Path, ex: ProcessExecutor) -> None:
    marker = tmp_path / "ran"
    launch = _launch(tmp_path, ["/bin/sh", "-c", f"touch {marker}"])
    h = ex.prepare(launch)
    # The identity exists before any job code ran: the pid is alive and the cgroup holds it.
    assert proctree.alive(h.pid, h.info["starttime"]) and proctree.alive(h.info["launcher_pid"])
    if h.info["cgroup"]:
        assert h.pid in proctree.Cgroup(h.info["cgroup"]).procs()
    time.sleep(0.3)
    assert not marker.exists()
    ex.release(h)
    assert _wait(ex, h).exit_code == 0 and marker.exists()
    ex.cleanup(h)


def test_an_aborted_child_never_runs(tmp_path: Path, ex: ProcessExecutor) -> None:
    marker = tmp_path / "ran"
    launch = _launch(tmp_path, ["/bin/sh", "-c", f"touch {marker}"])
    h = ex.prepare(launch)
    ex.abort(h)  # what a worker that dies before recording the child amounts to: EOF on the go pipe
    res = _wait(ex, h)
    assert res.ran is False and not marker.exists()
    assert launch.run_dir.read_exit(1)["ran"] is False
    ex.cleanup(h)


def test_missing_binary_and_workdir_are_setup_errors(tmp_path: Path, ex: ProcessExecutor) -> None:
    h = ex.start(_launch(tmp_path, ["/no/such/bin"]))
    res = _wait(ex, h)
    assert "/no/such/bin" in res.setup_error
    assert classify(res, stop_reason=None, killed_by_us=False, exit_report=None)[:2] == ("FAILED", "setup_failed")
    launch = _launch(tmp_path, ["true"])
    launch.cwd = str(tmp_path / "gone")
    res = _wait(ex, ex.start(launch))
    assert "workdir" in res.setup_error and "gone" in res.setup_error


def test_terminate_reaches_the_whole_group(tmp_path: Path, ex: ProcessExecutor) -> None:
    h = ex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 100 & sleep 100 & wait"]))
    deadline = time.monotonic() + 5
    while len(pgid_alive(h.pgid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pgid_alive(h.pgid)) == 3
    ex.terminate(h)
    res = _wait(ex, h)
    assert res.signal == signal.SIGTERM or res.exit_code is not None
    assert pgid_alive(h.pgid) == []  # the launcher ends what is left before it records the exit


def test_background_children_end_with_the_job(tmp_path: Path, ex: ProcessExecutor) -> None:
    h = ex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 100 & setsid sleep 100 & echo bg"]))
    assert _wait(ex, h).exit_code == 0
    assert pgid_alive(h.pgid) == [] and proctree.find_tagged("j", 1) == []
    ex.cleanup(h)


def test_a_new_worker_adopts_a_running_attempt_and_reads_its_exit(tmp_path: Path, ex: ProcessExecutor) -> None:
    launch = _launch(tmp_path, ["/bin/sh", "-c", "sleep 0.5; exit 7"])
    h = ex.start(launch)
    again = ProcessExecutor(use_cgroups=ex.cgroup_root is not None)  # as after a restart: no Popen
    rec = again.recover("j", 1, h.info, launch.run_dir)
    assert rec.state == "running" and rec.handle is not None
    res = _wait(again, rec.handle)
    assert res.exit_code == 7 and res.ran
    assert again.recover("j", 1, h.info, launch.run_dir).state == "ended"
    ex.poll(h)  # reap the launcher here


def test_a_reused_pid_is_never_adopted_nor_killed(tmp_path: Path, ex: ProcessExecutor) -> None:
    launch = _launch(tmp_path, ["sleep", "100"])
    h = ex.start(launch)
    stranger = {**h.info, "launcher_starttime": h.info["launcher_starttime"] - 100, "starttime": h.info["starttime"] - 100,
                "cgroup": None, "job_id": "other", "attempt": 9}
    rec = ex.recover("other", 9, stranger, launch.run_dir)
    assert rec.state == "lost"  # the pids belong to other processes now: not ours to adopt
    ex.reap("other", 9, stranger, launch.run_dir)
    assert ex.poll(h) is None  # ...nor to kill
    ex.kill(h)
    assert _wait(ex, h).signal == signal.SIGKILL


def test_command_runner_env_contract(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run").create({})
    spec = parse_spec({"kind": "command", "command": "echo $OFFLOAD_JOBS_METRICS", "env": {"A": "1"}})
    plan = get_runner("command")(spec, rd, {"PATH": "/bin"})
    assert plan.argv == ["/bin/sh", "-c", "echo $OFFLOAD_JOBS_METRICS"] and plan.cwd == str(rd.path)
    assert plan.env["OFFLOAD_JOBS_RUN_DIR"] == str(rd.path)
    assert plan.env["OFFLOAD_JOBS_METRICS"] == str(rd.metrics_file)
    assert plan.env["A"] == "1" and plan.env["PATH"] == "/bin"
    listed = get_runner("command")(parse_spec({"kind": "command", "command": ["ls", "-l"], "workdir": "/tmp"}), rd, {})
    assert listed.argv == ["ls", "-l"] and listed.cwd == "/tmp"
    shard = get_runner("shard")(parse_spec({"kind": "shard", "shard": {"src": "a", "dst": "b"}}), rd, {})
    assert shard.argv[1:] == ["-m", "jobs.runners.shard_main", str(rd.path)]
    with pytest.raises(SetupFailed):
        get_runner("bake")


@pytest.mark.parametrize("ex, stop, killed, report, expected", [
    (Exit(0), None, False, None, ("SUCCEEDED", None)),
    (Exit(3), None, False, None, ("FAILED", "exit_nonzero")),
    (Exit(None, signal.SIGKILL), None, False, None, ("FAILED", "killed")),
    (Exit(137), None, False, None, ("FAILED", "killed")),
    (Exit(None, signal.SIGKILL, oom=True), None, False, None, ("FAILED", "host_oom")),
    (Exit(137, oom=True), None, False, None, ("FAILED", "host_oom")),
    (Exit(127, setup_error="cannot start 'x'"), None, False, None, ("FAILED", "setup_failed")),
    (Exit(1), None, False, {"reason": "nonfinite_loss"}, ("FAILED", "nonfinite_loss")),
    (Exit(None, signal.SIGKILL), "cancelled", True, None, ("CANCELLED", "cancelled")),
    (Exit(None, signal.SIGTERM), "timeout", False, None, ("FAILED", "timeout")),
    (Exit(None, signal.SIGSEGV), None, False, None, ("FAILED", "exit_nonzero")),
    (Exit(1), None, False, {"reason": "cuda_oom"}, ("FAILED", "cuda_oom")),
    (Exit(2), None, False, {"reason": "setup_failed", "message": "m"}, ("FAILED", "setup_failed")),
    (Exit(0), None, False, {"reason": "cuda_oom"}, ("SUCCEEDED", None)),  # a report never fails a clean exit
])
def test_classify(ex: Exit, stop, killed, report, expected) -> None:
    assert classify(ex, stop_reason=stop, killed_by_us=killed, exit_report=report)[:2] == expected


def test_an_unreleased_child_never_counts_as_run_even_without_exit_json(tmp_path: Path, ex: ProcessExecutor) -> None:
    """A full disk can refuse even exit.json; a child the worker never let go still never ran."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        launch = _launch(mnt, ["/bin/sh", "-c", f"touch {tmp_path}/ran"])
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        h = ex.prepare(launch)
        ex.abort(h)
        res = _wait(ex, h)
        assert launch.run_dir.read_exit(1) is None, "the disk was not full after all"
        assert res.ran is False and not (tmp_path / "ran").exists()
        ex.cleanup(h)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])
