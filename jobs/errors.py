"""Errors a user of the jobs wing can cause.

    JobsError
    ├── SpecError           a bad job spec: names the dotted field (and the YAML line when known)
    ├── WorkerUnreachable   no worker answers at the URL (the message names it)
    ├── AuthError           the worker refused the token (401) or the Host header (400/421)
    ├── JobNotFound         no job has that id
    ├── InvalidTransition   the job's state forbids the action (cancel a finished job, ...)
    ├── StoreError          the state store cannot be opened or migrated
    └── ExecutorError       an executor cannot start (no Docker daemon, ...)

Bugs still raise ordinary exceptions.
"""

from __future__ import annotations

__all__ = [
    "JobsError",
    "SpecError",
    "WorkerUnreachable",
    "AuthError",
    "JobNotFound",
    "InvalidTransition",
    "StoreError",
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
    """No worker answers at `url`."""

    def __init__(self, url: str, detail: str = ""):
        self.url = url
        msg = f"no offload-jobs worker reachable at {url}"
        if detail:
            msg += f" ({detail})"
        msg += "; start one with `offload-jobs worker` or `offload-jobs up --local`"
        super().__init__(msg)


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


class ExecutorError(JobsError, RuntimeError):
    """An executor cannot run jobs here (e.g. no Docker daemon)."""
