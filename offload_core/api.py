"""enable_offload and OffloadHandle: the diffusers-style entry point to the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

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

    def release_growth(self) -> int:
        """Between calls: give the device memory the ring grew into (the slots past its first plan)
        back to torch's allocator, for what runs next in this process (a pipeline's VAE decode); the
        model's next call takes it again. Returns the bytes given back.

        >>> latents = pipe(prompt, output_type="latent").images
        >>> handle.release_growth()
        >>> pixels = pipe.vae.decode(latents / pipe.vae.config.scaling_factor).sample"""
        return self.engine.release_growth()

    def stats(self) -> dict[str, Any]:
        """The engine's record (stats.EngineStats) as a plain dict, with optimizer offload's keys."""
        record = self.engine.stats()
        if self.trainer is not None:
            record.optimizer_stats = self.trainer.stats()
        return record.as_dict()

    def reset_stats(self) -> None:
        self.engine.reset_stats()

    def accumulate(self, micro_batches: Iterable[Any], loss_fn: Callable[[Any], Any],
                   order: str | None = None) -> list[Any]:
        """One optimizer step's forwards and backwards: ``loss_fn(batch)`` returns a micro-batch's loss
        (scaled by 1/K as a plain loop would), and its gradients land in ``.grad`` as K
        ``loss.backward()`` calls would put them, bitwise. ``order`` (default the config's
        ``accumulation_order``): "micro" is that plain loop; "layer" runs all K through each unit
        before the next, so the weights cross the link once for the K (lockstep.py).

        >>> losses = handle.accumulate(batches, lambda b: F.mse_loss(model(b.x), b.y) / len(batches))
        >>> optimizer.step(); optimizer.zero_grad()

        Returns what ``loss_fn`` returned for each batch, detached."""
        from .lockstep import accumulate

        return accumulate(self.engine, micro_batches, loss_fn, order)

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
