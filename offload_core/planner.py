"""Planner: which units stay on the device, and what step time to expect.

Three kinds of residency:

- **strays** (block and phase granularity): the small tensors outside the block lists (embedders,
  final norm, projection) stay resident when together they are at most ``stray_resident_fraction``
  of the streamed bytes. Streamed, each would take a whole ring slot for a sub-millisecond copy, and
  at the turn from one forward to the next they push the first block's copy back.
- ``offload_ratio``: stream that fraction of the units; the rest are *sticky*, spread through the
  forward order (every k-th unit, ending on the last one).
- ``vram_budget``: a first plan by bytes (the same interleaving), then, once one traced cycle has
  been timed, :func:`choose` spends the budget on sticky units and extra ring slots (which keep the
  forward/backward turnaround units), picking at each step the choice that shortens the simulated
  cycle most per byte.

A sticky unit is packed in the host arena like any other and loaded once into a device buffer of
its own, so the plan can change while the model runs.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Sequence

from .config import OffloadConfig
from .units import Unit

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["plan_residency", "interleaved", "simulate", "choose", "measured_model", "measured_prediction",
           "replan_from_measurements"]


def interleaved(n: int, k: int) -> list[int]:
    """k indices out of range(n), evenly spread and including the last one."""
    if k <= 0:
        return []
    if k >= n:
        return list(range(n))
    step = n / k
    return sorted({n - 1 - int(math.floor(i * step)) for i in range(k)})


def ring_slots(config: OffloadConfig) -> int:
    return max(config.prefetch + 1, 2)


def plan_residency(units: list[Unit], config: OffloadConfig) -> dict:
    """Mark resident units (``streamed = False``) and sticky ones; returns the plan's numbers."""
    candidates = [u for u in units if u.streamed]
    keep: list[int] = []
    strays_resident = 0
    if not config.cpu_offload:
        for u in candidates:
            u.streamed = False
        candidates = []
    else:
        strays = [u for u in candidates if u.stray and not u.trainable]
        stray_bytes = sum(u.nbytes for u in strays)
        total = sum(u.nbytes for u in candidates)
        if strays and stray_bytes <= config.stray_resident_fraction * total and len(strays) < len(candidates):
            if config.vram_budget is None or stray_bytes < config.vram_budget:
                for u in strays:
                    u.streamed = False
                strays_resident = stray_bytes
                candidates = [u for u in candidates if u.streamed]
    stickable = [u for u in candidates if not u.trainable]
    if config.offload_ratio is not None:
        n_stream = int(round(config.offload_ratio * len(stickable)))
        keep = interleaved(len(stickable), len(stickable) - n_stream)
    elif config.vram_budget is not None:
        # The ring needs its slots of the largest streamed unit; what is left holds sticky units.
        budget = config.vram_budget - strays_resident
        for k in range(len(stickable), -1, -1):
            chosen = set(interleaved(len(stickable), k))
            streamed = [u for i, u in enumerate(stickable) if i not in chosen] + [u for u in candidates if u.trainable]
            slot = max((u.nbytes for u in streamed), default=0)
            need = sum(stickable[i].nbytes for i in chosen) + slot * (ring_slots(config) if streamed else 0)
            if need <= budget:
                keep = sorted(chosen)
                break
    for i in keep:
        stickable[i].sticky = True
    moving = sum(u.nbytes for u in candidates if not u.sticky)
    return {
        "resident_units": sum(1 for u in units if not u.streamed),
        "sticky_units": len(keep),
        "streamed_units": len(candidates) - len(keep),
        "streamed_bytes": moving,
        "sticky_bytes": sum(u.nbytes for u in candidates if u.sticky),
        "stray_resident_bytes": strays_resident,
        "extra_slots": 0,
        "chosen_by": "bytes" if keep or config.vram_budget is not None else "none",
    }


