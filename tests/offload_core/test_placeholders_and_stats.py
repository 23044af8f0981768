"""Weights are really let go between uses, remove() restores the model, and stats() adds up."""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core_test_models import (
    CASES,
    assert_bitwise,
    assert_state_equal,
    frozen_param_bytes,
    hook_counts,
    infer,
    make_optimizer,
    snapshot,
    train,
)

STAT_KEYS = {
    "vram_allocated_bytes", "vram_reserved_bytes", "vram_peak_bytes", "pinned_capacity_bytes", "pinned_used_bytes",
    "weight_bytes", "streamed_bytes", "resident_bytes", "h2d_bytes", "h2d_count", "d2h_bytes", "d2h_count",
    "cache_hits", "cache_misses", "cache_evictions", "h2d_gbps", "stall_ms", "prefetch_misses", "num_units",
    "units", "steps",
}
GRANULARITIES = ["block", "leaf", "phase"]
CKPT = [pytest.param(False, id="no_ckpt"), pytest.param(True, id="ckpt")]


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["toy", "flux", "wan", "vae"])
def test_streamed_params_are_placeholders_after_forward(name: str, granularity: str) -> None:
    case = CASES[name]
    model = case.build("frozen")
    handle = enable_offload(model, target_device="cpu", offload_granularity=granularity)
    infer(case, model, seeds=(0,))
    for pname, p in model.named_parameters():
        assert p.data.numel() == 0, f"{pname} holds {p.data.numel()} elements after the forward"
        assert p.data.device.type == "cpu", f"{pname} placeholder on {p.data.device}, not the target device"
    handle.remove()


@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", ["flux", "qwen"])
def test_placeholders_during_lora_training(name: str, checkpointing: bool) -> None:
    case = CASES[name]
    model = case.build("adapter", checkpointing=checkpointing)
    opt = make_optimizer(model)
    mgr = OffloadTrainingManager(model, target_device="cpu")
    trainable = 0
    for _ in range(2):
        train(case, model, opt, steps=1, after_backward=mgr.after_backward)
        for pname, p in model.named_parameters():
            if p.requires_grad:
                trainable += 1
                assert p.data.numel() > 0, f"trainable {pname} is not resident"
            else:
                assert p.data.numel() == 0, f"frozen {pname} holds {p.data.numel()} elements after a step"
    assert trainable > 0
    mgr.remove()


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("name", ["flux", "sd3", "orphan_param", "batchnorm"])
def test_remove_restores_the_model(name: str, granularity: str) -> None:
    case = CASES[name]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    before = snapshot(b)
    hooks_before = hook_counts(b)
    params_before = [(n, p, p.requires_grad) for n, p in b.named_parameters()]

    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    for seed in (0, 1):  # forward, recompute and backward; no optimizer step, so weights stay put
        case.loss(case.forward(b, case.make_inputs(seed)), seed).backward()
    b.zero_grad()
    handle.remove()

    after = [(n, p, p.requires_grad) for n, p in b.named_parameters()]
    assert [n for n, _, _ in after] == [n for n, _, _ in params_before], "parameter names changed"
    for (n, p0, rg0), (_, p1, rg1) in zip(params_before, after):
        assert p1 is p0, f"{n}: Parameter object replaced (optimizers would lose it)"
        assert rg1 == rg0, f"{n}: requires_grad changed"
    assert hook_counts(b) == hooks_before, "hooks left on the model after remove()"
    if name != "batchnorm":  # a training-mode forward legitimately moved BatchNorm's running stats
        assert_state_equal(before, b, "weights after remove()")
    else:
        for key in before:
            if "running" not in key and "num_batches" not in key:
                assert torch.equal(before[key], b.state_dict()[key]), f"{key} changed"
    # Works without the engine, exactly like the untouched copy.
    a.load_state_dict(b.state_dict())
    a.eval()
    b.eval()
    assert_bitwise(infer(case, a), infer(case, b), "output after remove()")


