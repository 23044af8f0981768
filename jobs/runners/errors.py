"""Which runner failures are the user's to fix, and the reason each one reports to the worker."""

from __future__ import annotations

__all__ = ["classify_exception"]


def classify_exception(exc: BaseException) -> tuple[str, str, int] | None:
    """(reason, one-line message, exit code) for a failure a user can cause or must see; None for a bug."""
    from jobs.runners.data import DatasetError
    from jobs.runners.families import FamilyError
    from jobs.runners.lora import LoraError
    from jobs.runners.render import PromptError
    from jobs.runners.train import NonFiniteLoss, SetupError

    if isinstance(exc, NonFiniteLoss):
        return "nonfinite_loss", str(exc), 1
    if isinstance(exc, (DatasetError, FamilyError, LoraError, SetupError, PromptError)):
        return "setup_failed", str(exc), 2
    try:
        from offload_core.errors import OffloadError
    except ImportError:  # pragma: no cover
        OffloadError = ()  # type: ignore[assignment]
    if isinstance(exc, OffloadError):
        return "setup_failed", f"offload: {exc}", 2
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return "cuda_oom", f"out of GPU memory: {str(exc).splitlines()[0]}", 1
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, MemoryError):
        return "host_oom", f"out of host memory: {exc}", 1
    return None
