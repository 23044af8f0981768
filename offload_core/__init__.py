"""offload_core: stream the weights of models bigger than VRAM from host memory.

    from offload_core import enable_offload
    handle = enable_offload(transformer, target_device="cuda", offload_granularity="block")
    image = pipe(prompt).images[0]
    print(handle.stats())
    handle.remove()
"""

from __future__ import annotations

from .api import OffloadHandle, enable_offload
from .config import Granularity, OffloadConfig, parse_bytes
from .errors import (
    AlreadyOffloadedError,
    DeviceUnavailableError,
    LossyStorageWarning,
    NotAModuleError,
    OffloadConfigError,
    OffloadError,
    OptimizerMismatchError,
    OptimizerOverlapError,
    ShardError,
    VramBudgetError,
)
from .store import HostStore
from .training import OffloadTrainingManager

__all__ = [
    "AlreadyOffloadedError",
    "DeviceUnavailableError",
    "Granularity",
    "HostStore",
    "LossyStorageWarning",
    "NotAModuleError",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadError",
    "OffloadHandle",
    "OffloadTrainingManager",
    "OptimizerMismatchError",
    "OptimizerOverlapError",
    "ShardError",
    "VramBudgetError",
    "enable_offload",
    "parse_bytes",
]
