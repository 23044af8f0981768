"""compile=True: the repeated blocks compiled once per class, the engine's hooks outside the graph.

Pattern: a tiny diffusers Flux transformer with a peft LoRA, compiled resident (``compile_blocks``,
the same regional compile) against a deepcopy offloaded with ``compile=True`` on the CPU. A prefetch
depth of 1 gives a ring of two slots for four blocks, so every step rebinds every block to a slot
it did not hold before. Inductor's CPU code is deterministic here: outputs and LoRA gradients are
compared bitwise, and torch's own frame counter must not move after the first step.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Iterator

import pytest
import torch

from offload_core import OffloadConfigError, enable_offload
from offload_core.compiled import compile_blocks
from offload_core.quant import fake_quantize
from offload_core_test_models import (CASES, assert_bitwise, assert_traces_equal, inductor_reason, infer,
                                      make_optimizer, train)

STEPS = 20
CASE = CASES["flux"]


@pytest.fixture(scope="module")
def inductor() -> None:
    reason = inductor_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def fresh_dynamo(inductor: None) -> Iterator[None]:
    # Dynamo keeps graphs on the block classes' code objects for the whole process: each test starts
    # from none, so what it counts is its own (inductor's disk cache still saves the codegen).
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _frames() -> int:
    return int(torch._dynamo.utils.counters["frames"]["total"])


# CI runs the checkpointed case (the 20-step, 0-recompile, bitwise acceptance); the rest compile the same
# blocks again for minutes of CPU and run under `pytest -m slow`.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("checkpointing", [pytest.param(False, marks=SLOW), True], ids=["no_ckpt", "ckpt"])
def test_compiled_offload_matches_compiled_resident_without_recompiles(fresh_dynamo: None, checkpointing: bool) -> None:
    a = CASE.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    # the engine first: where the guards let them, later models reuse the graphs it compiled (and counted)
    opt = make_optimizer(b)
    h = enable_offload(b, target_device="cpu", offload_granularity="block", prefetch=1, compile=True)
    rows: list[dict] = []
    frames: list[int] = []

    def record() -> dict:
        rows.append(h.stats())
        frames.append(_frames())
        return rows[-1]

    got = train(CASE, b, opt, steps=STEPS, stats=record)
    compile_blocks(a)
    ref = train(CASE, a, make_optimizer(a), steps=STEPS)
    assert_traces_equal(ref, got)

    assert rows[0]["compiled_blocks"] == 4 and rows[0]["compile_graphs"] >= 2  # two block classes
    assert rows[0]["compile_seconds"] > 0
    # inductor's FX-graph cache looked up for the compiled graphs (a later process finds them there)
    assert rows[0]["compile_cache_hits"] + rows[0]["compile_cache_misses"] >= 1, rows[0]
    assert frames[-1] == frames[0], f"dynamo compiled {frames[-1] - frames[0]} frames after the first step"
    assert rows[-1]["recompiles"] == 0 and rows[-1]["compile_graphs"] == rows[0]["compile_graphs"]
    # the weights really moved: a two-slot ring for four blocks evicts in every step
    evictions = [r["cache_evictions"] for r in rows]
    assert all(n > m for m, n in zip(evictions, evictions[1:])), evictions
    assert rows[-1]["slot_count"] == 2
    if not checkpointing:  # autograd's saved weights are references, as without compile
        assert rows[-1]["saved_refs"] > 0
    h.remove()
    assert all("forward" not in blk.__dict__ for blk in [*b.transformer_blocks, *b.single_transformer_blocks])


@SLOW
def test_a_recompile_after_the_first_step_is_counted(fresh_dynamo: None) -> None:
    # The counter is the acceptance's measure: it must see a recompile when there is one (a new shape).
    model = CASE.build("frozen")
    h = enable_offload(model, target_device="cpu", prefetch=1, compile=True)
    with torch.no_grad():
        CASE.forward(model, CASE.make_inputs(0))
        assert h.stats()["recompiles"] == 0
        inputs = CASE.make_inputs(1)
        inputs["hidden_states"] = torch.randn(1, 32, 4)
        inputs["img_ids"] = torch.randn(32, 3)
        CASE.forward(model, inputs)
    st = h.stats()
    assert st["recompiles"] >= 2 and st["compile_graphs"] >= 4, st
    h.remove()


@SLOW
def test_fp8_storage_compiled_matches_fake_quantized_compiled_resident(fresh_dynamo: None) -> None:
    # fp8 is widened into the slot before the block runs: the graph sees the compute dtype, as resident.
    a = CASE.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    fake_quantize(a, "float8_e4m3fn")
    compile_blocks(a)
    ref = train(CASE, a, make_optimizer(a), steps=4)
    h = enable_offload(b, target_device="cpu", prefetch=1, compile=True, weight_dtype="float8_e4m3fn")
    got = train(CASE, b, make_optimizer(b), steps=4)
    assert_traces_equal(ref, got)
    st = h.stats()
    assert st["staging_bytes"] > 0 and st["recompiles"] == 0
    h.remove()


@SLOW
def test_inference_compiled_matches_and_remove_gives_the_eager_forward_back(fresh_dynamo: None) -> None:
    base = CASE.build("frozen")
    ref = copy.deepcopy(base)
    off = copy.deepcopy(base)
    compile_blocks(ref)
    seeds = (0, 1, 2, 3)
    h = enable_offload(off, target_device="cpu", prefetch=1, compile=True)
    assert_bitwise(infer(CASE, ref, seeds), infer(CASE, off, seeds), "compiled offloaded output")
    assert h.stats()["recompiles"] == 0
    h.remove()
    assert_bitwise(infer(CASE, base, seeds), infer(CASE, off, seeds), "eager output after remove()")


@SLOW
def test_engine_dropped_without_remove_is_collected(fresh_dynamo: None) -> None:
    model = CASE.build("adapter", checkpointing=True)
    opt = make_optimizer(model)
    h = enable_offload(model, target_device="cpu", prefetch=1, compile=True)
    train(CASE, model, opt, steps=2)
    engine, block = weakref.ref(h.engine), weakref.ref(model.transformer_blocks[0])
    del h, model, opt
    gc.collect()
    assert engine() is None, "the engine outlived its model (a compiled graph or callback holds it)"
    assert block() is None, "a compiled block outlived its model (dynamo's cache holds it)"


@pytest.mark.parametrize("keys,match", [
    (dict(offload_granularity="leaf"), "offload_granularity leaf"),
    (dict(offload_granularity="phase"), "offload_granularity phase"),
    (dict(split_threshold_mb=0.001), "split_threshold_mb"),
    (dict(compile="yes"), "compile: expected true or false"),
])
def test_compile_refuses_what_would_hook_inside_the_graph(keys: dict, match: str) -> None:
    model = CASE.build("frozen")
    with pytest.raises(OffloadConfigError, match=match):
        enable_offload(model, target_device="cpu", **{"compile": True, **keys})
    assert all(p.numel() > 0 for p in model.parameters()), "a refused config touched the model"


def test_compile_refuses_a_model_without_blocks_and_blocks_compiled_already() -> None:
    toy = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)
    with pytest.raises(OffloadConfigError, match="compile: Sequential has no block list"):
        enable_offload(toy, target_device="cpu", compile=True)
    model = CASE.build("frozen")
    model.transformer_blocks[1].compile()  # what diffusers' compile_repeated_blocks does
    with pytest.raises(OffloadConfigError, match="compile: a FluxTransformerBlock is compiled or patched already"):
        enable_offload(model, target_device="cpu", compile=True)
    assert all(p.numel() > 0 for p in model.parameters())


@SLOW
def test_optimizer_offload_with_compiled_blocks_matches_resident(fresh_dynamo: None) -> None:
    # Streamed trainable LoRA parameters: their .data is the slot view while the block runs, a
    # placeholder between uses; the graph sees the same shape and stride each time.
    from offload_core import OffloadTrainingManager

    a = CASE.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    opt = make_optimizer(b, fused=True)  # what optimizer offload's CPU step computes
    mgr = OffloadTrainingManager(b, "cpu", enable_optimizer_cpu_offload=True, optimizer=opt, prefetch=1, compile=True)
    got = train(CASE, b, opt, steps=6, after_backward=mgr.after_backward)
    assert mgr.stats()["recompiles"] == 0 and mgr.stats()["compile_graphs"] >= 2
    compile_blocks(a)
    assert_traces_equal(train(CASE, a, make_optimizer(a, fused=True), steps=6), got)
    mgr.remove()
