"""Training: OffloadTrainingManager and optimizer offload.

The manager is the DiffSynth-Studio-compatible face of the same engine enable_offload uses:

    manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True)
    loss.backward(); manager.after_backward(); optimizer.step(); optimizer.zero_grad()

The optimizer is found at its first step (or passed as ``optimizer=``).

Frozen weights stream in the forward pass, the checkpoint recompute and the backward pass;
trainable parameters stay resident unless optimizer offload is on (see optim_offload.py).

"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from .api import OffloadHandle, enable_offload
from .config import OffloadConfig
from .errors import OptimizerMismatchError

__all__ = ["OffloadTrainingManager"]


class OffloadTrainingManager:
    """DiffSynth-Studio-compatible training offload, built on the same engine as enable_offload."""

    def __init__(
        self,
        model: nn.Module,
        target_device: str | torch.device = "cuda",
        enable_optimizer_cpu_offload: bool = False,
        cpu_offload_split_threshold: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: OffloadConfig | dict | None = None,
        **overrides: Any,
    ) -> None:
        # DiffSynth-Studio's argument names are OffloadConfig keys under other names. Left at their
        # defaults they leave `config` as it is; set, they win over it as any override does.
        named = {"target_device": None if str(target_device) == "cuda" and config is not None else str(target_device),
                 "enable_optimizer_cpu_offload": enable_optimizer_cpu_offload or None,
                 "split_threshold_mb": cpu_offload_split_threshold}
        for key, value in named.items():
            if value is not None:
                overrides.setdefault(key, value)
        cfg = OffloadConfig.from_overrides(config, **overrides)
        if cfg.treat_as_inference is None:  # training: trainable parameters get gradients, never streamed as frozen
            cfg.treat_as_inference = False
        if optimizer is not None:
            # Checked before the engine touches the model, so a mismatch leaves it intact.
            _check_optimizer(model, optimizer)
        self.model = model
        self.handle: OffloadHandle = enable_offload(model, cfg, optimizer=optimizer)
        self.engine = self.handle.engine

    def after_backward(self) -> None:
        """Call after loss.backward() and before optimizer.step()."""
        if self.handle.trainer is not None:
            self.handle.trainer.after_backward()

    def accumulate(self, micro_batches: Iterable[Any], loss_fn: Callable[[Any], Any],
                   order: str | None = None) -> list[Any]:
        """One optimizer step's micro-batches, forward and backward (OffloadHandle.accumulate)."""
        return self.handle.accumulate(micro_batches, loss_fn, order)

    @property
    def planning(self) -> bool:
        """The engine is still measuring and choosing its plan (OffloadHandle.planning)."""
        return self.handle.planning

    def release_growth(self) -> int:
        """The ring's grown slots back to torch's allocator until the next step (OffloadHandle.release_growth)."""
        return self.handle.release_growth()

    def stats(self) -> dict[str, Any]:
        return self.handle.stats()

    def remove(self) -> None:
        trainer = self.handle.trainer
        self.handle.remove()
        if trainer is not None:
            for it in trainer.items:
                it.param.grad = getattr(it.param, "_offload_grad", None)
                if hasattr(it.param, "_offload_grad"):
                    del it.param._offload_grad


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for n, p in model.named_parameters():
        if p.requires_grad and id(p) not in in_opt:
            raise OptimizerMismatchError(f"optimizer: trainable parameter {n!r} is not in the optimizer passed to the manager")
