"""Errors a user of the engine can cause, and the one warning it gives.

    OffloadError
    ├── OffloadConfigError        a bad config key or value (unknown granularity, bad budget)
    │   ├── VramBudgetError       vram_budget cannot hold what the model needs (ring, residents, activations)
    │   └── LayerOrderError       accumulation_order="layer" on a forward it cannot run layer-major (random draws)
    ├── NotAModuleError           enable_offload / the manager was given something else
    ├── AlreadyOffloadedError     enable_offload on a module (or part of one) that is offloaded already
    ├── DeviceUnavailableError    target_device names a device this machine lacks
    ├── OptimizerMismatchError    optimizer offload with a trainable parameter the optimizer lacks
    ├── OptimizerOverlapError     gradients changed after a step that already ran during backward
    ├── FrozenWeightError         a weight streamed as frozen was set to require grad after offloading began
    ├── OffloadedCopyError        a deep copy of an offloaded module, or a tensor of it replaced, would use the engine's bytes
    ├── OffloadedEditError        a streamed tensor edited in place between uses (the edit hit its empty placeholder)
    ├── CheckpointMismatchError   weights=: the checkpoint lacks a parameter of the model, or has another shape
    └── ShardError                a missing, corrupt or mismatched shard directory (or checkpoint file)

    LossyStorageWarning (a UserWarning)  remove() after a lossy weight_dtype: the model keeps the
                                         rounded weights

Bugs inside the engine still raise ordinary exceptions.
"""

from __future__ import annotations

__all__ = [
    "OffloadError",
    "OffloadConfigError",
    "VramBudgetError",
    "LayerOrderError",
    "NotAModuleError",
    "AlreadyOffloadedError",
    "DeviceUnavailableError",
    "OptimizerMismatchError",
    "OptimizerOverlapError",
    "FrozenWeightError",
    "OffloadedCopyError",
    "OffloadedEditError",
    "CheckpointMismatchError",
    "ShardError",
]


class OffloadError(Exception):
    """Base class for every error a user of offload_core can cause."""


class OffloadConfigError(OffloadError, ValueError):
    """A config key or value is wrong; the message names the key."""


class VramBudgetError(OffloadConfigError):
    """vram_budget is too small for the ring, the resident tensors and the measured activations."""


class LayerOrderError(OffloadConfigError):
    """accumulation_order="layer" met a forward it cannot run layer-major: one that draws random numbers
    (dropout), which a checkpoint would replay from where every micro-batch stood at once."""


class NotAModuleError(OffloadError, TypeError):
    """The object handed to the engine is not a torch.nn.Module."""


class AlreadyOffloadedError(OffloadError, RuntimeError):
    """enable_offload was called on a module that is already offloaded; remove() the first engine."""


class DeviceUnavailableError(OffloadError, RuntimeError):
    """The target device does not exist on this machine."""


class OptimizerMismatchError(OffloadError, ValueError):
    """Optimizer offload was asked for, but a trainable parameter is not in the optimizer."""


class OptimizerOverlapError(OffloadError, RuntimeError):
    """A gradient was changed (clipped, unscaled) or added after its step already ran during backward."""


class FrozenWeightError(OffloadError, RuntimeError):
    """A weight streamed as a frozen view (which gets no gradient) would need one: a parameter frozen
    when offloading began now requires grad, or a backward pass runs through a model enable_offload
    took for inference (every parameter required grad)."""


class OffloadedCopyError(OffloadError, RuntimeError):
    """A copy (copy.deepcopy) of an offloaded module, or a tensor of it replaced after offloading began,
    would run on the engine's streamed bytes or write into them: copy or re-tie before enable_offload,
    or remove() first."""


class OffloadedEditError(OffloadError, RuntimeError):
    """A streamed tensor was edited in place between uses (``mul_``, ``nn.init.*``, ``model.apply``)
    while its values were in host memory: the edit acted on its empty placeholder and is lost. New
    values given as ``p.data = tensor`` or through ``load_state_dict`` do reach the host copy."""


def copied_module_error(where: str) -> OffloadedCopyError:
    name = where.rstrip(".") or "the module"
    return OffloadedCopyError(
        f"{name}: this is a copy (copy.deepcopy) of an offloaded module; it carries the original engine's hooks, "
        "so it would read or write the original model's weights. Copy the model before enable_offload, or remove() first")


class CheckpointMismatchError(OffloadError, ValueError):
    """The checkpoint given as ``weights`` does not fit the model: a parameter it lacks, another shape."""


class ShardError(OffloadError, OSError):
    """A shard directory or file is missing, corrupt or does not match the model."""


class LossyStorageWarning(UserWarning):
    """remove() after weight_dtype rounded the weights: the model holds the rounded values."""