def test_handle_stats_keys_and_types() -> None:
    case = CASES["flux"]
    model = case.build("frozen")
    handle = enable_offload(model, target_device="cpu", offload_granularity="block")
    infer(case, model, seeds=(0,))
    stats = handle.stats()
    assert isinstance(stats, dict)
    missing = STAT_KEYS - stats.keys()
    assert not missing, f"stats() lacks {sorted(missing)}"
    for key in STAT_KEYS - {"units"}:
        assert isinstance(stats[key], (int, float)) and not isinstance(stats[key], bool), f"{key}: {stats[key]!r}"
    assert isinstance(stats["units"], list) and stats["units"]
    for unit in stats["units"]:
        assert {"name", "bytes", "streamed"} <= unit.keys(), unit
    assert stats["num_units"] == len(stats["units"])
    handle.remove()


def test_compute_ms_is_the_busy_time_between_uses() -> None:
    """compute_ms comes from the spans the planner measures (one use to the next within a cycle,
    counted for the unit used first), so binding records no events of its own; the time between
    two calls (a span that runs into the next cycle) is no unit's compute."""
    import time

    case = CASES["flux"]
    model = case.build("frozen")
    handle = enable_offload(model, target_device="cpu", offload_granularity="block")
    infer(case, model, seeds=(0, 1, 2))
    stats = handle.stats()
    e = handle.engine
    trace = e.schedule.trace
    assert len(trace) > 2 and stats["compute_ms"] > 0
    units = {u["name"]: u for u in stats["units"]}
    assert abs(stats["compute_ms"] - sum(u.get("compute_ms", 0.0) for u in units.values())) < 1e-6
    for uid in trace[:-1]:
        assert units[e.units[uid].name].get("compute_ms", 0.0) > 0, e.units[uid].name
    handle.remove()


