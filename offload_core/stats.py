"""Counters and event timings behind ``stats()``.

Timings are CUDA event pairs recorded in the hot path and resolved only when stats are read (or
when the backlog grows), so measuring never synchronizes the host per unit. On the CPU the same
log takes host clock stamps: that path is synchronous, so a stamp is when the work happened.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["Counters", "TimingLog", "HostEvent"]


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
    d2h_bytes: int = 0
    d2h_count: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_evictions: int = 0
    prefetch_issued: int = 0
    prefetch_misses: int = 0
    steps: int = 0
    saved_refs: int = 0  # autograd-saved weight views replaced by references
    refetches: int = 0  # backward uses that had to load a unit again


@dataclass
class TimingLog:
    """Pending (kind, uid, start, end) event pairs, and their resolved totals in ms."""

    pending: list = field(default_factory=list)
    total_ms: dict = field(default_factory=lambda: defaultdict(float))
    per_unit_ms: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    counts: dict = field(default_factory=lambda: defaultdict(int))
    last_ms: dict = field(default_factory=dict)  # (kind, key) -> the latest resolved value
    _free: list = field(default_factory=list)
    backlog: int = 4096
    host: bool = False  # CPU path: host clock stamps instead of CUDA events

    def event(self) -> "torch.cuda.Event | HostEvent":
        if self._free:
            return self._free.pop()
        return HostEvent() if self.host else torch.cuda.Event(enable_timing=True)

    def add(self, kind: str, uid: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.pending.append((kind, uid, start, end))
        if len(self.pending) > self.backlog:
            self.resolve(block=False)

    def resolve(self, block: bool = True) -> None:
        keep = []
        for kind, uid, start, end in self.pending:
            if not block and not end.query():
                keep.append((kind, uid, start, end))
                continue
            if block:
                end.synchronize()
            ms = start.elapsed_time(end)
            self.total_ms[kind] += ms
            self.per_unit_ms[uid][kind] += ms
            self.last_ms[(kind, uid)] = ms
            self.counts[kind] += 1
            self._free.extend((start, end))
        self.pending = keep

    def reset(self) -> None:
        self.pending.clear()
        self.total_ms.clear()
        self.per_unit_ms.clear()
        self.counts.clear()
        self.last_ms.clear()
