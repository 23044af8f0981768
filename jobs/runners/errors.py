"""Which runner failures are the user's to fix, and the reason each one reports to the worker.

The runners' own errors (`RunnerInputError` and its subclasses, `NoCuda`, `NonFiniteLoss`) are drawn
on the one tree of the jobs wing's errors, in `jobs.errors`. Input errors report reason setup_failed
and exit 2; `NoCuda` reports no_cuda and `NonFiniteLoss` nonfinite_loss.
"""

from __future__ import annotations

import os
import sys
from typing import Callable
from jobs.contract import Reason

from jobs.errors import JobsError, chain

__all__ = ["RunnerInputError", "DatasetError", "FamilyError", "CheckpointError", "LoraError", "PromptError", "OptimizerError",
           "SetupError", "NonFiniteLoss", "NoCuda", "classify_exception", "reporting_failures"]


class NoCuda(JobsError, RuntimeError):
    """The job asks for a CUDA device that this process's torch cannot use (reason no_cuda)."""


class RunnerInputError(JobsError, ValueError):
    """Bad input to a train or infer job, found by the runner: the job fails with reason setup_failed."""


class DatasetError(RunnerInputError):
    """Bad training data: a missing or unreadable file, a missing column, no images at all."""


class FamilyError(RunnerInputError):
    """A model folder that is not a diffusers folder of the family asked for."""


class CheckpointError(RunnerInputError):
    """A model.transformer file that is unreadable, truncated, of no known family, or not a transformer."""


class LoraError(RunnerInputError):
    """A LoRA that cannot be made or used: no module matched, a file of another family, unreadable."""


class PromptError(RunnerInputError):
    """A prompt whose inline options do not parse."""


class OptimizerError(RunnerInputError):
    """train.optimizer names an optimizer whose library is not installed (the message names the extra)."""


class SetupError(RunnerInputError):
    """Other bad input found before the work starts."""


class NonFiniteLoss(JobsError, RuntimeError):
    """The loss became NaN or infinite: the job stops with reason nonfinite_loss and the step."""

    def __init__(self, step: int, value: float) -> None:
        self.step, self.value = step, value
        super().__init__(f"the loss is {value} at step {step}; lower train.learning_rate or check the data")


def classify_exception(exc: BaseException) -> tuple[str, str, int] | None:
    """(reason, one-line message, exit code) for a failure a user can cause or must see; None for a bug."""
    from jobs.hub import HubError

    if isinstance(exc, (RunnerInputError, HubError)):
        return Reason.SETUP_FAILED, str(exc), 2
    if isinstance(exc, NoCuda):
        return Reason.NO_CUDA, str(exc), 2
    if isinstance(exc, PermissionError):
        where = f" {exc.filename}" if exc.filename else ""
        return Reason.PERMISSION_DENIED, f"cannot read{where}: permission denied to uid {os.getuid()} (gid {os.getgid()})", 2
    found = _input_file_error(exc)
    if found is not None:
        return Reason.SETUP_FAILED, found, 2
    if isinstance(exc, NonFiniteLoss):
        return Reason.NONFINITE_LOSS, str(exc), 1
    core = sys.modules.get("offload_core.errors")  # loaded only if the engine was
    if core is not None and isinstance(exc, core.OffloadError):
        return Reason.SETUP_FAILED, f"offload: {exc}", 2
    torch = sys.modules.get("torch")
    ooms = [e for e in chain(exc) if isinstance(e, torch.cuda.OutOfMemoryError)] if torch is not None else []
    oom = ooms[0] if ooms else None
    if oom is not None:  # itself, or what an error raised while unwinding from it (a hook's exit) hides
        return Reason.CUDA_OOM, f"out of GPU memory: {str(oom).splitlines()[0]}", 1
    if isinstance(exc, MemoryError):
        return Reason.HOST_OOM, f"out of host memory: {exc}", 1
    return None


def _input_file_error(exc: BaseException) -> str | None:
    """One line for a model or data file that is missing or corrupt (a safetensors header, say)."""
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)) and exc.filename:
        return f"{exc.filename}: {exc.strerror or type(exc).__name__}"
    if type(exc).__name__ == "SafetensorError" or (isinstance(exc, OSError) and "safetensors" in str(exc).lower()):
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"a model file cannot be read: {first[:300]}"
    return None


def reporting_failures(work: Callable[[], None]) -> None:
    """Run `work`; a failure `classify_exception` knows becomes the exit report and one line, not a traceback."""
    from jobs.runners._entry import fail

    try:
        work()
    except Exception as exc:
        known = classify_exception(exc)
        if known is None:
            raise
        reason, message, code = known
        fail(reason, message, code=code)
