"""Training with frozen weights streamed is bitwise the same as training resident.

Pattern: model A (resident, plain CPU) and B = deepcopy(A) with the engine on target_device="cpu";
20 AdamW steps on identical seeded inputs; outputs, losses and every trainable gradient compared
with torch.equal at every step, then the final weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from param_matrix import ckpt_id, matrix
from offload_core_test_models import (
    CASES,
    DIFFUSERS_TRAINABLE,
    assert_state_equal,
    assert_traces_equal,
    make_optimizer,
    reference,
    snapshot,
    train,
)

STEPS = 20
CKPT = [pytest.param(False, id="no_ckpt"), pytest.param(True, id="ckpt")]


def _check_frozen_streamed(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.data.numel() > 0, f"trainable {name} should stay resident, holds a placeholder"
        else:
            assert p.data.numel() == 0, f"frozen {name} holds {p.data.numel()} elements between uses"


def test_harness_is_deterministic_without_engine() -> None:
    # Control: two resident copies agree bitwise, so any difference below is the engine's.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=True)
    b = copy.deepcopy(a)
    ta = train(case, a, make_optimizer(a), steps=3)
    tb = train(case, b, make_optimizer(b), steps=3)
    assert_traces_equal(ta, tb)
    assert any(g is not None and g.abs().sum() > 0 for g in ta.grads[-1].values()), "LoRA got no gradient"


@pytest.mark.parametrize("name,checkpointing,granularity", matrix(
    [DIFFUSERS_TRAINABLE + ["toy"], [False, True], ["block", "leaf", "phase"]],
    {(n, (i + k) % 2 == 0, g) for i, n in enumerate(DIFFUSERS_TRAINABLE + ["toy"])
     for k, g in enumerate(["block", "leaf", "phase"])},  # checkpointing alternates: a pairwise cover
    lambda n, c, g: f"{n}-{ckpt_id(c)}-{g}"))  # the whole matrix under -m slow
def test_lora_training_matches_resident(name: str, checkpointing: bool, granularity: str) -> None:
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=STEPS)

    opt = make_optimizer(b)
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    got = train(case, b, opt, steps=STEPS, check=_check_frozen_streamed)
    assert_traces_equal(ref, got)
    handle.remove()
    assert_state_equal(ref_state, b, "weights after training and remove()")


@pytest.mark.parametrize("granularity", ["block", "leaf"])
def test_reentrant_checkpoint_over_batchnorm_matches_resident(granularity: str) -> None:
    # torch's older default checkpoint (use_reentrant=True) recomputes a block inside backward, outside the
    # root's saved-tensor hooks. At block granularity a BatchNorm's running-stat update, in the same slot as
    # the Linear before it, bumped the version counter every view of that slot shares, and the recompute's
    # saved Linear weight failed autograd's check: "modified by an inplace operation" (frozen weights only;
    # trained ones already went through the hooks).
    case = CASES["batchnorm"]
    a = case.build("adapter", checkpointing=True)
    a.checkpoint_reentrant = True
    b = copy.deepcopy(a)
    ref = train(case, a, make_optimizer(a), steps=4)
    handle = enable_offload(b, target_device="cpu", offload_granularity=granularity)
    got = train(case, b, make_optimizer(b), steps=4, check=_check_frozen_streamed)
    assert_traces_equal(ref, got)
    assert_state_equal(snapshot(a), b, "state_dict() after training, running stats included")
    handle.remove()


@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", DIFFUSERS_TRAINABLE + ["toy"])
def test_manager_with_split_threshold_matches_resident(name: str, checkpointing: bool) -> None:
    # 0.01 MB is below every block of these tiny models, so non-leaf units must be split.
    case = CASES[name]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=STEPS)

    opt = make_optimizer(b)
    mgr = OffloadTrainingManager(b, target_device="cpu", cpu_offload_split_threshold=0.01)
    got = train(case, b, opt, steps=STEPS, after_backward=mgr.after_backward, check=_check_frozen_streamed)
    assert_traces_equal(ref, got)
    mgr.remove()
    assert_state_equal(ref_state, b, "weights after training and remove()")


@pytest.mark.parametrize("checkpointing", CKPT)
def test_manager_default_matches_resident(checkpointing: bool) -> None:
    # The DiffSynth-style entry point with its defaults, no optimizer offload.
    case = CASES["flux"]
    a = case.build("adapter", checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode="adapter", checkpointing=checkpointing, steps=STEPS)

    opt = make_optimizer(b)
    mgr = OffloadTrainingManager(b, target_device="cpu")
    got = train(case, b, opt, steps=STEPS, after_backward=mgr.after_backward, check=_check_frozen_streamed)
    assert_traces_equal(ref, got)
    mgr.remove()
    assert_state_equal(ref_state, b, "weights after training and remove()")
