"""Planner: which units stay on the device, how deep the ring runs, and what step time to expect.

Pure functions of measurements: the engine gathers numbers (``Measurements``), asks, and applies
the plan it gets back. Nothing here imports or touches the engine.

- **strays** (block and phase granularity): the small tensors outside the block lists (embedders,
  final norm, projection) stay resident when together they are at most ``stray_resident_fraction``
  of the streamed bytes. Streamed, each would take a whole ring slot for a sub-millisecond copy, and
  at the turn from one forward to the next they push the first block's copy back.
- ``offload_ratio``: stream that fraction of the units; the rest are *sticky*, spread through the
  forward order (every k-th unit, ending on the last one).
- ``vram_budget``: the first traced cycles run on the smallest ring, which measures what the rest
  of the process takes at its peak (activations, gradients, optimizer state, other tensors). Then
  :func:`plan_budget` spends what is left of the budget on sticky units and extra ring slots (which
  keep the forward/backward turnaround units), picking at each step the choice that shortens the
  simulated cycle most per byte. A budget that cannot hold the smallest ring raises.
- no budget, on a card: :func:`plan_growth` deepens the ring into the memory the card has free for
  this process (a per-process memory fraction counts), keeping a margin, as long as the simulated
  stall falls; the engine then keeps it only if the measured stall did not rise (replan.py).

A sticky unit is packed in the host store like any other and loaded once into a device buffer of
its own, so the plan can change while the model runs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from .errors import VramBudgetError
from .units import Unit

__all__ = ["Measurements", "Plan", "RingPlan", "Residency", "budget_room", "choose", "growth_room", "initial_depth", "interleaved",
           "plan_budget", "plan_growth", "plan_residency", "ring_slots", "simulate"]

DEFAULT_DEPTH = 2
GiB = float(1 << 30)


def initial_depth(prefetch: int | None, vram_budget: int | None) -> int:
    """The prefetch depth the first cycles run at: a pinned one as given; under a ``vram_budget`` with
    the depth left to the planner, the smallest ring (two slots), so the measured cycles that decide
    how the budget is spent never hold more than the least the model can run with; else the default."""
    if prefetch is not None:
        return prefetch
    return 1 if vram_budget is not None else DEFAULT_DEPTH


def interleaved(n: int, k: int) -> list[int]:
    """k indices out of range(n), evenly spread and including the last one."""
    if k <= 0:
        return []
    if k >= n:
        return list(range(n))
    step = n / k
    return sorted({n - 1 - int(math.floor(i * step)) for i in range(k)})


def ring_slots(depth: int, units: int | None = None) -> int:
    """Slots a prefetch depth needs: the unit in use and ``depth`` ahead (two at the least), and
    never more than the ``units`` that move (each then has a slot of its own)."""
    n = max(depth + 1, 2)
    return n if units is None else max(min(n, units), 1 if units else 0)


# ---------------------------------------------------------------- the first plan, from sizes
@dataclass(frozen=True)
class Residency:
    resident: frozenset[int]  # units moved to the device once (strays, or everything without cpu_offload)
    sticky: frozenset[int]    # streamed units kept in a device buffer of their own
    info: dict = field(default_factory=dict)


def plan_residency(units: Sequence[Unit], *, cpu_offload: bool, stray_resident_fraction: float,
                   offload_ratio: float | None, vram_budget: int | None, depth: int) -> Residency:
    """Which of the candidate units (``u.streamed``) stay resident or sticky, from their sizes alone."""
    candidates = [u for u in units if u.streamed]
    resident: set[int] = set()
    strays_resident = 0
    if not cpu_offload:
        resident = {u.uid for u in candidates}
        candidates = []
    else:
        strays = [u for u in candidates if u.stray and not u.trainable]
        stray_bytes = sum(u.nbytes for u in strays)
        total = sum(u.nbytes for u in candidates)
        rest = [u for u in candidates if not (u.stray and not u.trainable)]
        ring = ring_slots(depth, len(rest)) * max((u.nbytes for u in rest), default=0)
        if strays and stray_bytes <= stray_resident_fraction * total and len(strays) < len(candidates):
            if vram_budget is None or stray_bytes + ring <= vram_budget:
                resident = {u.uid for u in strays}
                strays_resident = stray_bytes
                candidates = rest
    stickable = [u for u in candidates if not u.trainable]
    keep: list[int] = []
    if offload_ratio is not None:
        n_stream = int(round(offload_ratio * len(stickable)))
        keep = interleaved(len(stickable), len(stickable) - n_stream)
    if vram_budget is not None and candidates:
        # The smallest ring must fit before anything is measured; the rest waits for measurements.
        slots = ring_slots(depth, len(candidates))
        ring = slots * max(u.nbytes for u in candidates)
        if strays_resident + ring > vram_budget:
            raise VramBudgetError(
                f"vram_budget: {_gib(vram_budget)} cannot hold the smallest ring ({slots} slots of "
                f"{_gib(ring // slots)}, the largest streamed unit){_plus(strays_resident, 'resident strays')}; "
                f"raise it to at least {_gib(strays_resident + ring)} plus the activations, or split the units "
                "(offload_granularity='leaf' or cpu_offload_split_threshold)")
    sticky = frozenset(stickable[i].uid for i in keep)
    moving = sum(u.nbytes for u in candidates if u.uid not in sticky)
    info = {
        "resident_units": len(resident) + sum(1 for u in units if not u.streamed),
        "sticky_units": len(sticky),
        "streamed_units": len(candidates) - len(sticky),
        "streamed_bytes": moving,
        "sticky_bytes": sum(u.nbytes for u in candidates if u.uid in sticky),
        "stray_resident_bytes": strays_resident,
        "extra_slots": 0,
        "chosen_by": "bytes" if sticky else ("smallest ring" if vram_budget is not None else "none"),
    }
    return Residency(frozenset(resident), sticky, info)


# ---------------------------------------------------------------- the ring, simulated
def simulate(
    trace: Sequence[int],
    compute: Sequence[float] | dict[int, float],
    copy: dict[int, float],
    slots: int,
    prefetch: int,
    sticky: set[int] | frozenset[int] = frozenset(),
    cycles: int = 2,
    stale: set[int] | frozenset[int] = frozenset(),
) -> float:
    """Predicted time of one steady cycle of the trace, in ms.

    Mirrors the engine: one copy engine, one compute stream, ``slots`` ring buffers reused least
    recently used first (never one the next ``prefetch + 1`` uses need), a synchronous load on a
    miss, and ``prefetch`` units fetched ahead once each use begins. A unit's copy starts when the
    copy engine is free and the compute stream has reached the use that issued it. ``compute`` is
    the busy time from each use of the trace to the next (a list by position), or per unit.
    ``copy`` holds each streamed unit's copy time; units missing from it (resident) and ``sticky``
    ones are always ready. Runs ``cycles`` cycles and returns the last one, so the turnaround from
    one cycle to the next (wrap-around prefetch, cache hits) is counted. ``stale`` units lose their
    device copy at every cycle start (streamed trainable parameters, which the optimizer changes).
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
            for s, o in enumerate(owner):
                if o in stale:
                    where.pop(o, None)
                    owner[s] = None
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
    candidates: set[int] | frozenset[int] | None = None,
    grow_depth: bool = False,
    stale: set[int] | frozenset[int] = frozenset(),
    max_candidates: int = 64,
    time_limit_s: float = 3.0,
) -> dict:
    """Spend ``budget`` bytes on sticky units and extra ring slots, greedily by simulated gain per byte.

    ``copy`` holds every streamed unit (sticky ones included); ``forced`` units must stay sticky
    (bigger than a ring slot); only ``candidates`` (default: all) may become sticky. The ring's
    ``slots`` are already paid for out of the budget. With ``grow_depth`` every extra slot also
    deepens the prefetch (depth = slots - 1), so the lookahead reaches the units the slots keep.
    """
    t0 = time.perf_counter()
    sticky = set(forced)
    used = slots * slot_bytes + sum(nbytes[u] for u in sticky)
    extra = 0

    def depth(k: int) -> int:
        return max(prefetch, slots + k - 1) if grow_depth else prefetch

    best = simulate(trace, compute, copy, slots, depth(0), sticky, stale=stale)
    start_ms = best
    pool = [u for u in copy if u not in sticky and (candidates is None or u in candidates)]
    if len(pool) > max_candidates:
        pool = sorted(pool, key=lambda u: copy[u], reverse=True)[:max_candidates]
    while time.perf_counter() - t0 < time_limit_s:
        options: list[tuple[float, str, int | None, float]] = []
        if used + slot_bytes <= budget:
            t = simulate(trace, compute, copy, slots + extra + 1, depth(extra + 1), sticky, stale=stale)
            options.append(((best - t) / slot_bytes, "slot", None, t))
        for u in pool:
            if u in sticky or used + nbytes[u] > budget:
                continue
            t = simulate(trace, compute, copy, slots + extra, depth(extra), sticky | {u}, stale=stale)
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
    return {"sticky": sticky, "extra_slots": extra, "depth": depth(extra), "predicted_ms": best, "start_ms": start_ms,
            "used_bytes": used, "seconds": time.perf_counter() - t0}


