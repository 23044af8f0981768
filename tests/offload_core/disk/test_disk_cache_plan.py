"""The cache's plan: Belady's decisions made at each use (a replay of the trace's cycle), followed by
reads made far ahead of their use. SlabCache on bookkeeping alone (``Runs``), driven the way the
disk store drives it: reads ahead past the cached units, a read the cache does not take goes to a
staging slot and is offered again after its use."""

from __future__ import annotations

import math
import random

import pytest

from offload_core.disk.cache import PLAN_MAX_USES, NextUse, SlabCache
from offload_core.disk.format import align
from offload_core.disk.pool import Runs

PAGE = 4096


def flux_like(turn: int = 4) -> tuple[dict[int, int], list[int]]:
    """19 double blocks 2.4x the size of 38 single ones; a forward, then the backward's recompute in
    reverse less the ``turn`` units the engine keeps on the device across the turn."""
    sizes = {u: (12 if u < 19 else 5) * PAGE for u in range(57)}
    fwd = list(range(57))
    return sizes, fwd + fwd[::-1][turn:]


def cache_for(trace: list[int], sizes: dict[int, int], fraction: float, planned: bool) -> SlabCache:
    cache = SlabCache(0, "belady", pin=False, pool=Runs(int(fraction * sum(sizes.values()))))
    cache.next_use = NextUse(trace)
    if planned:
        cache.sizes = dict(sizes)
    return cache


def drive(cache: SlabCache, trace: list[int], sizes: dict[int, int], staging: int, cycles: int = 5) -> list[int]:
    """Bytes read per cycle. Before each use the reads go ahead in trace order, past the units in memory,
    until ``staging`` reads wait in staging slots (reads the cache took do not count: as in the store)."""
    n, fresh, staged, per_cycle = len(trace), set(), set(), []
    for cycle in range(cycles):
        read = 0
        for i, uid in enumerate(trace):
            p = cycle * n + i
            for q in range(p, p + n):
                if len(staged) > staging:
                    break
                v = trace[q % n]
                if v in cache.entries or v in fresh:
                    continue
                off, _ = cache.admit(v, sizes[v], p - 1, q, set(fresh))
                fresh.add(v)
                read += sizes[v]
                if off is None:
                    staged.add(v)
            fresh.discard(uid)
            if uid in staged:  # the store's move: offered to the cache after its use
                staged.discard(uid)
                cache.admit(uid, sizes[uid], p, p, set(fresh))
            elif uid in cache.entries:
                cache.touch(uid)
        per_cycle.append(read)
    return per_cycle


def planned_bytes(cache: SlabCache, trace: list[int], sizes: dict[int, int]) -> int:
    plan = cache.plan()
    assert plan is not None
    assert cache.plan_bytes == sum(sizes[trace[p]] for p, off in plan.items() if off is None or cache.plan_kind == "belady")
    return cache.plan_bytes


def floor_bytes(trace: list[int], sizes: dict[int, int], cache: SlabCache) -> int:
    """No policy hits more than the cache's bytes a pass (each unit is used once in each of the two)."""
    return sum(sizes[u] for u in trace) - 2 * cache.capacity_bytes


@pytest.mark.parametrize("staging", [0, 2, 4, 8, 16])
@pytest.mark.parametrize("fraction", [0.3, 0.47, 0.6])
def test_reads_far_ahead_read_what_decisions_at_each_use_read(staging: int, fraction: float) -> None:
    sizes, trace = flux_like()
    sequential = drive(cache_for(trace, sizes, fraction, planned=False), trace, sizes, staging=0)
    cache = cache_for(trace, sizes, fraction, planned=True)
    got = drive(cache, trace, sizes, staging)
    assert got[2:] == [planned_bytes(cache, trace, sizes)] * 3  # settled, and every cycle the plan's bytes
    assert got[-1] <= sequential[-1]  # what Belady at each use reads (no read-ahead): the plan is that replay
    assert cache.planned > 0


def test_without_the_plan_reads_far_ahead_read_more() -> None:
    """What the plan is for: the rank at the read, with fewer idle units to choose from than at the use,
    gave up units needed soon (these figures are what the driver shows without it)."""
    sizes, trace = flux_like()
    rank = drive(cache_for(trace, sizes, 0.47, planned=False), trace, sizes, staging=8)
    cache = cache_for(trace, sizes, 0.47, planned=True)
    plan = drive(cache, trace, sizes, staging=8)
    assert min(rank[2:]) > plan[-1]


def test_a_cycle_that_fits_is_all_hits_and_plans_no_reads() -> None:
    sizes, trace = flux_like()
    cache = cache_for(trace, sizes, 1.0, planned=True)
    cache.plan()
    assert cache.plan_bytes == 0
    assert drive(cache, trace, sizes, staging=4)[1:] == [0] * 4


@pytest.mark.parametrize("fraction", [0.3, 0.47, 0.6])
def test_the_static_set_reads_the_floor_where_the_replay_does_not(fraction: float) -> None:
    """A forward and a backward in reverse: Belady's set turns with the passes, and its units' two
    sizes leave room unfilled as it turns; a fixed set that fills the cache reads the floor, give or
    take the room no set fills (less than a double block a pass)."""
    sizes, trace = flux_like()
    cache = cache_for(trace, sizes, fraction, planned=True)
    replay = cache._replay()
    assert replay is not None
    got = drive(cache, trace, sizes, staging=8)
    floor = floor_bytes(trace, sizes, cache)
    assert cache.plan_kind == "static" and got[-1] == cache.plan_bytes < replay[1]
    assert got[-1] - floor < 2 * sizes[0]
    kept_set = {trace[p] for p, off in cache.plan().items() if off is not None}
    assert kept_set == set(cache.entries)  # the set is what stays, every cycle
    doubles = sorted(u for u in kept_set if u < 19)
    assert doubles and doubles != list(range(len(doubles)))  # spread through the trace, not its first units


