"""Errors a user of the engine can cause.

    OffloadError
    ├── OffloadConfigError      a bad config key or value (unknown granularity, bad budget)
    ├── NotAModuleError         enable_offload / the manager was given something else
    ├── DeviceUnavailableError  target_device names a device this machine lacks
    ├── OptimizerMismatchError  optimizer offload with a trainable parameter the optimizer lacks
    └── ShardError              a missing, corrupt or mismatched shard directory

Bugs inside the engine still raise ordinary exceptions.
"""

from __future__ import annotations

__all__ = [
    "OffloadError",
    "OffloadConfigError",
    "NotAModuleError",
    "DeviceUnavailableError",
    "OptimizerMismatchError",
    "ShardError",
]


class OffloadError(Exception):
    """Base class for every error a user of offload_core can cause."""


class OffloadConfigError(OffloadError, ValueError):
    """A config key or value is wrong; the message names the key."""


class NotAModuleError(OffloadError, TypeError):
    """The object handed to the engine is not a torch.nn.Module."""


class DeviceUnavailableError(OffloadError, RuntimeError):
    """The target device does not exist on this machine."""


class OptimizerMismatchError(OffloadError, ValueError):
    """Optimizer offload was asked for, but a trainable parameter is not in the optimizer."""


class ShardError(OffloadError, OSError):
    """A shard directory or file is missing, corrupt or does not match the model."""