# ---------------------------------------------------------------- plans from a measured cycle
@dataclass(frozen=True)
class Measurements:
    """One traced cycle of a running engine, and what the device held while it ran."""

    trace: tuple[int, ...]       # unit uses in order, one cycle
    spans: tuple[float, ...]     # busy ms from each use to the next
    copy_ms: dict[int, float]    # each streamed unit's copy time (sticky ones too)
    nbytes: dict[int, int]       # each streamed unit's device bytes
    slot_bytes: int
    slots: int                   # ring slots now
    depth: int                   # prefetch depth now
    sticky: frozenset[int]
    candidates: frozenset[int]   # units that may become sticky
    forced: frozenset[int]       # sticky units bigger than a slot: they stay sticky
    stale: frozenset[int] = frozenset()  # units whose device copy goes stale every cycle (trainable)
    fixed_bytes: int = 0         # engine device bytes besides ring and sticky (resident tensors, staging)
    engine_bytes: int = 0        # everything the engine held on the device while measured
    # what keeping a unit on the device costs, where not its device bytes: a unit stored narrower (fp8)
    # is kept as its stored bytes and widened into a ring slot at each use (engine.keep_cost). The
    # simulation counts it as sticky (no copy; the slot it passes through and its widening, on a
    # stream of its own, are not modelled): the engine keeps a growth only if the measured stall did not rise.
    keep_bytes: dict[int, int] = field(default_factory=dict)
    peak_bytes: int | None = None   # peak allocated on the device during the measured cycles (None: unknown)
    limit_bytes: int | None = None  # what the device lets this process allocate (None: not a card)


