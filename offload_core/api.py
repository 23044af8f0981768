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
        e = self.engine
        c = e.counters
        out: dict[str, Any] = {}
        if e.is_cuda:
            dev = e.device
            out["vram_allocated_bytes"] = torch.cuda.memory_allocated(dev)
            out["vram_reserved_bytes"] = torch.cuda.memory_reserved(dev)
            out["vram_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
        else:
            out["vram_allocated_bytes"] = out["vram_reserved_bytes"] = out["vram_peak_bytes"] = 0
        streamed = sum(u.nbytes for u in e.streamed if u.uid not in e.ring.sticky)
        sticky = sum(u.nbytes for u in e.streamed if u.uid in e.ring.sticky)
        resident = sticky + sum(t.nbytes for u in e.units if not u.streamed for t in u.tensors)
        resident += sum(
            (m._parameters if p else m._buffers)[a].numel() * (m._parameters if p else m._buffers)[a].element_size()
            for m, a, p in e.plan.resident
            if (m._parameters if p else m._buffers).get(a) is not None
        )
        out.update(
            pinned=e.store.pinned,
            pinned_capacity_bytes=e.store.capacity_bytes,
            pinned_used_bytes=e.store.used_bytes,
            weight_bytes=streamed + resident,
            streamed_bytes=streamed,
            resident_bytes=resident,
            sticky_bytes=sticky,
            sticky_units=len(e.ring.sticky),
            slot_count=len(e.ring.slots),
            slot_bytes=e.ring.slot_bytes,
            slot_grows=e.ring.grows,
            prefetch_depth=e.schedule.depth,
            staging_bytes=e.widener.staging_bytes,  # fp8/bf16 storage: raw copies widened into slots
            h2d_bytes=c.h2d_bytes,
            h2d_count=c.h2d_count,
            d2h_bytes=c.d2h_bytes,
            d2h_count=c.d2h_count,
            cache_hits=c.cache_hits,
            cache_misses=c.cache_misses,
            cache_evictions=c.cache_evictions,
            prefetch_issued=c.prefetch_issued,
            prefetch_misses=c.prefetch_misses,
            saved_refs=c.saved_refs,
            refetches=c.refetches,
            steps=c.steps,
            planning=e.replanner.active,
            trace_length=len(e.schedule.trace),
            trace_relearned=e.schedule.relearned,
            setup_seconds=e.setup_seconds,
            num_units=len(e.units),
            units=[{"name": u.name, "bytes": u.nbytes, "streamed": u.streamed and u.uid not in e.ring.sticky,
                    "sticky": u.uid in e.ring.sticky,
                    "stray": u.stray} for u in e.units],
            plan=dict(e.prediction),
        )
        out.update(e.store.stats())
        h2d_ms = stall_ms = compute_ms = timed_h2d_ms = 0.0
        # Once the plan is settled one step in timing_every is timed, its readings weighted by the
        # steps they stand for (stats.TimingLog): the totals are estimates over every step up to the
        # last timed one, and the copy rate is the timed bytes over the timed copies' ms.
        out["timed_steps"] = c.timed_steps
        if e.timing is not None:
            e.timing.resolve(block=True)
            timed_h2d_ms = e.timing.timed_ms.get("h2d", 0.0)
            h2d_ms = e.timing.total_ms.get("h2d", 0.0)
            stall_ms = e.timing.total_ms.get("stall", 0.0)
            # compute: the spans within a cycle (a use to the next), each counted for the unit used first
            compute_ms = e.timing.total_ms.get("compute", 0.0)
            for info, u in zip(out["units"], e.units):
                info.update({f"{k}_ms": v for k, v in e.timing.per_unit_ms.get(u.uid, {}).items()})
        if e.timing is not None and e.timing.counts.get("cycle"):
            # A cycle is root forward to root forward: a training step, or one inference call.
            out["measured_step_ms"] = e.timing.total_ms["cycle"] / e.timing.counts["cycle"]
            out["predicted_step_ms"] = self._predict()
        out["h2d_ms"] = h2d_ms
        out["timed_h2d_ms"] = timed_h2d_ms  # what the timed copies' events read, unweighted
        out["stall_ms"] = stall_ms
        out["compute_ms"] = compute_ms
        out["h2d_gbps"] = (c.timed_h2d_bytes / 1e9) / (timed_h2d_ms / 1e3) if timed_h2d_ms > 0 else 0.0
        if self.trainer is not None:
            out.update(self.trainer.stats())
        return out

    def _predict(self) -> float | None:
        """The planner's model of one cycle, from measured busy times per use and copy times."""
        return self.engine.predict()

    def reset_stats(self) -> None:
        e = self.engine
        e.counters.__init__()
        if e.timing is not None:
            e.timing.resolve(block=True)
            e.timing.reset()
        if e.is_cuda:
            torch.cuda.reset_peak_memory_stats(e.device)

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
