"""Which runner failures are the user's to fix, and the reason each one reports to the worker.

The runners' own errors, on the tree drawn in `jobs.errors`:

    JobsError
    ├── RunnerInputError    bad input to a train or infer job: reason setup_failed, exit 2
    │   ├── DatasetError    a missing or unreadable file, a missing column, no images at all
    │   ├── FamilyError     a model folder that is not a diffusers folder of the family asked for
    │   ├── LoraError       a LoRA that cannot be made or used
    │   ├── PromptError     a prompt whose inline options do not parse
    │   ├── OptimizerError  train.optimizer names a library that is not installed
    │   └── SetupError      other bad input found before the work starts
    └── NonFiniteLoss       the loss became NaN or infinite: reason nonfinite_loss
"""

from __future__ import annotations

import sys
from typing import Callable

from jobs.errors import JobsError

__all__ = ["RunnerInputError", "DatasetError", "FamilyError", "LoraError", "PromptError", "OptimizerError",
           "SetupError", "NonFiniteLoss", "classify_exception", "reporting_failures"]


class RunnerInputError(JobsError, ValueError):
    """Bad input to a train or infer job, found by the runner: the job fails with reason setup_failed."""


class DatasetError(RunnerInputError):
    """Bad training data: a missing or unreadable file, a missing column, no images at all."""


class FamilyError(RunnerInputError):
    """A model folder that is not a diffusers folder of the family asked for."""


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
    if isinstance(exc, RunnerInputError):
        return "setup_failed", str(exc), 2
    if isinstance(exc, NonFiniteLoss):
        return "nonfinite_loss", str(exc), 1
    core = sys.modules.get("offload_core.errors")  # loaded only if the engine was
    if core is not None and isinstance(exc, core.OffloadError):
        return "setup_failed", f"offload: {exc}", 2
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return "cuda_oom", f"out of GPU memory: {str(exc).splitlines()[0]}", 1
    if isinstance(exc, MemoryError):
        return "host_oom", f"out of host memory: {exc}", 1
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