@dataclass(frozen=True)
class RingPlan:
    """The planner's decision for the ring: sticky units, slots and prefetch depth, and why."""

    sticky: frozenset[int]
    slots: int
    depth: int
    predicted_ms: float
    start_ms: float
    chosen_by: str
    other_bytes: int = 0   # the measured peak of everything that is not the engine's
    device_bytes: int = 0  # what the engine will hold on the device under this plan
    seconds: float = 0.0

    def info(self) -> dict:
        return {"chosen_by": self.chosen_by, "planned_step_ms": self.predicted_ms, "unplanned_step_ms": self.start_ms,
                "planned_slots": self.slots, "planned_depth": self.depth, "measured_other_bytes": self.other_bytes,
                "planned_device_bytes": self.device_bytes, "plan_seconds": self.seconds}


Plan = RingPlan  # the old name, for code that imports it


def predict(m: Measurements) -> float:
    return simulate(m.trace, m.spans, m.copy_ms, m.slots, m.depth, m.sticky, stale=m.stale)


def _costs(m: Measurements) -> dict[int, int]:
    """Each streamed unit's device bytes if kept (``choose``'s ``nbytes``)."""
    return {u: m.keep_bytes.get(u, n) for u, n in m.nbytes.items()}


def _other(m: Measurements) -> int:
    return 0 if m.peak_bytes is None else max(0, m.peak_bytes - m.engine_bytes)


def budget_room(m: Measurements, budget: int) -> int:
    """Bytes of ``budget`` left for the ring and sticky units once the measured rest of the process is
    set aside; raises when the ring as it is (and the units bigger than a slot) cannot fit."""
    other = _other(m)
    room = budget - other - m.fixed_bytes
    need = m.slots * m.slot_bytes + sum(m.nbytes[u] for u in m.forced)
    if room < need:
        raise VramBudgetError(
            f"vram_budget: {_gib(budget)} cannot hold this model: the ring needs {_gib(m.slots * m.slot_bytes)} "
            f"({m.slots} slots){_plus(m.fixed_bytes, 'resident tensors')}"
            f"{_plus(sum(m.nbytes[u] for u in m.forced), 'units bigger than a slot')}, and the rest of the process "
            f"(activations, gradients, optimizer state, other tensors) peaked at {_gib(other)} in the traced steps; "
            f"raise it to at least {_gib(other + m.fixed_bytes + need)}, or run a smaller batch or resolution")
    return room


def plan_budget(m: Measurements, budget: int, *, grow_depth: bool) -> RingPlan:
    """Spend ``budget`` (peak allocated bytes, activations included) on sticky units and ring slots.

    What the rest of the process took at its peak in the measured cycles is set aside first; the
    ring as it is (and units bigger than a slot) must fit in what is left, or this raises.
    """
    room = budget_room(m, budget)
    res = choose(list(m.trace), list(m.spans), m.copy_ms, _costs(m), slot_bytes=m.slot_bytes, slots=m.slots,
                 prefetch=m.depth, budget=room, forced=m.forced, candidates=m.candidates, grow_depth=grow_depth,
                 stale=m.stale)
    return RingPlan(frozenset(res["sticky"]), m.slots + res["extra_slots"], res["depth"], res["predicted_ms"],
                res["start_ms"], "measured", _other(m), m.fixed_bytes + res["used_bytes"], res["seconds"])


