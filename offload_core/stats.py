"""Counters and event timings behind ``stats()``.

Timings are CUDA event pairs recorded in the hot path and resolved only when stats are read (or
when the backlog grows), so measuring never synchronizes the host per unit. On the CPU the same
log takes host clock stamps: that path is synchronous, so a stamp is when the work happened.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Any

import torch

__all__ = ["Counters", "EngineStats", "TimingLog", "HostEvent", "CopyClock"]


class HostEvent:
    """A CUDA-event look-alike for the CPU path: a host clock stamp."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def record(self, stream: object = None) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3


@dataclass
class Counters:
    h2d_bytes: int = 0
    h2d_count: int = 0
    timed_h2d_bytes: int = 0  # bytes of the copies a timed step made (the rate's numerator)
    d2h_bytes: int = 0
    d2h_count: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    prefetch_issued: int = 0
    prefetch_misses: int = 0
    steps: int = 0
    timed_steps: int = 0  # steps whose uses and copies were timed (every one while planning, then 1 in timing_every)
    saved_refs: int = 0  # autograd-saved weight views replaced by references
    refetches: int = 0  # backward uses that had to load a unit again
    accumulate_calls: int = 0  # accumulate() calls (lockstep.py): one optimizer step's micro-batches each
    accumulate_h2d_bytes: int = 0  # H2D bytes copied inside accumulate() calls
    accumulation_groups: int = 0  # of them, layer-major ones (accumulation_order="layer")
    lockstep_switches: int = 0  # micro-batch switches at unit entries in layer-major forwards
    lockstep_pad_nodes: int = 0  # sequence numbers skipped to order the layer-major backward (lockstep.py)
    parked_tensors: int = 0  # park_saved_tensors: saved activations copied to host memory (parking.py)
    parked_bytes: int = 0
    kept_widens: int = 0  # loads of units kept narrow on the device: widened, not copied (widener.keep)

    UNREPORTED = ("timed_h2d_bytes",)  # feeds the copy rate (h2d_gbps) only

    def reported(self) -> dict[str, int]:
        """The counts ``stats()`` carries under their own names."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.UNREPORTED}


@dataclass
class EngineStats:
    """What ``stats()`` returns, as a typed record: ``as_dict()`` is the plain dict ``handle.stats()``
    hands out (its keys are the fields below, in this order, with the host store's and the optimizer's
    own keys merged in where ``store_stats`` and ``optimizer_stats`` sit).

    ``measured_step_ms`` and ``predicted_step_ms`` are in the dict only once a timed cycle was read
    (``predicted_step_ms`` may then be None: nothing to predict from).
    """

    vram_allocated_bytes: int
    vram_reserved_bytes: int
    vram_peak_bytes: int
    pinned: bool
    pinned_capacity_bytes: int
    pinned_used_bytes: int
    weight_bytes: int
    streamed_bytes: int
    resident_bytes: int
    sticky_bytes: int  # device bytes of the units kept there (widened, or as stored where kept narrow)
    sticky_units: int
    kept_narrow_units: int  # of them, kept as their stored (fp8) bytes, widened at each use
    slot_count: int
    slot_bytes: int
    slot_grows: int
    prefetch_depth: int
    staging_bytes: int  # fp8/bf16 storage: raw copies widened into slots
    h2d_bytes: int
    h2d_count: int
    d2h_bytes: int
    d2h_count: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    prefetch_issued: int
    prefetch_misses: int
    saved_refs: int
    refetches: int
    accumulate_calls: int
    accumulate_h2d_bytes: int
    accumulation_groups: int
    lockstep_switches: int
    lockstep_pad_nodes: int
    parked_tensors: int
    parked_bytes: int
    kept_widens: int
    steps: int
    planning: bool
    trace_length: int
    trace_relearned: int
    setup_seconds: float
    num_units: int
    units: list[dict[str, Any]]
    plan: dict[str, Any]  # the planner's decisions and predictions (engine.prediction)
    store_stats: dict[str, Any]  # the host store's own keys (HostStore.stats(): host_store, ...)
    timed_steps: int
    measured_step_ms: float | None
    predicted_step_ms: float | None
    h2d_ms: float
    timed_h2d_ms: float  # what the timed copies' events read, unweighted
    stall_ms: float
    compute_ms: float
    h2d_gbps: float
    # accumulate_h2d_bytes / accumulate_calls: with accumulation_order="layer" about one step's
    # weights crossing (2x the streamed bytes with checkpointing), with "micro" K times that
    h2d_bytes_per_optimizer_step: float = 0.0
    optimizer_stats: dict[str, Any] = field(default_factory=dict)  # optimizer offload's own keys, when it is on
    link_stats: dict[str, Any] = field(default_factory=dict)  # debug_link_gbps's keys (link.py), when it is set
    # compile=True's keys (compiled.py): compiled_blocks, compile_graphs, recompiles, compile_seconds,
    # compile_cache_hits, compile_cache_misses
    compile_stats: dict[str, Any] = field(default_factory=dict)

    MERGED = ("store_stats", "optimizer_stats", "link_stats", "compile_stats")  # fields whose keys are merged into the dict, not kept under their name
    TIMED_CYCLE = ("measured_step_ms", "predicted_step_ms")  # in the dict only once a cycle was timed

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            name = f.name
            if name in self.MERGED:
                out.update(getattr(self, name))
            elif name not in self.TIMED_CYCLE or self.measured_step_ms is not None:
                out[name] = getattr(self, name)
        return out


@dataclass
class TimingLog:
    """Pending (kind, uid, start, end) event pairs, and their resolved totals in ms.

    A settled engine times one step in a few: each pair then carries ``weight``, the steps its
    reading stands for (itself and the untimed ones since the last timed step), and ``total_ms``,
    ``per_unit_ms`` and ``counts`` are weighted: estimates over every step. ``timed_ms`` keeps the
    readings themselves (a copy rate is timed bytes over timed ms); ``last_ms`` and ``cycle_ms`` too.
    """

    pending: list = field(default_factory=list)
    total_ms: dict = field(default_factory=lambda: defaultdict(float))
    timed_ms: dict = field(default_factory=lambda: defaultdict(float))
    per_unit_ms: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    counts: dict = field(default_factory=lambda: defaultdict(int))
    last_ms: dict = field(default_factory=dict)  # (kind, key) -> the latest resolved value
    cycle_ms: dict = field(default_factory=lambda: defaultdict(float))  # (kind, cycle) -> ms, for pairs added with a cycle
    _free: list = field(default_factory=list)
    backlog: int = 4096
    host: bool = False  # CPU path: host clock stamps instead of CUDA events
    weight: int = 1  # the steps a pair added now stands for

    def event(self) -> "torch.cuda.Event | HostEvent":
        if self._free:
            return self._free.pop()
        return HostEvent() if self.host else torch.cuda.Event(enable_timing=True)

    def add(self, kind: str, uid: Any, start: Any, end: Any, cycle: int | None = None, own_end: bool = True,
            compute: Any = None) -> None:
        """A pair to resolve later. ``own_end=False``: ``end`` is also the start of a pair added
        after this one, and that pair gives it back to the pool (one event, two readings).
        ``compute``: a unit the pair's time also counts for, as its compute."""
        self.pending.append((kind, uid, start, end, cycle, own_end, compute, self.weight))
        if len(self.pending) > self.backlog:
            self.resolve(block=False)

    def host_wait(self, cycle: int, ms: float) -> None:
        """Host time the engine's thread waited for a unit's copies to be queued (a bounce store's
        ring), per cycle: ``cycle_ms[("host_wait", cycle)]``."""
        self.cycle_ms[("host_wait", cycle)] += ms

    def resolve(self, block: bool = True) -> None:
        """Resolve pending pairs in the order they were added (without blocking: up to the first
        whose end has not happened yet), so a shared event is pooled again only once every pair
        that reads it has been resolved."""
        done = 0
        try:
            for kind, uid, start, end, cycle, own_end, compute, w in self.pending:
                if block:
                    end.synchronize()
                elif not end.query():
                    break
                ms = start.elapsed_time(end)
                self.timed_ms[kind] += ms
                self.total_ms[kind] += ms * w
                self.per_unit_ms[uid][kind] += ms * w
                self.last_ms[(kind, uid)] = ms
                self.counts[kind] += w
                if cycle is not None:
                    self.cycle_ms[(kind, cycle)] += ms
                if compute is not None:
                    self.total_ms["compute"] += ms * w
                    self.per_unit_ms[compute]["compute"] += ms * w
                self._free.append(start)
                if own_end:
                    self._free.append(end)
                done += 1
        finally:
            del self.pending[:done]  # what was read (and pooled) is never read again

    def reset(self) -> None:
        self.pending.clear()
        self.total_ms.clear()
        self.timed_ms.clear()
        self.per_unit_ms.clear()
        self.counts.clear()
        self.last_ms.clear()
        self.cycle_ms.clear()


