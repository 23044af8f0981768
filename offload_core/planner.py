"""Planner: which units stay resident on the device, and what step time to expect.

- ``offload_ratio``: stream that fraction of the units, keep the rest resident
- ``vram_budget``: keep units resident while they fit next to the slot ring

Resident units are spread through the forward order (every k-th unit, ending on the last one):
each resident unit gives the copy stream a compute window to fetch the next streamed unit in, and
the last units of the forward pass are the first ones backward needs again.
"""

from __future__ import annotations

import math

from .config import OffloadConfig
from .units import Unit

__all__ = ["plan_residency", "interleaved", "simulate"]


def interleaved(n: int, k: int) -> list[int]:
    """k indices out of range(n), evenly spread and including the last one."""
    if k <= 0:
        return []
    if k >= n:
        return list(range(n))
    step = n / k
    return sorted({n - 1 - int(math.floor(i * step)) for i in range(k)})


def plan_residency(units: list[Unit], config: OffloadConfig) -> dict:
    """Mark resident units (``unit.streamed = False``); returns the plan's numbers."""
    candidates = [u for u in units if u.streamed]
    total = sum(u.nbytes for u in candidates)
    keep: list[int] = []
    if not config.cpu_offload:
        keep = list(range(len(candidates)))
    elif config.offload_ratio is not None:
        n_stream = int(round(config.offload_ratio * len(candidates)))
        keep = interleaved(len(candidates), len(candidates) - n_stream)
    elif config.vram_budget is not None:
        # The ring needs (prefetch + 1) slots of the largest streamed unit; what is left holds residents.
        for k in range(len(candidates), -1, -1):
            chosen = interleaved(len(candidates), k)
            streamed = [candidates[i] for i in range(len(candidates)) if i not in set(chosen)]
            slot = max((u.nbytes for u in streamed), default=0)
            need = sum(candidates[i].nbytes for i in chosen) + slot * (config.prefetch + 1 if streamed else 0)
            if need <= config.vram_budget:
                keep = chosen
                break
    for i in keep:
        candidates[i].streamed = False
    streamed_bytes = sum(u.nbytes for u in candidates if u.streamed)
    return {
        "resident_units": len(keep),
        "streamed_units": len(candidates) - len(keep),
        "streamed_bytes": streamed_bytes,
        "resident_unit_bytes": total - streamed_bytes,
    }


def simulate(trace: list[int], streamed: set[int], compute_ms: dict[int, float], copy_ms: dict[int, float],
             slots: int, prefetch: int) -> float:
    """Predicted time of one cycle of the trace, in ms.

    One copy engine, one compute stream, ``slots`` device buffers. A unit's copy starts when the
    copy engine is free, the unit is within ``prefetch`` uses of the compute front, and the slot it
    takes has been released by the unit that held it ``slots`` streamed uses earlier. A unit's
    compute starts when the previous compute ended and its copy landed.
    """
    copy_free = 0.0
    comp_end = 0.0
    ready: dict[int, float] = {}
    released: list[float] = []  # compute-end times of streamed uses, in order
    starts: list[float] = []  # compute-start times of every use, in order
    for i, uid in enumerate(trace):
        if uid in streamed:
            gate = 0.0
            k = len(released)
            if k >= slots:
                gate = released[k - slots]
            if i - prefetch - 1 >= 0:
                gate = max(gate, starts[i - prefetch - 1])
            start = max(copy_free, gate)
            copy_free = start + copy_ms.get(uid, 0.0)
            ready[uid] = copy_free
        begin = max(comp_end, ready.get(uid, 0.0))
        starts.append(begin)
        comp_end = begin + compute_ms.get(uid, 0.0)
        if uid in streamed:
            released.append(comp_end)
    return comp_end