def plan_growth(m: Measurements, *, margin: int, measured_stall_ms: float | None = None,
                max_seconds: float = 2.0, keep_units: bool = False) -> RingPlan | None:
    """No budget: deepen the ring into the device's free memory (less ``margin``) while the simulated stall falls.

    With ``keep_units`` (inference: no weight changes between calls) the free memory may also keep
    streamed units on the device (sticky), whichever the simulation finds buys more per byte
    (``choose``): where the copies set the pace, a deeper ring only moves them, a kept unit takes
    its copy away. When the simulation sees nothing to gain but the cycle really stalled
    (``measured_stall_ms``, at least 2% of its busy time), the ring doubles anyway (within the free
    memory): the engine keeps a growth only if the measured stall then falls, so a simulation that
    misjudges the copies cannot hold the ring small. Returns None when there is no device limit to
    grow into (the CPU), or growing would not help.
    """
    if m.limit_bytes is None or m.peak_bytes is None or m.slot_bytes <= 1:
        return None
    if keep_units:
        plan = _grow_or_keep(m, margin, max_seconds)
        if plan is not None:
            return plan
    t0 = time.perf_counter()
    k_max = growth_room(m, margin)
    busy = sum(m.spans)
    times = [simulate(m.trace, m.spans, m.copy_ms, m.slots, m.depth, m.sticky, stale=m.stale)]
    for k in range(1, k_max + 1):
        times.append(simulate(m.trace, m.spans, m.copy_ms, m.slots + k, max(m.depth, m.slots + k - 1), m.sticky,
                              stale=m.stale))
        if times[-1] <= busy * 1.002 or time.perf_counter() - t0 > max_seconds:
            break  # no stall left to take away (or out of planning time)
        if k >= 4 and times[-5] - times[-1] <= 1e-3 * times[-5]:
            break  # four more slots bought nothing
    best = min(times)
    # the fewest slots within 0.5% of the best: the memory past that buys almost nothing
    k = next(i for i, t in enumerate(times) if t <= best + 0.005 * best)
    chosen_by = "free memory"
    if k == 0 or times[0] - times[k] < 0.01 * times[0]:
        if measured_stall_ms is None or k_max == 0 or measured_stall_ms < 0.02 * max(busy, 1e-9):
            return None
        k = min(k_max, max(m.slots, 1))
        chosen_by = "free memory (measured stall)"
        times.append(simulate(m.trace, m.spans, m.copy_ms, m.slots + k, max(m.depth, m.slots + k - 1), m.sticky,
                              stale=m.stale))
        best = times[-1]
    else:
        best = times[k]
    return RingPlan(m.sticky, m.slots + k, max(m.depth, m.slots + k - 1), best, times[0], chosen_by,
                _other(m), m.engine_bytes + k * m.slot_bytes, time.perf_counter() - t0)


def _grow_or_keep(m: Measurements, margin: int, max_seconds: float) -> RingPlan | None:
    """The free memory (less ``margin``) spent on ring slots and sticky units by simulated gain per byte;
    None where that buys less than 1% of the cycle."""
    headroom = m.limit_bytes - margin - m.peak_bytes  # type: ignore[operator]
    if headroom <= 0:
        return None
    cost = _costs(m)
    held = m.slots * m.slot_bytes + sum(cost[u] for u in m.sticky)
    res = choose(m.trace, m.spans, m.copy_ms, cost, slot_bytes=m.slot_bytes, slots=m.slots, prefetch=m.depth,
                 budget=held + headroom, forced=m.sticky, candidates=m.candidates, grow_depth=True, stale=m.stale,
                 time_limit_s=max_seconds)
    if res["start_ms"] - res["predicted_ms"] < 0.01 * res["start_ms"]:
        return None
    return RingPlan(frozenset(res["sticky"]), m.slots + res["extra_slots"], res["depth"], res["predicted_ms"],
                    res["start_ms"], "free memory (slots and kept units)", _other(m),
                    m.engine_bytes + res["used_bytes"] - held, res["seconds"])


def growth_room(m: Measurements, margin: int) -> int:
    """Ring slots the device's free memory (less ``margin``) can still take, and that some unit would use."""
    if m.limit_bytes is None or m.peak_bytes is None or m.slot_bytes <= 1:
        return 0
    headroom = m.limit_bytes - margin - m.peak_bytes
    streamed = sum(1 for u in m.copy_ms if u not in m.sticky)
    return int(min(max(headroom, 0) // m.slot_bytes, max(streamed - m.slots, 0)))


def _gib(n: int | float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", float(1 << 20)), ("KiB", 1024.0)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def _plus(n: int, what: str) -> str:
    return f" + {_gib(n)} of {what}" if n else ""
