"""`offload-jobs --help` and `offload-jobs ps` stay light: no torch, diffusers, fastapi, sqlalchemy or
uvicorn (python -X importtime evidence), and the measured wall time of `ps` is reported."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "diffusers", "fastapi", "sqlalchemy", "uvicorn", "starlette", "peft", "accelerate",
             "safetensors", "offload_core", "textual")


def imported_modules(args: list[str], home: Path) -> tuple[set[str], subprocess.CompletedProcess[str]]:
    """Run `python -X importtime -m jobs.cli ARGS` and return every module it imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(home)
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "jobs.cli", *args], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=60)
    mods = set()
    for line in res.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                mods.add(name)
    return mods, res


def heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in FORBIDDEN)


@pytest.mark.parametrize("args", [["--help"], ["ps", "--help"], ["submit", "--help"]])
def test_help_imports_nothing_heavy(args: list[str], tmp_path: Path) -> None:
    mods, res = imported_modules(args, tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "jobs._cli.output" in mods and "typer" in mods  # the probe saw the real imports
    assert heavy(mods) == []
    assert "jobs.client" not in mods and "httpx" not in mods  # --help does not even load the client


@pytest.mark.parametrize("args", [["ps", "--json"], ["ps"], ["ps", "--all"]])
def test_ps_imports_nothing_heavy(args: list[str], worker: Any) -> None:
    mods, res = imported_modules(args, worker.home)
    assert res.returncode == 0, res.stderr[-2000:]
    assert {"jobs._cli.output", "jobs.client", "httpx"} <= mods  # it did talk to the worker
    assert heavy(mods) == []
    # typer builds a pydantic adapter per option; jobs._cli.lazy_coercion defers that until a value is given.
    assert "typer._adapters" not in mods
    assert not any(m == "pydantic" or m.startswith("pydantic.") for m in mods)


def test_no_worker_error_imports_nothing_heavy(tmp_path: Path) -> None:
    mods, res = imported_modules(["ps"], tmp_path)
    assert res.returncode == 2
    assert heavy(mods) == []


def _seed(home: Path, n: int) -> None:
    """`n` jobs straight into a new store: one GPU slot, so they stay queued behind each other."""
    from jobs.rundir import RunDir
    from jobs.store import JobStore

    store = JobStore(home / "jobs.db")
    spec = {"kind": "command", "command": "sleep 600", "resources": {"gpus": 1}, "env": {"NOTE": "x" * 200}}
    for i in range(n):
        job_id = store.new_id()
        rd = RunDir.for_job(home, job_id).create(spec)
        store.create_job(spec, kind="command", name=f"seeded-{i}", gpus=1, max_attempts=3, job_id=job_id,
                         run_dir_for=lambda _, p=str(rd.path): p)
    store.close()


@pytest.fixture(scope="module")
def thousand_jobs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from jobs_helpers import WorkerProcess

    home = tmp_path_factory.mktemp("thousand") / "home"
    home.mkdir()
    _seed(home, 1000)
    w = WorkerProcess(home, "--gpus", "1").start()
    yield w
    with w.client() as c:
        for j in c.list(status="RUNNING", summary=True):
            c.cancel(j["id"])
    w.stop()


# Runs per command: 2 in CI (the output is checked, the times printed); CLI_TIMES_RUNS=7 for a median worth quoting
RUNS = int(os.environ.get("CLI_TIMES_RUNS", "2"))


def time_cli(home: Path, runs: dict[str, list[str]], n: int = RUNS, check: Any = None) -> dict[str, tuple[list[float], list[float]]]:
    """{label: (wall seconds, CPU seconds)} of `n` runs of each console-script command against `home`."""
    import resource

    exe = Path(sys.executable).parent / "offload-jobs"
    if not exe.exists():
        pytest.fail("the offload-jobs console script is not installed; run: .venv/bin/pip install -e . --no-deps")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(home)
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in runs}
    for _ in range(n):
        for label, args in runs.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            res = subprocess.run([str(exe), *args], capture_output=True, text=True, env=env, timeout=60)
            out[label][0].append(time.perf_counter() - t0)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            out[label][1].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            assert res.returncode == 0, res.stderr
            if check is not None:
                check(label, res)
    return out


def report_times(tag: str, times: dict[str, tuple[list[float], list[float]]], capsys: Any) -> None:
    load = os.getloadavg()[0]
    with capsys.disabled():
        for label, (wall, cpu) in times.items():
            print(f"\n[latency{tag}] offload-jobs {label}: wall median {statistics.median(wall) * 1000:.0f} ms "
                  f"(min {min(wall) * 1000:.0f}), CPU median {statistics.median(cpu) * 1000:.0f} ms "
                  f"(min {min(cpu) * 1000:.0f}), over {len(wall)} runs at load average {load:.1f} on "
                  f"{os.cpu_count()} CPUs (budget 300 ms)")


def test_report_cli_times_with_1000_jobs(thousand_jobs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reports (does not assert) wall and CPU time of `ps`, `ps --json`, `ps --all` and `submit -d` on a
    worker holding 1,000 jobs (budget 0.3 s for `ps` and `submit -d`).

    Wall time depends on how busy the machine is; CPU time (user + sys of the child) much less so.
    """
    spec = tmp_path / "one.yaml"
    spec.write_text("kind: command\nname: timed\ncommand: 'true'\nresources: {gpus: 1}\n")

    def check(label: str, res: Any) -> None:
        if label == "ps":
            assert len(res.stdout.splitlines()) == 51 and "of 10" in res.stderr  # header + the newest 50
        if label == "ps --all":
            assert len(res.stdout.splitlines()) >= 1001

    runs = {"ps": ["ps"], "ps --json": ["ps", "--json"], "ps --all": ["ps", "--all"],
            "submit -d": ["submit", str(spec), "-d"]}
    report_times(", 1,000 jobs", time_cli(thousand_jobs.home, runs, check=check), capsys)


def test_report_ps_wall_time(worker: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """Reports (does not assert) the wall and CPU time of `offload-jobs ps` on a few jobs."""
    report_times("", time_cli(worker.home, {"ps": ["ps"], "ps --json": ["ps", "--json"]}), capsys)