def simulate(
    trace: Sequence[int],
    compute: Sequence[float] | dict[int, float],
    copy: dict[int, float],
    slots: int,
    prefetch: int,
    sticky: set[int] | frozenset[int] = frozenset(),
    cycles: int = 2,
) -> float:
    """Predicted time of one steady cycle of the trace, in ms.

    Mirrors the engine: one copy engine, one compute stream, ``slots`` ring buffers reused least
    recently used first (never one the next ``prefetch + 1`` uses need), a synchronous load on a
    miss, and ``prefetch`` units fetched ahead once each use begins. A unit's copy starts when the
    copy engine is free and the compute stream has reached the use that issued it. ``compute`` is
    the busy time from each use of the trace to the next (a list by position), or per unit.
    ``copy`` holds each streamed unit's copy time; units missing from it (resident) and ``sticky``
    ones are always ready. Runs ``cycles`` cycles and returns the last one, so the turnaround from
    one cycle to the next (wrap-around prefetch, cache hits) is counted.
    """
    n = len(trace)
    if n == 0:
        return 0.0
    by_pos = not isinstance(compute, dict)
    owner: list[int | None] = [None] * max(slots, 1)
    last: list[int] = [-1] * len(owner)
    where: dict[int, int] = {}
    ready: dict[int, float] = {}
    copy_free = comp_end = 0.0
    cycle_start = 0.0

    def streamed(uid: int) -> bool:
        return uid in copy and uid not in sticky

    def window(p: int, k: int) -> list[int]:
        out: list[int] = []
        for q in range(p + 1, p + 1 + k):
            u = trace[q % n]
            if u not in out:
                out.append(u)
        return out

    def load(uid: int, keep: set[int], gate: float, urgent: bool) -> bool:
        nonlocal copy_free
        best = None
        for s, o in enumerate(owner):
            if o is not None and o in keep:
                continue
            if o is None:
                best = s
                break
            if best is None or last[s] < last[best]:
                best = s
        if best is None:
            if not urgent:
                return False
            owner.append(None)
            last.append(-1)
            best = len(owner) - 1
        if owner[best] is not None:
            where.pop(owner[best], None)
        owner[best] = uid
        where[uid] = best
        start = max(copy_free, gate)
        copy_free = start + copy[uid]
        ready[uid] = copy_free
        return True

    for p in range(cycles * n):
        if p % n == 0:
            cycle_start = comp_end
        uid = trace[p % n]
        if streamed(uid):
            if uid not in where:
                load(uid, set(window(p, prefetch + 1)) | {uid}, comp_end, urgent=True)
            last[where[uid]] = p
            begin = max(comp_end, ready[uid])
        else:
            begin = comp_end
        comp_end = begin + (compute[p % n] if by_pos else compute.get(uid, 0.0))  # type: ignore[union-attr,index]
        if prefetch > 0:
            keep = set(window(p, prefetch + 1)) | {uid}
            for v in window(p, prefetch):
                if streamed(v) and v not in where and not load(v, keep, begin, urgent=False):
                    break
    return comp_end - cycle_start


