"""Errors a user of the jobs wing can cause.

    JobsError
    ├── SpecError           a bad job spec: names the dotted field (and the YAML line when known)
    ├── WorkerUnreachable   no worker answers at the URL (the message names it)
    ├── AuthError           the worker refused the token (401) or the Host header (400/421)
    ├── JobNotFound         no job has that id
    ├── InvalidTransition   the job's state forbids the action (cancel a finished job, ...)
    ├── StoreError          the state store cannot be opened, migrated or written (names the file)
    ├── RunDirError         a file of a run dir is unsafe to touch (a symlink planted by the job, ...)
    ├── RequestTooLarge     a request body over the worker's limit (a spec over 1 MiB, ...)
    ├── ExecutorError       an executor cannot start (no Docker daemon, ...)
    │   └── SetupFailed     (jobs.executors.base) an attempt could not be started: no sbatch, a bad image, ...
    ├── RunnerInputError    (jobs.runners.errors) bad input to a train or infer job: reason setup_failed
    │   ├── DatasetError    a missing or unreadable file, a missing column, no images at all
    │   ├── FamilyError     a model folder that is not a diffusers folder of the family asked for
    │   ├── CheckpointError a transformer file unreadable, truncated, of no known family, or not a transformer
    │   ├── LoraError       a LoRA that cannot be made or used
    │   ├── PromptError     a prompt whose inline options do not parse
    │   ├── OptimizerError  train.optimizer names a library that is not installed
    │   └── SetupError      other bad input found before the work starts
    ├── NoCuda              (jobs.runners.errors) the job asks for CUDA this torch cannot use: reason no_cuda
    └── NonFiniteLoss       (jobs.runners.errors) the loss became NaN or infinite: reason nonfinite_loss

The subclasses defined elsewhere live beside the code that raises them (the executors, the
runners); this module stays free of their imports.

Bugs still raise ordinary exceptions.
"""

from __future__ import annotations

from typing import Iterator

__all__ = [
    "chain",
    "JobsError",
    "SpecError",
    "WorkerUnreachable",
    "AuthError",
    "JobNotFound",
    "InvalidTransition",
    "StoreError",
    "RunDirError",
    "RequestTooLarge",
    "ExecutorError",
]


class JobsError(Exception):
    """Base class for every error a user of offload-jobs can cause."""


class SpecError(JobsError, ValueError):
    """A job spec is wrong; `field` is the dotted path (e.g. ``train.lr``)."""

    def __init__(self, field: str | None, message: str, line: int | None = None, file: str | None = None):
        self.field = field
        self.message = message
        self.line = line
        self.file = file
        super().__init__(str(self))

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = f"{self.file}"
            if self.line is not None:
                where += f":{self.line}"
            where += ": "
        elif self.line is not None:
            where = f"line {self.line}: "
        field = f"{self.field}: " if self.field else ""
        return f"{where}{field}{self.message}"


class WorkerUnreachable(JobsError, ConnectionError):
    """No worker answers at `url` (or none is running for the state dir)."""

    def __init__(self, url: str, detail: str = "", message: str | None = None):
        self.url = url
        if message is None:
            message = f"no offload-jobs worker reachable at {url}"
            if detail:
                message += f" ({detail})"
            message += "; start one with `offload-jobs worker` or `offload-jobs up --local`"
        super().__init__(message)


class AuthError(JobsError, PermissionError):
    """The worker refused the request's token or Host header."""


class JobNotFound(JobsError, LookupError):
    """No job has this id."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        super().__init__(f"no job with id {job_id!r}")


class InvalidTransition(JobsError, ValueError):
    """The job's current state forbids the requested action."""


class StoreError(JobsError, RuntimeError):
    """The state store cannot be opened, migrated or written."""


class RunDirError(JobsError, OSError):
    """A run dir file is not a plain regular file (a symlink, FIFO or hard link planted by the job)."""


class RequestTooLarge(JobsError, ValueError):
    """The request body is over the worker's size limit."""


class ExecutorError(JobsError, RuntimeError):
    """An executor cannot run jobs here (e.g. no Docker daemon)."""


def chain(exc: BaseException | None, limit: int = 16) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or while handling (``__cause__``, else ``__context__``), and
    so on: at most ``limit`` exceptions, each once."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < limit:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__
