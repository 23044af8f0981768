"""Between two calls of the root module no unit is in use: the engine loads the next call's first
``depth + 1`` units then (the slot the last unit held takes one more), so the copy engine has work
while the host finishes one call and starts the next."""

from __future__ import annotations

import copy

from offload_core import enable_offload
from offload_core_test_models import CASES, assert_bitwise, infer


def test_the_next_calls_first_depth_plus_one_units_are_loaded_between_calls() -> None:
    case = CASES["toy"]
    ref = case.build("frozen")
    model = copy.deepcopy(ref)
    want = infer(case, ref, seeds=(0, 1, 2, 3))
    h = enable_offload(model, target_device="cpu")
    e = h.engine
    got = infer(case, model, seeds=(0, 1, 2, 3))
    assert_bitwise(want, got, "output")
    depth = e.schedule.depth
    first = e.schedule.trace[: depth + 1]
    assert len(e.ring.slots) == depth + 1 and len(set(first)) == depth + 1
    assert all(e.ring.lookup(uid) is not None for uid in first), (first, [s.owner for s in e.ring.slots])
    # and they are the next call's hits: it loads nothing before its (depth + 2)-th unit
    misses = h.stats()["cache_misses"]
    infer(case, model, seeds=(4,))
    assert h.stats()["cache_misses"] == misses
    h.remove()
