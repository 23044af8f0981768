"""Executors by name; `docker` and `slurm` are imported only when a job asks for them."""

from __future__ import annotations

from jobs.executors.base import Executor, Exit, Handle, Launch, Recovered, SetupFailed, classify

__all__ = ["Executor", "Exit", "Handle", "Launch", "Recovered", "SetupFailed", "classify", "get_executor"]


def get_executor(name: str) -> Executor:
    if name == "process":
        from jobs.executors.process import ProcessExecutor

        return ProcessExecutor()
    if name == "docker":
        from jobs.executors.docker import DockerExecutor

        return DockerExecutor()
    if name == "slurm":
        from jobs.executors.slurm import SlurmExecutor

        return SlurmExecutor()
    raise SetupFailed(f"unknown executor {name!r}; use process, docker or slurm")
