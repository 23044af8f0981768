"""The executor interface: prepare an attempt, let it go, poll it, stop it, recover it.

An executor only runs argv; the scheduler decides when, and `classify` turns how a child ended
into a status and reason. Starting is two steps so that no job code runs unrecorded:

    handle = ex.prepare(launch)   # the child exists, held: its identity is handle.info
    store.mark_running(..., handle=handle.info)
    ex.release(handle)            # only now may it run

After a worker crash, `recover` tells for each attempt left live in the store whether its child
still runs (adopt it), ended meanwhile (its real exit), never ran, or is lost; `reap` kills
whatever is left of an attempt before it is retried.
"""

from __future__ import annotations

import signal
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from jobs.contract import JobState, Reason
from jobs.errors import ExecutorError
from jobs.rundir import RunDir

__all__ = ["Launch", "Handle", "Exit", "Recovered", "Executor", "SetupFailed", "classify"]


class SetupFailed(ExecutorError):
    """The attempt could not be started (missing binary, no Docker daemon, bad image, ...): an ExecutorError."""


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
    umask: int = 0o022  # the job's umask (the worker itself runs with 077)
    lease_file: str | None = None  # shared stores: the worker's lease, enforced where the job runs
    time_limit: float | None = None  # limits.max_duration, for executors that enforce it themselves (slurm)
    stop_grace: float = 10.0
    name: str | None = None  # the job's display name (for a batch system's queue)
    gpu_request: int = 0  # GPUs the job asks for (an executor that places jobs itself, Slurm, needs the count)
    warm: bool = False  # a runner module: the process executor may fork it from a warm process


@dataclass
class Handle:
    """A prepared or running attempt; `info` is what the store keeps to find it again after a crash."""

    pid: int | None = None
    pgid: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    obj: Any = None  # the live Popen / container / adoption state


@dataclass
class Exit:
    """How an attempt ended."""

    exit_code: int | None  # None when killed by a signal
    signal: int | None = None
    oom: bool | None = None  # the kernel's OOM killer did it (None: cannot tell)
    ran: bool = True  # False: the child was stopped before it ran any job code
    setup_error: str | None = None  # it could not start (no such binary, missing workdir)
    report: dict[str, Any] | None = None  # the job's own report.json
    unknown: bool = False  # it ended with no record of how (its launcher was killed, say)
    fenced: bool = False  # stopped where it ran because its worker's lease was running out
    timed_out: bool = False  # the executor's own time limit ended it (Slurm's --time and --signal)


@dataclass
class Recovered:
    """What became of an attempt while no worker watched it.

    state: "running" (handle set: adopt it), "ended" (exit set), "never_ran", or "lost".
    """

    state: str
    handle: Handle | None = None
    exit: Exit | None = None
    message: str | None = None


class Executor(ABC):
    name: str = "base"
    enforces_time_limit = False  # True: limits.max_duration is the executor's (Slurm), not the scheduler's

    @abstractmethod
    def prepare(self, launch: Launch) -> Handle:
        """Create the attempt's child, held before any job code runs; raise SetupFailed when it cannot."""

    @abstractmethod
    def release(self, handle: Handle) -> None:
        """Let a prepared attempt run (after its identity is in the store)."""

    def abort(self, handle: Handle) -> None:
        """Drop a prepared attempt without running it."""
        self.kill(handle)

    def start(self, launch: Launch) -> Handle:
        """prepare + release, for callers that keep no store (tests, tools)."""
        handle = self.prepare(launch)
        self.release(handle)
        return handle

    @abstractmethod
    def poll(self, handle: Handle) -> Exit | None:
        """None while running, else how it ended."""

    @abstractmethod
    def terminate(self, handle: Handle) -> None:
        """Ask every process of the attempt to stop (SIGTERM / docker stop)."""

    @abstractmethod
    def kill(self, handle: Handle) -> None:
        """Stop every process of the attempt now (SIGKILL / docker kill)."""

    def cleanup(self, handle: Handle) -> None:
        """After the attempt ended and was recorded: reap stragglers, remove cgroups and containers."""

    def recover(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> Recovered:
        """After a worker restart: what became of this attempt (`info` is its recorded identity)."""
        return Recovered("lost", message="this executor cannot recover attempts")

    def reap(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> int:
        """Kill every process left of an attempt no one adopts; returns how many were alive."""
        return 0


def classify(ex: Exit, *, stop_reason: str | None, killed_by_us: bool,
             exit_report: dict[str, Any] | None) -> tuple[str, str | None, str | None]:
    """(status, reason, message) for an ended attempt.

    `stop_reason` is why the worker stopped it (cancelled / timeout), if it did.
    """
    if stop_reason == Reason.CANCELLED:
        return JobState.CANCELLED, Reason.CANCELLED, None
    if stop_reason == Reason.TIMEOUT:
        return JobState.FAILED, Reason.TIMEOUT, "exceeded limits.max_duration"
    if ex.setup_error:
        return JobState.FAILED, Reason.SETUP_FAILED, ex.setup_error
    if ex.exit_code == 0:
        return JobState.SUCCEEDED, None, None
    report = exit_report if exit_report is not None else ex.report
    report_reason = (report or {}).get("reason")
    report_msg = (report or {}).get("message")
    if report_reason in (Reason.CUDA_OOM, Reason.SETUP_FAILED, Reason.HOST_OOM, Reason.NONFINITE_LOSS, Reason.NO_CUDA,
                         Reason.PERMISSION_DENIED, Reason.WORKER_LOST):  # worker_lost: a batch member whose leader died
        return JobState.FAILED, report_reason, report_msg
    sigkill = ex.signal == signal.SIGKILL or ex.exit_code == 128 + signal.SIGKILL
    if sigkill and not killed_by_us:
        if ex.oom:
            return JobState.FAILED, Reason.HOST_OOM, "killed by the kernel's OOM killer (host memory ran out)"
        return JobState.FAILED, Reason.KILLED, "killed by a SIGKILL that neither the worker nor the OOM killer sent"
    if ex.signal is not None:
        name = signal.Signals(ex.signal).name if ex.signal in signal.Signals._value2member_map_ else str(ex.signal)
        return JobState.FAILED, Reason.EXIT_NONZERO, report_msg or f"killed by {name}"
    return JobState.FAILED, Reason.EXIT_NONZERO, report_msg or f"exit code {ex.exit_code}"
