"""enable_offload and OffloadHandle: the diffusers-style entry point to the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .config import OffloadConfig
from .engine import OffloadEngine
from .errors import NotAModuleError

if TYPE_CHECKING:
    from .optim_offload import OptimizerOffload

__all__ = ["OffloadHandle", "enable_offload"]


class OffloadHandle:
    """What enable_offload returns: read ``stats()``, and ``remove()`` to restore the model."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.engine = engine
        self.trainer: OptimizerOffload | None = None  # set by the training manager when optimizer offload is on

    @property
    def config(self) -> OffloadConfig:
        return self.engine.config

    @property
    def planning(self) -> bool:
        """The engine is still measuring its first cycles and choosing its plan (ring depth, sticky
        units, growth into free memory): until this turns False, step times are not yet its own."""
        return self.engine.replanner.active

    def stats(self) -> dict[str, Any]:
        """The engine's record (stats.EngineStats) as a plain dict, with optimizer offload's keys."""
        record = self.engine.stats()
        if self.trainer is not None:
            record.optimizer_stats = self.trainer.stats()
        return record.as_dict()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def remove(self) -> None:
        if self.trainer is not None:
            self.trainer.remove()
        self.engine.remove()


def enable_offload(model: nn.Module, config: OffloadConfig | dict | None = None, *,
                   optimizer: torch.optim.Optimizer | None = None, **overrides: Any) -> OffloadHandle:
    """Stream model's weights from host memory to ``target_device`` as the model runs.

    >>> handle = enable_offload(transformer, target_device="cuda", offload_granularity="block")
    >>> out = transformer(**inputs)
    >>> handle.stats()["h2d_bytes"]

    ``optimizer`` (with ``enable_optimizer_cpu_offload``) is the optimizer of the streamed trainable
    parameters; without it the engine finds it at its first ``step()``.
    """
    if not isinstance(model, nn.Module):
        raise NotAModuleError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    cfg = OffloadConfig.from_overrides(config, **overrides)
    stream_trainable = cfg.enable_optimizer_cpu_offload
    handle = OffloadHandle(OffloadEngine(model, cfg, stream_trainable=stream_trainable))
    if cfg.enable_optimizer_cpu_offload:
        from .optim_offload import OptimizerOffload

        handle.trainer = OptimizerOffload(handle.engine, optimizer=optimizer)
    return handle
