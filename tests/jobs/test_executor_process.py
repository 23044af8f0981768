"""The process executor on real children, and how an ended attempt is classified."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from jobs_helpers import pgid_alive

from jobs.executors import Exit, Launch, SetupFailed, classify
from jobs.executors.process import ProcessExecutor
from jobs.rundir import RunDir
from jobs.runners import get_runner
from jobs.spec import parse_spec


def _launch(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> Launch:
    rd = RunDir(tmp_path / "run").create({"kind": "command", "command": argv})
    return Launch(job_id="j", attempt=1, argv=argv, env={"PATH": os.environ["PATH"], **(env or {})},
                  cwd=str(rd.path), run_dir=rd)


def _wait(ex: ProcessExecutor, h, timeout: float = 10.0) -> Exit:
    deadline = time.monotonic() + timeout
    while (res := ex.poll(h)) is None:
        assert time.monotonic() < deadline, "child did not end"
        time.sleep(0.01)
    return res


def test_child_writes_output_log_in_its_own_process_group(tmp_path: Path) -> None:
    ex = ProcessExecutor()
    launch = _launch(tmp_path, ["/bin/sh", "-c", "echo out; echo err >&2; ps -o pgid= -p $$; exit 4"])
    launch.run_dir.append_log("before\n")
    h = ex.start(launch)
    assert h.pgid == h.pid != os.getpgrp()
    assert _wait(ex, h) == Exit(exit_code=4)
    lines = launch.run_dir.log_file.read_text().split()
    assert lines[:3] == ["before", "out", "err"]  # appended after what was there; stderr too
    assert int(lines[3]) == h.pid  # the child leads its own group
    assert h.info["create_time"] is not None


def test_missing_binary_is_setup_failed(tmp_path: Path) -> None:
    with pytest.raises(SetupFailed, match="/no/such/bin"):
        ProcessExecutor().start(_launch(tmp_path, ["/no/such/bin"]))


def test_terminate_reaches_the_whole_group(tmp_path: Path) -> None:
    ex = ProcessExecutor()
    h = ex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 100 & sleep 100 & wait"]))
    deadline = time.monotonic() + 5
    while len(pgid_alive(h.pgid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(pgid_alive(h.pgid)) == 3
    ex.terminate(h)
    res = _wait(ex, h)
    assert res.signal == signal.SIGTERM or res.exit_code is not None
    deadline = time.monotonic() + 5
    while pgid_alive(h.pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pgid_alive(h.pgid) == []


def test_cleanup_kills_background_children_left_by_the_leader(tmp_path: Path) -> None:
    ex = ProcessExecutor()
    h = ex.start(_launch(tmp_path, ["/bin/sh", "-c", "sleep 100 & echo bg"]))
    assert _wait(ex, h).exit_code == 0
    assert pgid_alive(h.pgid)  # the background sleep outlived its parent
    ex.cleanup(h)
    deadline = time.monotonic() + 5
    while pgid_alive(h.pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pgid_alive(h.pgid) == []


def test_kill_orphan_checks_the_pid_is_still_ours(tmp_path: Path) -> None:
    ex = ProcessExecutor()
    h = ex.start(_launch(tmp_path, ["sleep", "100"]))
    assert ex.kill_orphan({**h.info, "create_time": h.info["create_time"] - 100}, h.pid, h.pgid) is False
    assert ex.poll(h) is None  # a reused pid is left alone
    assert ex.kill_orphan(h.info, h.pid, h.pgid) is True
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
    (Exit(None, signal.SIGKILL), None, False, None, ("FAILED", "host_oom")),
    (Exit(137), None, False, None, ("FAILED", "host_oom")),
    (Exit(None, signal.SIGKILL), "cancelled", True, None, ("CANCELLED", "cancelled")),
    (Exit(None, signal.SIGTERM), "timeout", False, None, ("FAILED", "timeout")),
    (Exit(None, signal.SIGSEGV), None, False, None, ("FAILED", "exit_nonzero")),
    (Exit(1), None, False, {"reason": "cuda_oom"}, ("FAILED", "cuda_oom")),
    (Exit(2), None, False, {"reason": "setup_failed", "message": "m"}, ("FAILED", "setup_failed")),
    (Exit(0), None, False, {"reason": "cuda_oom"}, ("SUCCEEDED", None)),  # a report never fails a clean exit
])
def test_classify(ex: Exit, stop, killed, report, expected) -> None:
    assert classify(ex, stop_reason=stop, killed_by_us=killed, exit_report=report)[:2] == expected
