"""The planner: resident strays, sticky units, the cycle simulator and the measured vram_budget plan."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core import planner
from offload_core.planner import choose, simulate
from offload_core_test_models import CASES, assert_bitwise, assert_traces_equal, infer, make_optimizer, train


# ---------------------------------------------------------------- the simulator
def test_simulate_copy_bound_is_the_sum_of_copies() -> None:
    trace = list(range(8))
    t = simulate(trace, [1.0] * 8, {u: 5.0 for u in trace}, slots=3, prefetch=2)
    # copy-bound: 40 ms of copies a cycle (the ring keeps none of 8 units across cycles)
    assert t == pytest.approx(40.0)


def test_simulate_compute_bound_is_the_sum_of_compute() -> None:
    trace = list(range(8))
    assert simulate(trace, [5.0] * 8, {u: 1.0 for u in trace}, slots=3, prefetch=2) == pytest.approx(40.0)


def test_simulate_without_prefetch_serializes_copy_and_compute() -> None:
    trace = [0, 1, 2, 3, 4, 5]
    serial = simulate(trace, [2.0] * 6, {u: 2.0 for u in trace}, slots=2, prefetch=0)
    piped = simulate(trace, [2.0] * 6, {u: 2.0 for u in trace}, slots=3, prefetch=2)
    assert serial == pytest.approx(24.0)
    assert piped < serial


def test_sticky_and_resident_units_cost_no_copy() -> None:
    trace = list(range(8))
    copy_ms = {u: 5.0 for u in trace}
    base = simulate(trace, [1.0] * 8, copy_ms, slots=3, prefetch=2)
    sticky = simulate(trace, [1.0] * 8, copy_ms, slots=3, prefetch=2, sticky={1})
    resident = simulate(trace, [1.0] * 8, {u: 5.0 for u in trace if u != 1}, slots=3, prefetch=2)
    assert sticky == pytest.approx(base - 5.0)
    assert resident == pytest.approx(sticky)


def test_more_slots_turn_the_training_turnaround_into_hits() -> None:
    # forward 0..5, then backward 5..0: the last units of one pass are the first of the next
    trace = list(range(6)) + list(reversed(range(6)))
    copy_ms = {u: 4.0 for u in range(6)}
    spans = [1.0] * 6 + [6.0] * 6
    three = simulate(trace, spans, copy_ms, slots=3, prefetch=2)
    six = simulate(trace, spans, copy_ms, slots=6, prefetch=2)
    assert six < three
    assert six == pytest.approx(sum(spans))  # every unit stays: nothing crosses after the first cycle


def test_choose_spends_the_budget_where_it_saves_most() -> None:
    trace = list(range(6)) + list(reversed(range(6)))
    copy_ms = {u: 4.0 for u in range(6)}
    nbytes = {u: 100 for u in range(6)}
    spans = [1.0] * 6 + [6.0] * 6
    res = choose(trace, spans, copy_ms, nbytes, slot_bytes=100, slots=3, prefetch=2, budget=500)
    assert res["used_bytes"] <= 500
    assert res["extra_slots"] + len(res["sticky"]) == 2
    assert res["predicted_ms"] < res["start_ms"]
    assert res["predicted_ms"] == pytest.approx(
        simulate(trace, spans, copy_ms, 3 + res["extra_slots"], 2, res["sticky"]))
    none = choose(trace, spans, copy_ms, nbytes, slot_bytes=100, slots=3, prefetch=2, budget=300)
    assert none["extra_slots"] == 0 and not none["sticky"]


def test_choose_only_picks_candidates() -> None:
    trace = list(range(8))
    res = choose(trace, [1.0] * 8, {u: 5.0 for u in trace}, {u: 10 for u in trace}, slot_bytes=1000, slots=3,
                 prefetch=2, budget=3020, candidates={2})
    assert res["sticky"] == {2}


# ---------------------------------------------------------------- strays
@pytest.mark.parametrize("name", ["flux", "wan", "sd3"])
def test_resident_strays_stay_bitwise_equal(name: str) -> None:
    case = CASES[name]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    h = enable_offload(off, target_device="cpu", offload_granularity="block", stray_resident_fraction=1.0)
    st = h.stats()
    strays = [u for u in st["units"] if u["stray"]]
    assert strays and not any(u["streamed"] for u in strays)
    assert st["plan"]["stray_resident_bytes"] == sum(u["bytes"] for u in strays)
    assert st["streamed_bytes"] == sum(u["bytes"] for u in st["units"] if not u["stray"])
    assert_bitwise(infer(case, ref), infer(case, off), f"{name} output")
    # strays cross once (never: they were moved at setup); blocks cross every pass
    per_pass = h.stats()["h2d_bytes"] / 3
    assert per_pass <= st["streamed_bytes"]
    h.remove()


def test_strays_stream_when_they_are_too_big_a_share() -> None:
    case = CASES["flux"]
    model = case.build("frozen")
    h = enable_offload(model, target_device="cpu", offload_granularity="block")  # default 5%
    st = h.stats()
    assert st["plan"]["stray_resident_bytes"] == 0
    assert all(u["streamed"] for u in st["units"])
    h.remove()


def test_resident_strays_in_lora_training_stay_bitwise_equal() -> None:
    case = CASES["flux"]
    ref = case.build("adapter", checkpointing=True)
    off = copy.deepcopy(ref)
    opt_r, opt_o = make_optimizer(ref), make_optimizer(off)
    want = train(case, ref, opt_r, steps=4)
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block", optimizer=opt_o, stray_resident_fraction=1.0)
    got = train(case, off, opt_o, steps=4)
    assert mgr.stats()["plan"]["stray_resident_bytes"] > 0
    assert_traces_equal(want, got)
    mgr.remove()


# ---------------------------------------------------------------- sticky units
def test_offload_ratio_sticky_units_load_once() -> None:
    case = CASES["toy"]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    h = enable_offload(off, target_device="cpu", offload_granularity="block", offload_ratio=0.5)
    st = h.stats()
    sticky = [u for u in st["units"] if u["sticky"]]
    assert st["plan"]["sticky_units"] == len(sticky) > 0
    assert_bitwise(infer(case, ref, seeds=(0, 1, 2, 3)), infer(case, off, seeds=(0, 1, 2, 3)), "toy output")
    h.reset_stats()
    infer(case, off, seeds=(4,))
    # after the first pass, only the non-sticky units cross (the ring of 3 keeps none of 10 blocks)
    assert h.stats()["h2d_bytes"] <= h.stats()["streamed_bytes"]
    assert h.stats()["pinned_capacity_bytes"] >= st["streamed_bytes"] + st["sticky_bytes"]
    h.remove()
    for (n, a), (_, b) in zip(ref.state_dict().items(), off.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("name", ["toy", "wan"])
def test_vram_budget_replans_from_measured_times_and_stays_exact(name: str, ckpt: bool) -> None:
    case = CASES[name]
    ref = case.build("adapter", checkpointing=ckpt)
    off = copy.deepcopy(ref)
    opt_r, opt_o = make_optimizer(ref), make_optimizer(off)
    want = train(case, ref, opt_r, steps=6)
    probe_model = copy.deepcopy(ref)
    probe = enable_offload(probe_model, target_device="cpu", offload_granularity="block", treat_as_inference=False)
    train(case, probe_model, make_optimizer(probe_model), steps=3)
    largest, total, slots = probe.stats()["slot_bytes"], probe.stats()["streamed_bytes"], probe.stats()["slot_count"]
    probe.remove()
    # the ring (3 slots, 4 on Wan, whose root-anchored table holds one), and half the streamed bytes
    budget = slots * largest + total // 2
    mgr = OffloadTrainingManager(off, "cpu", offload_granularity="block", optimizer=opt_o, vram_budget=budget)
    # nothing is spent before the traced steps have measured what the rest of the process needs
    assert mgr.stats()["plan"]["chosen_by"] == "smallest ring" and mgr.stats()["sticky_units"] == 0
    got = train(case, off, opt_o, steps=6)
    st = mgr.stats()
    plan = st["plan"]
    assert plan["chosen_by"] == "measured"
    assert plan["planned_step_ms"] <= plan["unplanned_step_ms"]
    # planned ring slots (a load that finds every slot held by the next uses grows the ring: not planned)
    ring = (st["slot_count"] - st["slot_grows"]) * st["slot_bytes"]
    assert ring + st["sticky_bytes"] <= budget
    assert st["predicted_step_ms"] is not None and st["measured_step_ms"] > 0
    assert_traces_equal(want, got)
    mgr.remove()


def test_cpu_stats_time_copies_and_predict_a_step() -> None:
    case = CASES["toy"]
    model = case.build("frozen")
    h = enable_offload(model, target_device="cpu", offload_granularity="block")
    infer(case, model, seeds=(0, 1, 2, 3))
    st = h.stats()
    assert st["h2d_ms"] > 0 and st["h2d_gbps"] > 0
    assert st["predicted_step_ms"] > 0 and st["measured_step_ms"] > 0
    h.remove()


# ---------------------------------------------------------------- the link rate (issue 29: consumer link tiers)
def _measured_at(gbps: float) -> "planner.Measurements":
    """One traced cycle of 21 units of 200 MB, one long compute window then two short ones, with the
    copy times a ``gbps`` link gives (what replan.measure reads from the timed copies)."""
    n, nbytes = 21, 200_000_000
    trace = tuple(range(n))
    return planner.Measurements(
        trace=trace, spans=tuple(12.0 if i % 3 == 0 else 1.0 for i in trace),
        copy_ms={u: nbytes / (gbps * 1e9) * 1e3 for u in trace}, nbytes={u: nbytes for u in trace},
        slot_bytes=nbytes, slots=3, depth=2, sticky=frozenset(), candidates=frozenset(trace), forced=frozenset(),
        engine_bytes=3 * nbytes, peak_bytes=4 * nbytes, limit_bytes=80 * 10**9)


def test_a_slower_link_grows_a_deeper_ring() -> None:
    """No budget: on a fast link the smallest ring hides every copy; on a slower one the same defaults
    deepen it, so the long compute windows carry the copies of the short ones after them."""
    assert planner.plan_growth(_measured_at(100.0), margin=512 << 20) is None
    plan = planner.plan_growth(_measured_at(50.0), margin=512 << 20)
    assert plan is not None and plan.slots > 3 and plan.depth > 2
    assert plan.predicted_ms < plan.start_ms


def test_a_slower_link_keeps_more_units_sticky_under_a_budget() -> None:
    """Under a vram_budget the same bytes go to a deeper ring on a fast link, and to sticky units once
    the link is slow enough that the copies outrun the compute (then only fewer bytes crossing
    shortens the cycle)."""
    plans = {g: planner.plan_budget(_measured_at(g), 3_000_000_000, grow_depth=True) for g in (50.0, 25.0, 13.0)}
    assert not plans[50.0].sticky and plans[50.0].slots > 3
    assert 0 < len(plans[25.0].sticky) <= len(plans[13.0].sticky), {g: len(p.sticky) for g, p in plans.items()}
    for p in plans.values():
        assert p.predicted_ms < p.start_ms