def test_the_replay_is_chosen_where_it_reads_less() -> None:
    """A trace where a unit's uses cluster: one of two phases reuses units the other never touches.
    A fixed set must split the cache between the phases; Belady's set turns with them."""
    sizes = {u: 4 * PAGE for u in range(8)}
    phase_a = [0, 1, 2, 3] * 3
    phase_b = [4, 5, 6, 7] * 3
    trace = phase_a + phase_b
    cache = cache_for(trace, sizes, 0.5, planned=True)
    cache.plan()
    assert cache.plan_kind == "belady"
    got = drive(cache, trace, sizes, staging=0, cycles=4)
    assert got[-1] == cache.plan_bytes < cache._static()[1]


def test_the_plan_follows_the_trace_and_the_kept_units() -> None:
    sizes, trace = flux_like()
    cache = cache_for(trace, sizes, 0.47, planned=True)
    first = cache.plan()
    assert cache.plan() is first  # made once for a trace
    cache.next_use = NextUse(trace, skip=[0, 1])  # learned skips: a new trace object
    second = cache.plan()
    assert second is not first and 0 not in second and 1 not in second
    off, _ = cache.keep(3, sizes[3], set())  # a unit written to stays: the replay plans around it
    third = cache.plan()
    assert third is not second and off is not None
    assert 3 not in {trace[p] for p in third}  # kept: every use a hit
    kept_end = off + align(sizes[3])
    for p, o in third.items():
        if o is not None:
            assert o + align(sizes[trace[p]]) <= off or kept_end <= o, (p, o)  # never planned over it


def test_no_plan_for_other_policies_long_traces_or_no_sizes() -> None:
    sizes, trace = flux_like()
    for policy in ("fifo", "lru"):
        cache = SlabCache(0, policy, pin=False, pool=Runs(sum(sizes.values()) // 2))
        cache.next_use, cache.sizes = NextUse(trace), dict(sizes)
        assert cache.plan() is None
    assert cache_for(trace, sizes, 0.5, planned=False).plan() is None
    long = list(range(PLAN_MAX_USES + 1))
    assert cache_for(long, {u: PAGE for u in long}, 0.5, planned=True).plan() is None
    short = list(range(PLAN_MAX_USES))
    assert cache_for(short, {u: PAGE for u in short}, 0.5, planned=True).plan() is not None


def _scan(cache: SlabCache, need: int, rank: dict[int, float]) -> tuple[tuple[float, int], int, list[int]] | None:
    """The plain scan the window search replaced: from every start, extend until the window is long enough."""
    segs = sorted([(a, b, None) for a, b in cache.pool.free_runs()]
                  + [(e.offset, e.offset + align(max(e.nbytes, 1)), v) for v, e in cache.entries.items()])
    best = None
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
                key = (min((rank[x] for x in victims), default=math.inf), -sum(cache.entries[x].nbytes for x in victims))
                if best is None or key > best[0]:
                    best = (key, start, victims)
                break
    return best


def test_the_window_search_picks_what_a_plain_scan_picks() -> None:
    rng = random.Random(1)
    checked = 0
    for _ in range(200):
        units = rng.randint(5, 60)
        sizes = {u: rng.choice([1, 3, 7, 17]) * PAGE for u in range(units)}
        trace = list(range(units)) + list(reversed(range(units)))
        cache = cache_for(trace, sizes, rng.uniform(0.2, 0.8), planned=False)
        for p, uid in enumerate(trace * 2):
            if uid in cache.entries:
                cache.touch(uid)
                continue
            rank = {v: cache.next_use.after(v, p) for v in cache.entries if rng.random() < 0.8}
            want = _scan(cache, align(sizes[uid]), rank)
            got, evicted = cache._replace(uid, sizes[uid], rank, use_at=p)
            if want is None:
                assert got is None and evicted == []
            else:
                assert sorted(evicted) == sorted(want[2]) and got is not None
                checked += 1
    assert checked > 1000


def test_a_unit_not_at_its_home_gives_way_to_the_static_set() -> None:
    """A unit left in the cache from before the plan (or since replanned) sits where a unit of the fixed set
    belongs; it is used before that unit, so Belady's rule would keep it there, and the set's unit, offered
    again and again, would be streamed or placed by the rank, each time evicting one of its own: the stray
    gives way whenever it is idle."""
    sizes, trace = flux_like()
    cache = cache_for(trace, sizes, 0.47, planned=True)
    plan = cache.plan()
    assert cache.plan_kind == "static"
    home = {trace[p]: off for p, off in plan.items() if off is not None}
    h = max(home, key=trace.index)  # the set's unit used last in the forward
    stray = next(u for u in range(h) if u not in home and sizes[u] == sizes[h])  # used before it, not in the set
    cache._put(stray, sizes[stray], home[h])
    now = trace.index(stray) - 1
    evicted = cache._at(h, sizes[h], home[h], now, trace.index(h), set())
    assert evicted == [stray] and cache.entries[h].offset == home[h]
    assert cache._at(stray, sizes[stray], home[h], now, trace.index(stray), set()) is None  # the set's unit stays
    got = drive(cache, trace, sizes, staging=4, cycles=3)
    assert got[-1] == cache.plan_bytes and all(cache.entries[u].offset == off for u, off in home.items())