def choose(
    trace: Sequence[int],
    compute: Sequence[float],
    copy: dict[int, float],
    nbytes: dict[int, int],
    *,
    slot_bytes: int,
    slots: int,
    prefetch: int,
    budget: int,
    forced: set[int] | frozenset[int] = frozenset(),
    candidates: set[int] | None = None,
    max_candidates: int = 64,
    time_limit_s: float = 3.0,
) -> dict:
    """Spend ``budget`` bytes on sticky units and extra ring slots, greedily by simulated gain per byte.

    ``copy`` holds every streamed unit (sticky ones included); ``forced`` units must stay sticky
    (bigger than a ring slot); only ``candidates`` (default: all) may become sticky. The ring's
    ``slots`` are already paid for out of the budget.
    """
    t0 = time.perf_counter()
    sticky = set(forced)
    used = slots * slot_bytes + sum(nbytes[u] for u in sticky)
    extra = 0
    best = simulate(trace, compute, copy, slots, prefetch, sticky)
    start_ms = best
    pool = [u for u in copy if u not in sticky and (candidates is None or u in candidates)]
    if len(pool) > max_candidates:
        pool = sorted(pool, key=lambda u: copy[u], reverse=True)[:max_candidates]
    while time.perf_counter() - t0 < time_limit_s:
        options: list[tuple[float, str, int | None, float]] = []
        if used + slot_bytes <= budget:
            t = simulate(trace, compute, copy, slots + extra + 1, prefetch, sticky)
            options.append(((best - t) / slot_bytes, "slot", None, t))
        for u in pool:
            if u in sticky or used + nbytes[u] > budget:
                continue
            t = simulate(trace, compute, copy, slots + extra, prefetch, sticky | {u})
            options.append(((best - t) / max(nbytes[u], 1), "unit", u, t))
        options = [o for o in options if best - o[3] > 1e-3 * max(best, 1e-9)]
        if not options:
            break
        _, kind, u, t = max(options, key=lambda o: o[0])
        if kind == "slot":
            extra += 1
            used += slot_bytes
        else:
            sticky.add(u)  # type: ignore[arg-type]
            used += nbytes[u]  # type: ignore[index]
        best = t
    return {"sticky": sticky, "extra_slots": extra, "predicted_ms": best, "start_ms": start_ms,
            "used_bytes": used, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- from a running engine's timings
def measured_model(e: "OffloadEngine") -> tuple[list[int], list[float], dict[int, float]] | None:
    """The traced cycle, each position's busy time and each streamed unit's copy time, in ms.

    A position's busy time runs from its unit's use starting (bytes ready) to the next use being
    asked for, so backward kernels, recompute and the optimizer step between cycles count too.
    """
    if e.timing is None or not e.schedule.trace:
        return None
    e.timing.resolve(block=True)
    h2d_ms = e.timing.total_ms.get("h2d", 0.0)
    if h2d_ms <= 0 or e.counters.h2d_bytes <= 0:
        return None
    per_ms = e.counters.h2d_bytes / h2d_ms
    trace = list(e.schedule.trace)
    spans = [e.timing.last_ms.get(("span", ("pos", i)), 0.0) for i in range(len(trace))]
    copy = {u.uid: u.store_nbytes / per_ms for u in e.streamed}
    return trace, spans, copy


def measured_prediction(e: "OffloadEngine") -> float | None:
    model = measured_model(e)
    if model is None:
        return None
    trace, spans, copy = model
    return simulate(trace, spans, copy, len(e.ring.slots), e.config.prefetch, set(e.ring.sticky))


def replan_from_measurements(e: "OffloadEngine") -> dict | None:
    """vram_budget: choose sticky units and extra ring slots from the measured cycle, and apply them."""
    model = measured_model(e)
    if model is None or e.ring.slot_bytes <= 1 or e.config.vram_budget is None:
        return None
    trace, spans, copy = model
    budget = int(e.config.vram_budget) - int(e.prediction.get("stray_resident_bytes", 0))
    forced = {uid for uid in e.ring.sticky if e.units[uid].nbytes > e.ring.slot_bytes}
    candidates = {u.uid for u in e.streamed if not u.trainable}
    res = choose(trace, spans, copy, {u.uid: u.nbytes for u in e.streamed}, slot_bytes=e.ring.slot_bytes,
                 slots=len(e.ring.slots), prefetch=e.config.prefetch, budget=budget, forced=forced,
                 candidates=candidates)
    for uid in list(e.ring.sticky):
        if uid not in res["sticky"]:
            e.ring.drop_sticky(uid)
            e.units[uid].sticky = False
    for uid in sorted(res["sticky"]):
        if uid not in e.ring.sticky:
            e.units[uid].sticky = True
            e.ring.add_sticky(uid, e.units[uid].nbytes)
    e.ring.add_slots(res["extra_slots"])
    moving = [u for u in e.streamed if not u.sticky]
    e.prediction.update(
        chosen_by="measured",
        sticky_units=len(res["sticky"]),
        streamed_units=len(moving),
        streamed_bytes=sum(u.nbytes for u in moving),
        sticky_bytes=sum(e.units[uid].nbytes for uid in res["sticky"]),
        extra_slots=res["extra_slots"],
        planned_step_ms=res["predicted_ms"],
        unplanned_step_ms=res["start_ms"],
        plan_seconds=res["seconds"],
    )
    return res
