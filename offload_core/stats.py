"""Counters and event timings behind ``stats()``.

Timings are CUDA event pairs recorded in the hot path and resolved only when stats are read (or
when the backlog grows), so measuring never synchronizes the host per unit.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

__all__ = ["Counters", "TimingLog"]


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
    _free: list = field(default_factory=list)
    backlog: int = 4096

    def event(self) -> torch.cuda.Event:
        return self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)

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
            self.counts[kind] += 1
            self._free.extend((start, end))
        self.pending = keep

    def reset(self) -> None:
        self.pending.clear()
        self.total_ms.clear()
        self.per_unit_ms.clear()
        self.counts.clear()
