"""SlabCache: which units stay in host memory between uses, within its byte budget.

The default policy is Belady's: when a unit is read and the cache is full, it may displace only
cached units whose next use (in the traced order of unit uses) comes *later* than its own next
use; otherwise it is streamed through a staging slot and let go after its use. For the cyclic
access of diffusion steps a just-used unit's next use is a whole cycle away, later than that of any
cached unit, so the cache keeps a fixed subset (the first units to fill it) and streams the rest:
the hit rate is the cached fraction of the bytes. FIFO and LRU (``policy="fifo"`` / ``"lru"``)
always admit and evict the oldest inserted or least recently used unit: on a cycle longer than
the cache they evict each unit just before it is needed again, so their hit rate is about 0.
They are there as ablations.

Units written to (buffers written back, optimizer masters) are *kept*: never evicted.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .pool import HostPool

__all__ = ["POLICIES", "NextUse", "SlabCache"]

POLICIES = ("belady", "fifo", "lru")


class NextUse:
    """Positions of each unit in one cycle of the trace, for 'when is it used next' queries.

    Positions are absolute (cycle * len + index), so they keep growing across cycles.
    """

    def __init__(self, trace: Sequence[int], skip: Iterable[int] = ()) -> None:
        self.trace = list(trace)
        self.length = len(self.trace)
        skipped = set(skip)
        self.at: dict[int, list[int]] = {}
        for i, uid in enumerate(self.trace):
            if i not in skipped:
                self.at.setdefault(uid, []).append(i)

    def after(self, uid: int, pos: int) -> float:
        """The first absolute position > pos at which uid is used; inf when it is not in the trace."""
        at = self.at.get(uid)
        if not at or not self.length:
            return math.inf
        base, rel = divmod(pos, self.length)
        i = bisect.bisect_right(at, rel)
        return base * self.length + at[i] if i < len(at) else (base + 1) * self.length + at[0]


@dataclass
class _Entry:
    offset: int
    nbytes: int
    inserted: int
    used: int
    kept: bool = False


class SlabCache:
    """Bookkeeping of the cached units' slabs in one HostPool; the caller holds the lock."""

    def __init__(self, capacity: int, policy: str, *, pin: bool) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.pool = HostPool(capacity, pin=pin)
        self.entries: dict[int, _Entry] = {}
        self.next_use = NextUse([])
        self._clock = itertools.count()
        self.evictions = 0

    @property
    def capacity_bytes(self) -> int:
        return self.pool.capacity_bytes

    @property
    def kept_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values() if e.kept)

    def __contains__(self, uid: int) -> bool:
        return uid in self.entries

    def touch(self, uid: int) -> None:
        self.entries[uid].used = next(self._clock)

    def _insert(self, uid: int, nbytes: int, kept: bool = False) -> int | None:
        off = self.pool.alloc(nbytes)
        if off is not None:
            t = next(self._clock)
            self.entries[uid] = _Entry(off, nbytes, t, t, kept)
        return off

    def remove(self, uid: int) -> None:
        e = self.entries.pop(uid)
        self.pool.free(e.offset, e.nbytes)

    def admit(self, uid: int, nbytes: int, now: int, use_at: int, busy: set[int]) -> tuple[int | None, list[int]]:
        """Place uid (read for its use at ``use_at``; the engine is at ``now``): (offset or None, evicted)."""
        if self.pool.capacity_bytes == 0:
            return None, []
        if self.pool.fits(nbytes):
            return self._insert(uid, nbytes), []
        candidates = [v for v, e in self.entries.items() if not e.kept and v not in busy]
        if self.policy == "belady":
            mine = self.next_use.after(uid, use_at)
            later = [(self.next_use.after(v, now), v) for v in candidates]
            order = [v for nu, v in sorted(later, reverse=True) if nu > mine]
        elif self.policy == "fifo":
            order = sorted(candidates, key=lambda v: self.entries[v].inserted)
        else:
            order = sorted(candidates, key=lambda v: self.entries[v].used)
        free = self.pool.capacity_bytes - self.pool.used_bytes
        if free + sum(self.entries[v].nbytes for v in order) < nbytes:
            return None, []  # evicting every candidate would not make room: stream it instead
        evicted: list[int] = []
        for v in order:
            self.remove(v)
            evicted.append(v)
            if self.pool.fits(nbytes):
                break
        self.evictions += len(evicted)
        return self._insert(uid, nbytes), evicted

    def keep(self, uid: int, nbytes: int, busy: set[int]) -> tuple[int | None, list[int]]:
        """Room for a unit that must stay (written to): evicts any unkept, idle unit; None when full of kept ones."""
        if uid in self.entries:
            self.entries[uid].kept = True
            return self.entries[uid].offset, []
        evicted: list[int] = []
        for v in sorted((v for v, e in self.entries.items() if not e.kept and v not in busy),
                        key=lambda v: -self.next_use.after(v, 0)):
            if self.pool.fits(nbytes):
                break
            self.remove(v)
            evicted.append(v)
        self.evictions += len(evicted)
        return self._insert(uid, nbytes, kept=True), evicted

    def close(self) -> None:
        self.entries.clear()
        self.pool.close()
