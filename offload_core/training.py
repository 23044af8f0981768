"""Training: OffloadTrainingManager and optimizer offload.

The manager is the DiffSynth-Studio-compatible face of the same engine enable_offload uses:

    manager = OffloadTrainingManager(model, "cuda", enable_optimizer_cpu_offload=True)
    loss.backward(); manager.after_backward(); optimizer.step(); optimizer.zero_grad()

With optimizer offload, trainable parameters are streamed like frozen ones. Their fp32 master
lives on the host (the arena slab itself for fp32 parameters), each gradient is copied to the host
on a side stream as soon as autograd has accumulated it, and ``after_backward`` points every
parameter's ``.data`` and ``.grad`` at host tensors so an ordinary torch optimizer steps on the CPU.
Gradients of several backward passes add up on the host, so gradient accumulation works.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .api import OffloadHandle, enable_offload
from .arena import pinned_empty, unregister
from .config import OffloadConfig
from .engine import OffloadEngine
from .errors import OptimizerMismatchError

__all__ = ["OffloadTrainingManager", "OptimizerOffload"]


class _Trainable:
    __slots__ = ("param", "unit", "index", "master", "staging", "acc", "has_grad", "hook", "name")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class OptimizerOffload:
    """Host masters and host gradients for the streamed trainable parameters of one engine."""

    def __init__(self, engine: OffloadEngine, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.engine = engine
        names = {id(p): n for n, p in engine.model.named_parameters(remove_duplicate=False)}
        self.items: list[_Trainable] = []
        total = 0
        for u in engine.streamed:
            for i, ts in enumerate(u.tensors):
                if ts.is_param and ts.tensor().requires_grad:
                    total += ts.nbytes
                    self.items.append(_Trainable(param=ts.tensor(), unit=u, index=i, name=names.get(id(ts.tensor()), ts.attr)))
        self._staging_buf, self._pinned = pinned_empty(total, pin=engine.is_cuda)
        off = 0
        for it in self.items:
            ts = it.unit.tensors[it.index]
            arena_view = engine.arena.view(it.unit, it.index)
            it.master = arena_view if ts.dtype == torch.float32 else arena_view.float()
            it.staging = self._staging_buf[off: off + ts.nbytes].view(ts.dtype).view(ts.shape)
            off += ts.nbytes
            it.acc = torch.empty(ts.shape, dtype=torch.float32)
            it.has_grad = False
            it.hook = it.param.register_post_accumulate_grad_hook(self._make_grad_hook(it))
        self._pending: list[tuple[_Trainable, Any]] = []
        self._on_host = False
        engine._cycle_callbacks.append(self._take_back)

    def _make_grad_hook(self, it: _Trainable):
        engine = self.engine

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            if engine.use_streams:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(engine.device))
                engine.d2h_stream.wait_event(ev)
                with torch.cuda.stream(engine.d2h_stream):
                    it.staging.copy_(g, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(engine.d2h_stream)
                g.record_stream(engine.d2h_stream)
            else:
                it.staging.copy_(g)
                done = None
            p.grad = None
            self._pending.append((it, done))
            engine.counters.d2h_bytes += g.numel() * g.element_size()
            engine.counters.d2h_count += 1

        return hook

    def _drain(self) -> None:
        for it, done in self._pending:
            if done is not None:
                done.synchronize()
            if it.has_grad:
                it.acc.add_(it.staging)
            else:
                it.acc.copy_(it.staging)
                it.has_grad = True
        self._pending.clear()

    def _take_back(self) -> None:
        """At the start of a forward: collect what the optimizer did, and stream the params again."""
        self._drain()
        if not self._on_host:
            return
        for it in self.items:
            p = it.param
            g = p.grad
            if g is None:
                it.has_grad = False
            elif g is not it.acc:
                it.acc.copy_(g)
                it.has_grad = True
            p.grad = None
            if it.master is not self.engine.arena.view(it.unit, it.index):
                self.engine.arena.view(it.unit, it.index).copy_(it.master)
            ts = it.unit.tensors[it.index]
            p.data = self.engine._trainable_placeholder(ts.dtype, ts.shape)
        # The host masters changed: cached device copies of these units are stale.
        for u in {id(it.unit): it.unit for it in self.items}.values():
            slot = self.engine.ring.lookup(u.uid)
            if slot is not None and slot.is_free():
                self.engine.ring.by_owner.pop(u.uid, None)
                slot.owner = None
        self._on_host = False

    def after_backward(self) -> None:
        self._drain()
        for it in self.items:
            it.param.data = it.master
            it.param.grad = it.acc if it.has_grad else None
        self._on_host = True

    def stats(self) -> dict[str, Any]:
        return {
            "optimizer_offload": True,
            "trainable_streamed_params": len(self.items),
            "grad_staging_bytes": int(self._staging_buf.numel()),
            "grad_staging_pinned": self._pinned,
        }

    def remove(self) -> None:
        self._drain()
        for it in self.items:
            it.hook.remove()
            if it.master is not self.engine.arena.view(it.unit, it.index):
                self.engine.arena.view(it.unit, it.index).copy_(it.master)
            grad = it.acc.clone() if it.has_grad else None
            it.param.grad = None
            it.param._offload_grad = grad  # restored below, once the data has its shape back
        self.engine._cycle_callbacks.remove(self._take_back)
        if self._pinned:
            unregister(self._staging_buf)


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
        overrides.setdefault("target_device", str(target_device))
        overrides.setdefault("enable_optimizer_cpu_offload", enable_optimizer_cpu_offload)
        if cpu_offload_split_threshold is not None:
            overrides.setdefault("split_threshold_mb", cpu_offload_split_threshold)
        cfg = OffloadConfig.from_overrides(config, **overrides)
        if optimizer is not None:
            # Checked before the engine touches the model, so a mismatch leaves it intact.
            _check_optimizer(model, optimizer)
            cfg.extra["optimizer"] = optimizer
        self.model = model
        self.handle: OffloadHandle = enable_offload(model, cfg)
        self.engine = self.handle.engine

    def after_backward(self) -> None:
        """Call after loss.backward() and before optimizer.step()."""
        if self.handle.trainer is not None:
            self.handle.trainer.after_backward()

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
