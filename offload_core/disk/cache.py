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

from .format import align
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

    def _insert(self, uid: int, nbytes: int, kept: bool = False, use_at: int = -1,
                runs: list[tuple[int, int]] | None = None) -> int | None:
        off = self._spot(uid, align(max(nbytes, 1)), use_at, self.pool.free_runs() if runs is None else runs)
        if off is not None:
            self.pool.alloc_at(off, nbytes)
            t = next(self._clock)
            self.entries[uid] = _Entry(off, nbytes, t, t, kept)
        return off

    def _spot(self, uid: int, need: int, use_at: int, runs: list[tuple[int, int]]) -> int | None:
        """Where in the free ``runs`` uid goes: against the wall or the neighbour whose next use is nearest its own.

        Units used close together are let go close together, so the bytes they free are one run
        (first fit scattered the leftovers of big units among small ones, too short for either).
        """
        if not runs:
            return None
        mine = self.next_use.after(uid, use_at)
        ends = {e.offset: v for v, e in self.entries.items()}
        starts = {e.offset + align(max(e.nbytes, 1)): v for v, e in self.entries.items()}

        def gap(v: int | None) -> float:
            if v is None:
                return 0.0  # the pool's edge
            nu = self.next_use.after(v, use_at)
            return 0.0 if nu == mine else abs(nu - mine) if math.isfinite(nu - mine) else math.inf

        best: tuple[tuple[int, float, int], int] | None = None
        for a, b in runs:
            if b - a < need:
                continue
            for key, off in (((b - a - need, gap(starts.get(a)), a), a), ((b - a - need, gap(ends.get(b)), a), b - need)):
                key = (0 if key[0] == 0 else 1, key[1], key[2])
                if best is None or key < best[0]:
                    best = (key, off)
        return None if best is None else best[1]

    def remove(self, uid: int) -> None:
        e = self.entries.pop(uid)
        self.pool.free(e.offset, e.nbytes)

    def admit(self, uid: int, nbytes: int, now: int, use_at: int, busy: set[int]) -> tuple[int | None, list[int]]:
        """Place uid (read for its use at ``use_at``; the engine is at ``now``): (offset or None, evicted)."""
        if self.pool.capacity_bytes == 0:
            return None, []
        if self.pool.fits(nbytes):
            return self._insert(uid, nbytes, use_at=use_at), []
        candidates = [v for v, e in self.entries.items() if not e.kept and v not in busy]
        if self.policy == "belady":
            mine = self.next_use.after(uid, use_at)
            later = ((v, self.next_use.after(v, now)) for v in candidates)
            rank = {v: nu for v, nu in later if nu > mine}
        elif self.policy == "fifo":
            rank = {v: -self.entries[v].inserted for v in candidates}
        else:
            rank = {v: -self.entries[v].used for v in candidates}
        return self._replace(uid, nbytes, rank, use_at=use_at)

    def keep(self, uid: int, nbytes: int, busy: set[int]) -> tuple[int | None, list[int]]:
        """Room for a unit that must stay (written to): evicts any unkept, idle unit; None when full of kept ones."""
        if uid in self.entries:
            self.entries[uid].kept = True
            return self.entries[uid].offset, []
        if self.pool.fits(nbytes):
            return self._insert(uid, nbytes, kept=True), []
        rank = {v: self.next_use.after(v, 0) for v, e in self.entries.items() if not e.kept and v not in busy}
        return self._replace(uid, nbytes, rank, kept=True)

    def _replace(self, uid: int, nbytes: int, rank: dict[int, float], kept: bool = False,
                 use_at: int = -1) -> tuple[int | None, list[int]]:
        """Evict units of ``rank`` (the higher, the sooner to go) to free one run that uid fits in, or nothing.

        Units differ in size (a Flux double block is 2.4 single ones), so freed bytes need not be one run:
        the victims are the units of the window whose lowest-ranked victim ranks highest (then the
        fewest bytes). Evicting by rank alone left runs too short for the unit it made room for.
        """
        need = align(max(nbytes, 1))
        segs = sorted([(a, b, None) for a, b in self.pool.free_runs()]
                      + [(e.offset, e.offset + align(max(e.nbytes, 1)), v) for v, e in self.entries.items()])
        best: tuple[tuple[float, int], int, list[int]] | None = None
        for i, (start, _, first) in enumerate(segs):
            if first is not None and first not in rank:
                continue
            victims: list[int] = []
            end = start
            for a, b, v in segs[i:]:
                if a != end or (v is not None and v not in rank):
                    break
                if v is not None:
                    victims.append(v)
                end = b
                if end - start >= need:
                    key = (min((rank[x] for x in victims), default=math.inf), -sum(self.entries[x].nbytes for x in victims))
                    if best is None or key > best[0]:
                        best = (key, start, victims)
                    break
        if best is None:
            return None, []  # no window of idle units the policy would give up: stream it instead
        _, start, victims = best
        for v in victims:
            self.remove(v)
        self.evictions += len(victims)
        run = next((a, b) for a, b in self.pool.free_runs() if a <= start < b)
        return self._insert(uid, nbytes, kept, use_at, [run]), victims

    def close(self) -> None:
        self.entries.clear()
        self.pool.close()
