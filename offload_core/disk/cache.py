"""SlabCache: which units stay in host memory between uses, within its byte budget.

The default policy is Belady's: when a unit is read and the cache is full, it may displace only
cached units whose next use (in the traced order of unit uses) comes *later* than its own next
use; otherwise it is streamed through a staging slot and let go after its use. For the cyclic
access of diffusion steps a just-used unit's next use is a whole cycle away, later than that of any
cached unit, so the cache keeps a fixed subset (the first units to fill it) and streams the rest:
the hit rate is the cached fraction of the bytes.

Belady decides best at the use itself, when every unit used before it is idle and may go. The disk
workers read ahead, and a read placed early had fewer idle units to choose from: with units of two
sizes (a Flux double block is 2.4 single ones) it took the window it could get, a unit needed soon
among them, and read 5-18% over the floor. So the cache *plans*: it replays one cycle of the trace
on bookkeeping alone (``Runs``: no memory), each miss admitted at its own use, until a cycle decides
as the one before, and keeps per traced use the slab offset the replay gave it, or that it streams.
A read, however early, goes to its planned offset once the units there may go (idle, used next after
it); until then to a staging slot, and into the cache after its use (the store's move). Where there
is no plan (no trace yet, more than PLAN_MAX_USES uses and units) and for a read the plan did not foresee, the
rank at the read decides.

FIFO and LRU (``policy="fifo"`` / ``"lru"``) always admit and evict the oldest inserted or least
recently used unit: on a cycle longer than the cache they evict each unit just before it is needed
again, so their hit rate is about 0. They are there as ablations.

Units written to (buffers written back, optimizer masters) are *kept*: never evicted.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from .format import FILE_ALIGN, align
from .pool import HostPool, Runs

__all__ = ["PLAN_MAX_USES", "POLICIES", "NextUse", "SlabCache"]

POLICIES = ("belady", "fifo", "lru")
# The replay costs O(cached units) a use in Python: 0.07 s for Flux-dev's 114 block uses, 1.6 s for
# 1,000: a longer trace (module-sized units) goes without it. The fixed set takes the same bound in
# units (its knapsack and packing: about 0.4 s at 512 units of distinct sizes).
PLAN_MAX_USES = 512


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

    def __init__(self, capacity: int, policy: str, *, pin: bool, pool: Runs | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self.pool: Runs = pool if pool is not None else HostPool(capacity, pin=pin)
        self.entries: dict[int, _Entry] = {}
        self.next_use = NextUse([])
        self._clock = itertools.count()
        self.evictions = 0
        self.sizes: dict[int, int] = {}  # uid -> bytes as read: what the plan replays (the store sets it)
        self._plan: dict[int, int | None] | None = None
        self._plan_of: tuple | None = None  # what the plan was made for: (next_use, the kept slabs)
        self.planned = self.unplanned = 0  # admissions that followed the plan / that the rank decided
        self.plan_kind, self.plan_bytes = "", 0  # the plan in force ("static" or "belady") and its reads a cycle
        self._home: dict[int, int] = {}  # a static plan: each unit of its set -> its offset

    def plan(self) -> dict[int, int | None] | None:
        """Per trace position of a use that reads its unit: its planned offset, or None (it streams).

        Made again when the trace (or its learned skips) or the kept units change; None where there is
        nothing to plan (not Belady, no trace, no sizes, no capacity). Of the replay and the static set,
        the one that reads fewer bytes a cycle (``plan_bytes``); the static set on a tie."""
        key = (self.next_use, tuple(sorted((v, e.offset, e.nbytes) for v, e in self.entries.items() if e.kept)))
        if self._plan_of is None or self._plan_of[0] is not key[0] or self._plan_of[1] != key[1]:
            self._plan_of, self._plan, self.plan_kind, self.plan_bytes, self._home = key, None, "", 0, {}
            nu = self.next_use
            if self.policy == "belady" and nu.length and self.sizes and self.pool.capacity_bytes:
                made = [m for m in (self._static(), self._replay()) if m is not None]
                if made:
                    self._plan, self.plan_bytes, self.plan_kind = min(made, key=lambda m: m[1])
                    if self.plan_kind == "static":
                        self._home = {nu.trace[p]: off for p, off in self._plan.items() if off is not None}
        return self._plan

    def _kept_runs(self) -> Runs:
        runs = Runs(self.pool.capacity_bytes)
        for e in self.entries.values():
            if e.kept:
                runs.alloc_at(e.offset, e.nbytes)
        return runs

    def _static(self) -> tuple[dict[int, int | None], int, str] | None:
        """A fixed set of units that never leaves, each at its own offset; every other use streams.

        In a cycle where each unit is used once a pass (a forward, then the backward in reverse), no
        policy hits more than the cache's bytes a pass: a set that fills the cache reaches that floor,
        where Belady's turning set loses what its units' two sizes leave unfilled (1.04-1.13x the floor's
        reads). The set: the most bytes of hits a cycle (a unit's bytes times its uses) that pack into
        the free runs, by a knapsack at 1/4096 of the capacity, each kind (uses, size) taken evenly
        through the trace, so the hits do not come in one stretch the disk idles through. Units already
        in memory are taken first, where they are (a plan made again, as skips are learned or a unit
        becomes kept, re-reads none it can keep), unless that packs fewer bytes than a fresh choice."""
        nu = self.next_use
        kept = {v for v, e in self.entries.items() if e.kept}
        first = {uid: at[0] for uid, at in nu.at.items() if uid in self.sizes and uid not in kept}
        if len(first) > PLAN_MAX_USES:
            return None
        total = sum(b - a for a, b in self._kept_runs().free_runs())
        kinds: dict[tuple[int, int], list[int]] = {}
        for uid in sorted(first, key=first.__getitem__):
            kinds.setdefault((len(nu.at[uid]), align(max(self.sizes[uid], 1))), []).append(uid)
        take = _knapsack({k: len(v) for k, v in kinds.items()}, total)
        best = None
        for stay in (True, False):  # the units in memory where they are (no re-read when the plan is made again), or not
            runs, where = self._kept_runs(), {}
            chosen: list[int] = []
            for k, uids in kinds.items():
                here = [u for u in uids if stay and u in self.entries] if take.get(k) else []
                here = _evenly(here, min(take.get(k, 0), len(here)))
                for u in here:
                    if runs.alloc_at(self.entries[u].offset, self.sizes[u]) is not None:
                        where[u] = self.entries[u].offset
                chosen += _evenly([u for u in uids if u not in where], take.get(k, 0) - sum(1 for u in uids if u in where))
            taken = set(chosen)
            rest = [u for k, uids in sorted(kinds.items(), key=lambda kv: (-kv[0][0], -kv[0][1])) for u in uids
                    if u not in where and u not in taken]
            rest.sort(key=lambda u: not (stay and u in self.entries))  # the knapsack's grid rounds up: residents first
            for uid in sorted(chosen, key=lambda u: -align(max(self.sizes[u], 1))) + rest:  # what the runs leave, filled
                off = None
                if stay and uid in self.entries:
                    off = runs.alloc_at(self.entries[uid].offset, self.sizes[uid])
                off = runs.alloc(self.sizes[uid]) if off is None else off
                if off is not None:
                    where[uid] = off
            plan = {p: where.get(uid) for uid in first for p in nu.at[uid]}
            nbytes = sum(self.sizes[nu.trace[p]] for p, off in plan.items() if off is None)
            if best is None or nbytes < best[1]:
                best = (plan, nbytes, "static")
        return best

    def _replay(self, cycles: int = 8) -> tuple[dict[int, int | None], int, str] | None:
        """Belady's decisions at each use, replayed on bookkeeping until a cycle decides as the one before."""
        nu = self.next_use
        sim = SlabCache(0, "belady", pin=False, pool=Runs(self.pool.capacity_bytes))
        sim.next_use = nu
        for v, e in self.entries.items():
            if e.kept:
                sim.pool.alloc_at(e.offset, e.nbytes)
                sim.entries[v] = _Entry(e.offset, e.nbytes, 0, 0, kept=True)
        uses = sorted((p, uid) for uid, at in nu.at.items() if uid in self.sizes for p in at)
        if len(uses) > PLAN_MAX_USES:
            return None
        before: dict[int, int | None] | None = None
        for cycle in range(cycles):
            places: dict[int, int | None] = {}
            for p, uid in uses:
                if uid in sim.entries:
                    sim.touch(uid)
                    continue
                q = cycle * nu.length + p
                places[p] = sim.admit(uid, self.sizes[uid], q, q, set())[0]
            if places == before:
                break
            before = places
        if before is None:
            return None
        return before, sum(self.sizes[nu.trace[p]] for p in before), "belady"

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
            self._put(uid, nbytes, off, kept)
        return off

    def _put(self, uid: int, nbytes: int, off: int, kept: bool = False) -> None:
        self.pool.alloc_at(off, nbytes)
        t = next(self._clock)
        self.entries[uid] = _Entry(off, nbytes, t, t, kept)

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
        # the replay's own cache has no sizes: the rank decides there
        plan = self.plan() if self.sizes and self.policy == "belady" and use_at >= 0 else None
        if plan is not None and use_at % self.next_use.length in plan:
            off = plan[use_at % self.next_use.length]
            if off is None:
                return None, []  # the plan streams this use
            placed = self._at(uid, nbytes, off, now, use_at, busy)
            if placed is not None:
                self.planned += 1
                return off, placed
            if now < use_at or self.plan_kind == "static":
                return None, []  # the units there are needed first: a staging slot now, the plan after its use
        if plan is not None and now < use_at and not self.pool.fits(nbytes):
            return None, []  # a use the plan serves from the cache, read all the same: evictions wait for its use
        self.unplanned += 1
        if self.pool.fits(nbytes):
            return self._insert(uid, nbytes, use_at=use_at), []
        candidates = [v for v, e in self.entries.items() if not e.kept and v not in busy and not self._at_home(v)]
        if self.policy == "belady":
            mine = self.next_use.after(uid, use_at)
            later = ((v, self.next_use.after(v, now)) for v in candidates)
            rank = {v: nu for v, nu in later if nu > mine}
        elif self.policy == "fifo":
            rank = {v: -self.entries[v].inserted for v in candidates}
        else:
            rank = {v: -self.entries[v].used for v in candidates}
        return self._replace(uid, nbytes, rank, use_at=use_at)

    def _at(self, uid: int, nbytes: int, off: int, now: int, use_at: int, busy: set[int]) -> list[int] | None:
        """uid at offset ``off``, evicting the units there when all may go (idle, used next after uid); else None."""
        need = align(max(nbytes, 1))
        if off + need > self.pool.capacity_bytes:
            return None
        there = [v for v, e in self.entries.items() if e.offset < off + need and off < e.offset + align(max(e.nbytes, 1))]
        mine = self.next_use.after(uid, use_at)
        # a static plan's place is its unit's alone: a unit there that is not at its own home may go whenever idle
        stray = self.plan_kind == "static"
        if any(self.entries[v].kept or v in busy or not (stray and not self._at_home(v) or self.next_use.after(v, now) > mine)
               for v in there):
            return None
        for v in there:
            self.remove(v)
        self.evictions += len(there)
        self._put(uid, nbytes, off)
        return there

    def _at_home(self, uid: int) -> bool:
        """uid is one of a static plan's set, at its planned offset (the rank never gives it up)."""
        return uid in self._home and self.entries[uid].offset == self._home[uid]

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
        n, i = len(segs), 0
        while i < n:  # each stretch of contiguous segments, free or rankable; in it, a window per start
            if segs[i][2] is not None and segs[i][2] not in rank:
                i += 1
                continue
            e = i + 1
            while e < n and segs[e][0] == segs[e - 1][1] and (segs[e][2] is None or segs[e][2] in rank):
                e += 1
            low: collections.deque[int] = collections.deque()  # victims of [l, j) by rising rank
            j, nb = i, 0
            for left in range(i, e):
                while j < e and segs[j - 1][1] - segs[left][0] < need if j > left else j < e:
                    v = segs[j][2]
                    if v is not None:
                        while low and rank[segs[low[-1]][2]] >= rank[v]:
                            low.pop()
                        low.append(j)
                        nb += self.entries[v].nbytes
                    j += 1
                if j > left and segs[j - 1][1] - segs[left][0] >= need:
                    key = (rank[segs[low[0]][2]] if low else math.inf, -nb)
                    if best is None or key > best[0]:
                        best = (key, segs[left][0], [segs[k][2] for k in range(left, j) if segs[k][2] is not None])
                else:
                    break  # no window from here to the stretch's end is long enough
                v = segs[left][2]
                if v is not None:
                    nb -= self.entries[v].nbytes
                    if low and low[0] == left:
                        low.popleft()
            i = e
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


def _evenly(items: list[int], n: int) -> list[int]:
    """n of ``items``, spread evenly through them."""
    return [items[(2 * i + 1) * len(items) // (2 * n)] for i in range(n)] if n > 0 else []


def _knapsack(kinds: dict[tuple[int, int], int], capacity: int, steps: int = 4096) -> dict[tuple[int, int], int]:
    """How many units of each kind (uses, bytes) to take, of the ``kinds[k]`` there are, for the most
    uses x bytes within ``capacity``: a bounded knapsack on a grid of capacity/``steps`` (sizes rounded
    up to it, so what it takes always fits), each kind split in powers of two."""
    if capacity <= 0 or not kinds:
        return {}
    grain = FILE_ALIGN * -(-capacity // (FILE_ALIGN * steps))  # whole pages: a small cache's grid is exact
    cells = capacity // grain
    pieces = []
    for k, n in kinds.items():
        c = 1
        while n > 0:
            pieces.append((k, min(c, n)))
            n -= min(c, n)
            c *= 2
    best = [0] * (cells + 1)
    took: list[bytearray] = []
    for (uses, nbytes), c in pieces:
        w, v = -(-nbytes * c // grain), uses * nbytes * c
        row = bytearray(cells + 1)
        if w <= cells:
            for x in range(cells, w - 1, -1):
                if best[x - w] + v > best[x]:
                    best[x], row[x] = best[x - w] + v, 1
        took.append(row)
    take: dict[tuple[int, int], int] = {}
    x = max(range(cells + 1), key=best.__getitem__)
    for (k, c), row in zip(reversed(pieces), reversed(took)):
        if row[x]:
            take[k] = take.get(k, 0) + c
            x -= -(-k[1] * c // grain)
    return take
