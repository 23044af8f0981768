"""Module trees that break naive hook-based offloaders, compared bitwise with resident runs.

Tied weights, a module called twice in one forward, BatchNorm running stats, parameters held by a
non-leaf module, heterogeneous blocks in one ModuleList, and nn.MultiheadAttention.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core_test_models import (
    CASES,
    TREES,
    assert_bitwise,
    assert_state_equal,
    assert_traces_equal,
    infer,
    make_optimizer,
    reference,
    snapshot,
    train,
)

STEPS = 20
GRANULARITIES = ["block", "leaf", "phase"]
CKPT = [pytest.param(False, id="no_ckpt"), pytest.param(True, id="ckpt")]


@pytest.mark.parametrize("granularity", GRANULARITIES + ["auto"])
@pytest.mark.parametrize("name", TREES + ["mha"])
def test_inference_matches_resident(name: str, granularity: str) -> None:
    case = CASES[name]
    a = case.build("frozen")
    b = copy.deepcopy(a)
    before = snapshot(b)
    ref = infer(case, a)
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    got = infer(case, b)
    assert_bitwise(ref, got, f"{name} output")
    handle.remove()
    assert_state_equal(before, b, "weights after remove()")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", TREES + ["mha"])
def test_training_matches_resident(name: str, checkpointing: bool, granularity: str) -> None:
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=STEPS)
    opt = make_optimizer(b)
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    got = train(case, b, opt, steps=STEPS)
    assert_traces_equal(ref, got)
    handle.remove()
    assert_state_equal(ref_state, b, "weights and buffers after training and remove()")


@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", TREES)
def test_manager_split_threshold_matches_resident(name: str, checkpointing: bool) -> None:
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=STEPS)
    opt = make_optimizer(b)
    mgr = OffloadTrainingManager(b, target_device="cpu", cpu_offload_split_threshold=0.001)
    got = train(case, b, opt, steps=STEPS, after_backward=mgr.after_backward)
    assert_traces_equal(ref, got)
    mgr.remove()
    assert_state_equal(ref_state, b, "weights and buffers after training and remove()")


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("checkpointing", CKPT)
def test_batchnorm_running_stats_written_back(checkpointing: bool, granularity: str) -> None:
    case = CASES["batchnorm"]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    initial_mean = a.bn.running_mean.clone()
    steps = 5
    train(case, a, make_optimizer(a), steps=steps)
    assert not torch.equal(a.bn.running_mean, initial_mean), "control: running stats did not change"

    opt = make_optimizer(b)
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    train(case, b, opt, steps=steps)
    # Eval mode reads the running stats: equal outputs mean the updates were written back.
    a.eval()
    b.eval()
    assert_bitwise(infer(case, a), infer(case, b), "eval output after training")
    handle.remove()
    assert torch.equal(b.bn.running_mean, a.bn.running_mean), "model.bn.running_mean not written back"
    assert torch.equal(b.bn.running_var, a.bn.running_var), "model.bn.running_var not written back"
    assert int(b.bn.num_batches_tracked) == int(a.bn.num_batches_tracked)
    for i, (ba, bb) in enumerate(zip(a.blocks, b.blocks)):
        assert torch.equal(bb.bn.running_mean, ba.bn.running_mean), f"blocks.{i}.bn.running_mean not written back"


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_ties_survive_offload_and_remove(granularity: str) -> None:
    case = CASES["tied"]
    model = case.build("adapter", checkpointing=True)
    opt = make_optimizer(model)
    handle = enable_offload(model, target_device="cpu", offload_granularity=granularity)
    train(case, model, opt, steps=2)
    handle.remove()
    assert model.head.weight is model.embed.weight, "embedding/head tie broken"
    assert model.blocks[2].fc1.weight is model.blocks[0].fc1.weight, "cross-block tie broken"
    assert model.head.weight.numel() == 40 * 32


def test_orphan_params_are_not_left_behind() -> None:
    # A parameter on a non-leaf module belongs to its owner's unit: streamed, so a placeholder
    # between uses, never left holding its data.
    case = CASES["orphan_param"]
    model = case.build("frozen")
    handle = enable_offload(model, target_device="cpu", offload_granularity="leaf")
    infer(case, model)
    assert model.pos.data.numel() == 0, "root-level parameter left resident"
    for i, block in enumerate(model.blocks):
        assert block.gate.data.numel() == 0, f"blocks.{i}.gate left resident"
    handle.remove()
    assert model.pos.numel() == 32 and all(blk.gate.numel() == 32 for blk in model.blocks)