class CopyClock:
    """Event pairs around H2D copies that bracket the DMA, not the host's submission of it.

    On an idle copy stream a start event runs the moment it is enqueued, but the DMA can only
    begin once the host has finished submitting the copy (``copy_`` takes tens of microseconds of
    host time). The pair would count that submission as copy time: on P3's 67 MB copies, issued
    just in time, it read 2% above ``torch.profiler``. So when the stream is idle, a spin kernel
    a little shorter than the host's recent submission time holds the stream first; the start
    event then runs just before the DMA. The DMA could not have started earlier anyway, so the
    hold costs no copy time. A stream with work queued needs no hold: the start event waits there.
    """

    HOLD = True  # set False to see the unheld pairs (bench/RESULTS.md compares both on P3)

    def __init__(self, log: TimingLog, stream: "torch.cuda.Stream") -> None:
        self.log = log
        self.cycles_per_us = self._calibrate(stream)
        self.submit_us: float | None = None  # a low quantile of recent submission times
        self.holds = 0
        self._t0 = 0.0

    @staticmethod
    def _calibrate(stream: "torch.cuda.Stream") -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1000)
            a.record(stream)
            torch.cuda._sleep(1_000_000)
            b.record(stream)
        b.synchronize()
        return 1_000_000 / max(a.elapsed_time(b) * 1e3, 1e-3)

    def start(self, stream: "torch.cuda.Stream") -> "torch.cuda.Event":
        """Call with ``stream`` current, right before the copy is enqueued on it: the start event."""
        self._t0 = time.perf_counter()
        if self.HOLD and self.submit_us is not None and stream.query():
            torch.cuda._sleep(int(0.9 * self.submit_us * self.cycles_per_us))
            self.holds += 1
        ev = self.log.event()
        ev.record(stream)
        return ev

    def submitted(self) -> None:
        """Call right after the copy is enqueued: learns how long submitting takes."""
        us = (time.perf_counter() - self._t0) * 1e6
        if self.submit_us is None or us < self.submit_us:
            self.submit_us = us
        else:  # rise slowly, so one slow submission (a GIL switch) does not lengthen the hold
            self.submit_us += 0.05 * (us - self.submit_us)
