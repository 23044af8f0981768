"""offload_core: stream the weights of models bigger than VRAM from host memory.

    from offload_core import enable_offload
    handle = enable_offload(transformer, target_device="cuda", offload_granularity="block")
    image = pipe(prompt).images[0]
    print(handle.stats())
    handle.remove()

    handle = enable_offload(meta_model, weights="FLUX.1-dev/transformer")   # read straight into the arena
    handle = enable_offload(meta_model, lazy_load=True, shard_dir="shards", max_memory="6GiB")  # from disk
    offload = enable_pipeline_offload(pipe, target_device="cuda")          # every component of a pipeline
"""

from __future__ import annotations

from .api import OffloadHandle, enable_offload
from .compiled import compile_blocks
from .config import Granularity, OffloadConfig, parse_bytes
from .errors import (
    AlreadyOffloadedError,
    CheckpointMismatchError,
    DeviceUnavailableError,
    FrozenWeightError,
    OffloadedCopyError,
    OffloadedEditError,
    LossyStorageWarning,
    NotAModuleError,
    OffloadConfigError,
    OffloadError,
    OptimizerMismatchError,
    OptimizerOverlapError,
    ShardError,
    VramBudgetError,
    LayerOrderError,
)
from .pipeline import PipelineOffload, enable_pipeline_offload
from .hoststore import HostStore
from .training import OffloadTrainingManager

__all__ = [
    "AlreadyOffloadedError",
    "CheckpointMismatchError",
    "DeviceUnavailableError",
    "FrozenWeightError",
    "OffloadedCopyError",
    "OffloadedEditError",
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
    "PipelineOffload",
    "ShardError",
    "VramBudgetError",
    "LayerOrderError",
    "compile_blocks",
    "enable_offload",
    "enable_pipeline_offload",
    "parse_bytes",
]