def test_compute_ms_leaves_out_the_time_between_calls_of_any_length() -> None:
    """A shorter call (half the blocks) ends at an earlier trace position: the pause after it is still
    no unit's compute, and the total never falls when the trace is learned again."""
    import time

    class Half(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

        def forward(self, x: torch.Tensor, n: int = 4) -> torch.Tensor:
            for b in self.blocks[:n]:
                x = b(x)
            return x

    model = Half().requires_grad_(False)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", timing_every=1)
    x = torch.randn(2, 64)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        before = handle.stats()["compute_ms"]
        t0 = time.perf_counter()
        totals = []
        for n in (2, 2, 4, 4):
            model(x, n)
            totals.append(handle.stats()["compute_ms"])
            time.sleep(0.2)  # the host between two calls
        calls_ms = (time.perf_counter() - t0) * 1e3 - 4 * 200
    assert before > 0 and all(b >= a for a, b in zip([before] + totals, totals)), (before, totals)
    assert totals[-1] - before <= calls_ms, (totals[-1] - before, calls_ms)  # no pause counted
    handle.remove()


def test_a_settled_engine_times_one_step_in_timing_every() -> None:
    """The first three steps (and every step while the planner decides) are timed, then one in
    timing_every: the untimed ones record nothing, and each timed one's readings stand for it and
    the untimed steps before it."""
    case = CASES["flux"]
    ref_model = case.build("frozen")
    model = copy.deepcopy(ref_model)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", timing_every=4)
    e = handle.engine
    seeds = tuple(range(12))
    want = infer(case, ref_model, seeds=seeds)
    got, stall, timed = [], [], []
    for s in seeds:
        got += infer(case, model, seeds=(s,))
        st = handle.stats()
        stall.append(st["stall_ms"])
        timed.append(st["timed_steps"])
        assert not e.timing.pending
    assert_bitwise(want, got, "output")
    # steps 1-4 timed (the first three, then 4 % 4), then 8 and 12
    assert timed == [1, 2, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6]
    assert stall[4:7] == [stall[3]] * 3 and stall[8:11] == [stall[7]] * 3  # untimed steps read nothing
    uses = len(e.schedule.trace)
    assert e.timing.counts["stall"] == 12 * uses  # 1+1+1+1 + 4 + 4 steps' worth of uses
    assert e.timing.counts["cycle"] == 8  # step 12's cycle ends with the next call
    assert st["h2d_gbps"] > 0 and st["h2d_ms"] > 0
    handle.remove()


def test_manager_stats_has_the_handle_keys() -> None:
    case = CASES["flux"]
    model = case.build("adapter")
    opt = make_optimizer(model)
    mgr = OffloadTrainingManager(model, target_device="cpu")
    train(case, model, opt, steps=1, after_backward=mgr.after_backward)
    stats = mgr.stats()
    missing = STAT_KEYS - stats.keys()
    assert not missing, f"manager.stats() lacks {sorted(missing)}"
    assert stats["h2d_bytes"] > 0
    mgr.remove()


ACCOUNTING = [pytest.param(n, g, id=f"{n}-{g}") for n in ["toy", "flux", "sd3", "wan", "qwen", "vae", "hetero"]
              for g in GRANULARITIES]


def _offloaded_stats(name: str, granularity: str, passes: int = 1) -> tuple[torch.nn.Module, object, dict]:
    case = CASES[name]
    model = case.build("frozen")
    handle = enable_offload(model, target_device="cpu", offload_granularity=granularity)
    infer(case, model, seeds=tuple(range(passes)))
    return model, handle, handle.stats()


@pytest.mark.parametrize("name,granularity", ACCOUNTING)
def test_unit_bytes_add_up(name: str, granularity: str) -> None:
    model, handle, s = _offloaded_stats(name, granularity)
    frozen = frozen_param_bytes(CASES[name].build("frozen"))
    assert s["h2d_bytes"] > 0 and s["h2d_count"] > 0
    assert s["streamed_bytes"] >= frozen, f"streamed {s['streamed_bytes']} < frozen parameter bytes {frozen}"
    assert s["streamed_bytes"] + s["resident_bytes"] == s["weight_bytes"]
    streamed_units = [u for u in s["units"] if u["streamed"]]
    assert sum(u["bytes"] for u in streamed_units) == s["streamed_bytes"], "units do not add up to streamed_bytes"
    assert s["pinned_used_bytes"] <= s["pinned_capacity_bytes"]
    handle.remove()


@pytest.mark.parametrize("name,granularity", ACCOUNTING)
def test_arena_capacity_is_exact_size(name: str, granularity: str) -> None:
    # Exact-size packing: host copy within 1% of the streamed bytes plus 64-byte alignment per unit.
    model, handle, s = _offloaded_stats(name, granularity)
    bound = 1.01 * s["streamed_bytes"] + 64 * s["num_units"]
    assert s["pinned_capacity_bytes"] <= bound, (
        f"arena capacity {s['pinned_capacity_bytes']} for {s['streamed_bytes']} streamed bytes "
        f"in {s['num_units']} units (bound {bound:.0f})")
    handle.remove()


@pytest.mark.parametrize("name,granularity", ACCOUNTING)
def test_one_inference_pass_loads_each_unit_at_most_once(name: str, granularity: str) -> None:
    # Pass 1 traces the order, pass 2 starts prefetching across the cycle boundary; pass 3 is steady.
    case = CASES[name]
    model, handle, _ = _offloaded_stats(name, granularity, passes=2)
    before = handle.stats()["h2d_bytes"]
    infer(case, model, seeds=(2,))
    s = handle.stats()
    delta = s["h2d_bytes"] - before
    assert 0 < delta <= s["streamed_bytes"], f"one forward moved {delta} bytes for {s['streamed_bytes']} streamed"
    handle.remove()


@pytest.mark.parametrize("granularity", ["block", "leaf"])
@pytest.mark.parametrize("name", ["toy", "flux", "sd3", "wan", "qwen"])
def test_h2d_per_step_with_checkpointing_at_most_twice_frozen_bytes(name: str, granularity: str) -> None:
    _assert_h2d_per_step(name, granularity, checkpointing=True)


@pytest.mark.parametrize("name", ["toy", "flux", "qwen"])
def test_h2d_per_step_without_checkpointing_at_most_twice_frozen_bytes(name: str) -> None:
    # Without checkpointing the forward loads each weight once and backward re-fetches it once.
    _assert_h2d_per_step(name, "block", checkpointing=False)


def _assert_h2d_per_step(name: str, granularity: str, checkpointing: bool) -> None:
    case = CASES[name]
    model = case.build("adapter", checkpointing=checkpointing)
    frozen = frozen_param_bytes(model)
    opt = make_optimizer(model)
    handle = enable_offload(model, target_device="cpu", offload_granularity=granularity)
    trace = train(case, model, opt, steps=3, stats=handle.stats)  # steps 0-1 warm up (trace, schedule)
    streamed = handle.stats()["streamed_bytes"]
    assert streamed >= frozen
    per_step = trace.h2d_bytes[2] - trace.h2d_bytes[1]
    assert per_step > 0
    assert per_step <= 2.05 * streamed, (
        f"{per_step} H2D bytes in one step = {per_step / streamed:.2f}x the {streamed} streamed frozen bytes")
    handle.remove()


def test_split_threshold_splits_units() -> None:
    case = CASES["flux"]
    counts = {}
    largest = {}
    for threshold in (None, 0.01):
        model = case.build("frozen")
        handle = enable_offload(model, target_device="cpu", offload_granularity="block", split_threshold_mb=threshold)
        infer(case, model, seeds=(0,))
        s = handle.stats()
        counts[threshold] = s["num_units"]
        largest[threshold] = max(u["bytes"] for u in s["units"] if u["streamed"])
        handle.remove()
    assert counts[0.01] > counts[None], f"threshold did not split: {counts}"
    assert largest[0.01] < largest[None], f"largest streamed unit did not shrink: {largest}"


def test_enable_remove_enable_again() -> None:
    case = CASES["flux"]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    ref = infer(case, a)
    for granularity in ("block", "leaf"):
        handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
        assert_bitwise(ref, infer(case, b), f"output with the engine installed again ({granularity})")
        handle.remove()
    assert_bitwise(ref, infer(case, b), "output after the second remove()")


@pytest.mark.parametrize("checkpointing", CKPT)
def test_slots_are_free_again_after_lora_steps(checkpointing: bool) -> None:
    # Binding keeps one typed view of each slot; the slot's baseline use count must count it, or
    # no slot would ever look free again and the ring would grow on every load.
    case = CASES["flux"]
    model = case.build("adapter", checkpointing=checkpointing)
    opt = make_optimizer(model)
    mgr = OffloadTrainingManager(model, target_device="cpu", offload_granularity="block", prefetch=1)
    train(case, model, opt, steps=4, after_backward=mgr.after_backward)
    ring = mgr.handle.engine.ring
    assert ring.grows == 0
    assert len(ring.slots) == 2
    assert all(slot.is_free() for slot in ring.slots), [s.index for s in ring.slots if not s.is_free()]
    assert any(slot._typed for slot in ring.slots), "binding no longer goes through the kept typed views"
    mgr.remove()


def test_host_buffers_are_page_aligned_and_exact() -> None:
    from offload_core.hostmem import HostBuffer, host_buffer

    for n in (1, 4095, (2 << 20) + 3, 5 << 20):
        buf, raw = host_buffer(n)
        assert buf.numel() == n and buf.dtype == torch.uint8
        assert buf.data_ptr() % 4096 == 0
        assert raw.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        buf.fill_(7)
        assert int(buf.sum()) == 7 * n
    staging = HostBuffer(3 << 20, pin=False)
    assert staging.tensor.numel() == 3 << 20 and staging.tensor.data_ptr() % 4096 == 0 and not staging.pinned
    staging.close()
