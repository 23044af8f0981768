"""The executor interface: start an attempt, poll it, stop it.

An executor only runs argv; the scheduler decides when, and `classify` turns how a child ended
into a status and reason.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from jobs.rundir import RunDir

__all__ = ["Launch", "Handle", "Exit", "Executor", "SetupFailed", "classify"]


class SetupFailed(Exception):
    """The attempt could not be started (missing binary, no Docker daemon, bad image, ...)."""


@dataclass
class Launch:
    """What to run for one attempt."""

    job_id: str
    attempt: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    run_dir: RunDir
    gpus: list[int] = field(default_factory=list)  # device indexes given to this attempt
    job_env: dict[str, str] = field(default_factory=dict)  # only what differs from the worker's env (for containers)
    image: str | None = None
    shm_size: int | None = None


@dataclass
class Handle:
    """A started attempt; `info` is what the store keeps to find it again after a crash."""

    pid: int | None = None
    pgid: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    obj: Any = None  # the live Popen / container


@dataclass
class Exit:
    exit_code: int | None  # None when killed by a signal
    signal: int | None = None


class Executor(ABC):
    name: str = "base"

    @abstractmethod
    def start(self, launch: Launch) -> Handle:
        """Start the attempt; raise SetupFailed when it cannot start."""

    @abstractmethod
    def poll(self, handle: Handle) -> Exit | None:
        """None while running, else how it ended."""

    @abstractmethod
    def terminate(self, handle: Handle) -> None:
        """Ask the whole attempt to stop (SIGTERM to the process group / docker stop)."""

    @abstractmethod
    def kill(self, handle: Handle) -> None:
        """Stop it now (SIGKILL to the process group / docker kill)."""

    def cleanup(self, handle: Handle) -> None:
        """After the attempt ended: reap stragglers, remove containers."""

    def kill_orphan(self, info: dict[str, Any], pid: int | None, pgid: int | None) -> bool:
        """Kill an attempt left by a dead worker; True if something was still alive."""
        return False


def classify(ex: Exit, *, stop_reason: str | None, killed_by_us: bool,
             exit_report: dict[str, Any] | None) -> tuple[str, str | None, str | None]:
    """(status, reason, message) for an ended attempt.

    `stop_reason` is why the worker stopped it (cancelled / timeout), if it did.
    """
    if stop_reason == "cancelled":
        return "CANCELLED", "cancelled", None
    if stop_reason == "timeout":
        return "FAILED", "timeout", "exceeded limits.max_duration"
    if ex.exit_code == 0:
        return "SUCCEEDED", None, None
    report_reason = (exit_report or {}).get("reason")
    report_msg = (exit_report or {}).get("message")
    if report_reason in ("cuda_oom", "setup_failed", "host_oom"):
        return "FAILED", report_reason, report_msg
    sigkill = ex.signal == signal.SIGKILL or ex.exit_code == 128 + signal.SIGKILL
    if sigkill and not killed_by_us:
        return "FAILED", "host_oom", "killed by SIGKILL not sent by the worker (likely the kernel OOM killer)"
    if ex.signal is not None:
        name = signal.Signals(ex.signal).name if ex.signal in signal.Signals._value2member_map_ else str(ex.signal)
        return "FAILED", "exit_nonzero", report_msg or f"killed by {name}"
    return "FAILED", "exit_nonzero", report_msg or f"exit code {ex.exit_code}"
