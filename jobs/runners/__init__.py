"""The runner registry: kind -> runner, which turns a JobSpec into the argv an executor runs.

Runners that need torch or offload_core run as `python -m jobs.runners.<kind>_main` in the child,
so the worker itself never imports them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobs.executors.base import SetupFailed
from jobs.rundir import RunDir
from jobs.spec import JobSpec

__all__ = ["Plan", "Runner", "register", "get_runner", "RUNNERS", "job_env"]

# The directory that holds the `jobs` package, so `python -m jobs.runners...` works uninstalled.
_SRC_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class Plan:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    warm: bool = False  # a runner module the process executor may fork from its warm process (executors/warm.py)


Runner = Callable[[JobSpec, RunDir, dict[str, str]], Plan]
RUNNERS: dict[str, Runner] = {}


def register(kind: str) -> Callable[[Runner], Runner]:
    def deco(fn: Runner) -> Runner:
        RUNNERS[kind] = fn
        return fn

    return deco


def get_runner(kind: str) -> Runner:
    try:
        return RUNNERS[kind]
    except KeyError:
        raise SetupFailed(f"no runner for kind {kind!r}") from None


def job_env(spec: JobSpec, run_dir: RunDir, base: dict[str, str]) -> dict[str, str]:
    """The child's environment: the worker's, the spec's `env`, and the run-dir contract."""
    env = dict(base)
    env.update(spec.env)
    env.update({
        "OFFLOAD_JOBS_RUN_DIR": str(run_dir.path),
        "OFFLOAD_JOBS_METRICS": str(run_dir.metrics_file),
        "OFFLOAD_JOBS_OUTPUTS": str(run_dir.outputs_dir),
        "OFFLOAD_JOBS_EXIT_REPORT": str(run_dir.report_file),
        "PYTHONUNBUFFERED": "1",  # lines reach output.log as they are printed
    })
    return env


def _cwd(spec: JobSpec, run_dir: RunDir) -> str:
    if spec.workdir:
        return os.path.expanduser(spec.workdir)
    return str(run_dir.path)


@register("command")
def command_runner(spec: JobSpec, run_dir: RunDir, base_env: dict[str, str]) -> Plan:
    cmd = spec.command
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd or [])
    return Plan(argv=argv, env=job_env(spec, run_dir, base_env), cwd=_cwd(spec, run_dir))


def _module_runner(module: str) -> Runner:
    def run(spec: JobSpec, run_dir: RunDir, base_env: dict[str, str]) -> Plan:
        env = job_env(spec, run_dir, base_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC_ROOT, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", module, str(run_dir.path)]
        # The warm process keeps bitsandbytes out, as the runners do for every job but adamw8bit's.
        needs_bnb = getattr(getattr(spec, "train", None), "optimizer", None) == "adamw8bit"
        return Plan(argv=argv, env=env, cwd=_cwd(spec, run_dir), warm=not needs_bnb)

    return run


register("shard")(_module_runner("jobs.runners.shard_main"))
register("train")(_module_runner("jobs.runners.train_main"))
register("infer")(_module_runner("jobs.runners.infer_main"))
