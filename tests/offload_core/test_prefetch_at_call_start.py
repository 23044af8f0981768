"""When a call of the root module starts, the engine queues the (depth + 1)-th unit of the trace
before the model's own code runs: the end of the last call already loaded the first ``depth``
(the trace wraps), and the slot the last unit held takes the next one, so the copy engine has work
while the host runs the embedders ahead of the first block."""

from __future__ import annotations

import copy

from offload_core import enable_offload
from offload_core_test_models import CASES, assert_bitwise, infer


def test_a_call_starts_with_its_first_depth_plus_one_units_loaded_or_queued() -> None:
    case = CASES["toy"]
    ref = case.build("frozen")
    model = copy.deepcopy(ref)
    want = infer(case, ref, seeds=(0, 1, 2, 3))
    h = enable_offload(model, target_device="cpu")
    e = h.engine
    seen: list[list[int | None]] = []

    def look(module, args):  # runs after the engine's own root hook (that one is prepended)
        if e.schedule.learned:
            seen.append([e.ring.lookup(uid) is not None for uid in e.schedule.trace[: e.schedule.depth + 1]])

    handle = model.register_forward_pre_hook(look)
    got = infer(case, model, seeds=(0, 1, 2, 3))
    handle.remove()
    assert_bitwise(want, got, "output")
    depth = e.schedule.depth
    assert len(e.ring.slots) == depth + 1 and len(set(e.schedule.trace[: depth + 1])) == depth + 1
    assert seen and all(all(s) for s in seen[1:]), seen
    # and they are the call's hits: a call in the steady state loads nothing while it starts
    misses = h.stats()["cache_misses"]
    assert_bitwise(infer(case, ref, seeds=(4,)), infer(case, model, seeds=(4,)), "output")
    assert h.stats()["cache_misses"] == misses
    h.remove()



def _every_slot_prefetched() -> tuple:
    """The toy model offloaded, two calls in (the trace learned), then every slot holding a unit of the
    lookahead, prefetched as a late store allows: (case, ref, model, handle, the lookahead)."""
    case = CASES["toy"]
    ref = case.build("frozen")
    model = copy.deepcopy(ref)
    h = enable_offload(model, target_device="cpu")
    e = h.engine
    assert_bitwise(infer(case, ref, seeds=(0, 1)), infer(case, model, seeds=(0, 1)), "output")
    ahead = e.schedule.upcoming(e.schedule.depth + 1)
    with e.lock:
        for uid in ahead:
            if e.ring.lookup(uid) is None:
                assert e._load(e.units[uid], e._keep(-1), urgent=False) is not None
    return case, ref, model, h, ahead


def test_a_unit_needed_now_takes_the_slot_of_the_unit_needed_last_rather_than_growing_the_ring() -> None:
    """A disk store that cannot serve a prefetch in time leaves the units after it in every slot; the
    unit then needed now takes the slot of the one the trace needs last (its prefetch is redone), so
    the ring keeps its planned size (a grown slot, 650 MiB at Flux-dev size, took the activations'
    memory: an 8 GiB training job on the disk tier ran out of memory at its fifth step)."""
    case, ref, model, h, ahead = _every_slot_prefetched()
    e = h.engine
    depth, trace = e.schedule.depth, e.schedule.trace
    slots = len(e.ring.slots)
    assert slots == depth + 1 and all(e.ring.lookup(uid) is not None for uid in ahead)
    now = next(uid for uid in trace if uid not in ahead)  # a unit no slot holds, needed now
    unused: list[int] = []
    e.store.unuse = unused.append  # the store hears that the prefetch's use is still to come
    with e.lock:
        slot = e._load(e.units[now], e._keep(now), urgent=True)
    assert e.ring.grows == 0 and len(e.ring.slots) == slots
    assert e.ring.lookup(now) is slot and e.ring.lookup(ahead[-1]) is None  # the farthest gave its slot
    assert unused == [ahead[-1]]
    assert all(e.ring.lookup(uid) is not None for uid in ahead[:-1])
    # the evicted unit is loaded again when it is needed: the outputs stay the resident model's
    assert_bitwise(infer(case, ref, seeds=(2, 3)), infer(case, model, seeds=(2, 3)), "output")
    assert e.ring.grows == 0 and len(e.ring.slots) == slots
    h.remove()


def test_a_prefetch_dropped_with_its_slot_at_a_replan_is_handed_back_to_the_store() -> None:
    """A replan that shrinks the ring drops slots; a prefetch in one (loaded, not used since) is acquired again
    for the same use, and the store hears so (a disk store would take that acquire for the unit's next use);
    a used unit dropped is not reported."""
    case, ref, model, h, ahead = _every_slot_prefetched()
    e = h.engine
    prefetched = {uid for uid in ahead if e.ring.lookup(uid).unused}
    assert prefetched
    unused: list[int] = []
    e.store.unuse = unused.append
    with e.lock:
        e.resize_ring(1)
    assert unused and set(unused) <= prefetched
    assert all(e.ring.lookup(uid) is None for uid in unused)
    assert_bitwise(infer(case, ref, seeds=(2,)), infer(case, model, seeds=(2,)), "output")
    h.remove()
