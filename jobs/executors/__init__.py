"""Executors by name; `docker` is imported only when a job asks for it."""

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
    raise SetupFailed(f"unknown executor {name!r}; use process or docker")
