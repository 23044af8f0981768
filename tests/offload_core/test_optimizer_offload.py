"""Optimizer offload: trainable parameters streamed too, an fp32 CPU master, the step on the CPU.

A plain torch AdamW is made on model.parameters() BEFORE the manager; after
`mgr.after_backward()` each trainable param's .data is its CPU master and .grad its CPU gradient.
Compared bitwise with resident training, with gradient accumulation 1 and 4.
"""

from __future__ import annotations

import copy

import pytest
import torch

from offload_core import OffloadTrainingManager
from offload_core_test_models import (
    CASES,
    assert_state_equal,
    assert_traces_equal,
    make_optimizer,
    reference,
    train,
)

STEPS = 20
CKPT = [pytest.param(False, id="no_ckpt"), pytest.param(True, id="ckpt")]
ACCUM = [pytest.param(1, id="accum1"), pytest.param(4, id="accum4")]


def _check_masters(model: torch.nn.Module) -> None:
    # Called after optimizer.step(): trainable data and grads live on the CPU in fp32, full size.
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.data.numel() == 0, f"frozen {name} holds {p.data.numel()} elements between uses"


def _run(name: str, mode: str, checkpointing: bool, accum: int, threshold: float | None, steps: int = STEPS,
         overlap: bool = False) -> None:
    case = CASES[name]
    a = case.build(mode, checkpointing=checkpointing)
    b = copy.deepcopy(a)
    ref, ref_state = reference(case, a, mode=mode, checkpointing=checkpointing, steps=steps, accum=accum)

    opt = make_optimizer(b)  # before the manager, on model.parameters()
    extra = dict(optimizer=opt, overlap_optimizer_step=True, gradient_accumulation_steps=accum) if overlap else {}
    mgr = OffloadTrainingManager(b, target_device="cpu", enable_optimizer_cpu_offload=True,
                                 cpu_offload_split_threshold=threshold, **extra)

    def after_backward() -> None:
        mgr.after_backward()
        for pname, p in b.named_parameters():
            if p.requires_grad:
                assert p.data.device.type == "cpu" and p.data.dtype == torch.float32, pname
                assert p.data.shape == dict(a.named_parameters())[pname].shape, f"{pname}: master is not full size"
                assert p.grad is not None and p.grad.device.type == "cpu", f"{pname}: no CPU gradient"

    got = train(case, b, opt, steps=steps, accum=accum, after_backward=after_backward, check=_check_masters)
    assert_traces_equal(ref, got)
    mgr.remove()
    assert_state_equal(ref_state, b, "weights after training and remove()")


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("checkpointing", CKPT)
def test_toy_full_finetune(checkpointing: bool, accum: int) -> None:
    # DiffSynth's documented example: every weight trainable, the optimizer on the CPU.
    _run("toy", "full", checkpointing, accum, threshold=None)


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", ["flux", "sd3", "wan", "qwen"])
def test_diffusers_lora(name: str, checkpointing: bool, accum: int) -> None:
    _run(name, "adapter", checkpointing, accum, threshold=None)


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", ["toy", "flux"])
def test_with_split_threshold(name: str, checkpointing: bool, accum: int) -> None:
    # DiffSynth's split mode crashes on non-leaf units; 0.01 MB forces splitting every block.
    _run(name, "full" if name == "toy" else "adapter", checkpointing, accum, threshold=0.01)


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("checkpointing", CKPT)
@pytest.mark.parametrize("name", ["tied", "called_twice", "batchnorm", "orphan_param", "hetero"])
def test_tricky_tree_full_finetune(name: str, checkpointing: bool, accum: int) -> None:
    _run(name, "full", checkpointing, accum, threshold=0.01 if accum == 4 else None)


@pytest.mark.parametrize("accum", ACCUM)
@pytest.mark.parametrize("name,mode", [("toy", "full"), ("flux", "adapter")])
def test_overlapped_step(name: str, mode: str, accum: int) -> None:
    # Each parameter stepped by the worker as soon as its (last micro-batch) gradient lands; with
    # accumulation 1 the fp32 gradient is read from its staging buffer directly.
    _run(name, mode, False, accum, threshold=None, steps=8, overlap=True)


def test_trainable_bytes_are_streamed() -> None:
    case = CASES["toy"]
    model = case.build("full")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = make_optimizer(model)
    mgr = OffloadTrainingManager(model, target_device="cpu", enable_optimizer_cpu_offload=True)
    train(case, model, opt, steps=1, after_backward=mgr.after_backward)
    stats = mgr.stats()
    assert stats["streamed_bytes"] >= total, f"streamed {stats['streamed_bytes']} < trainable {total} bytes"
    assert stats["d2h_bytes"] > 0 and stats["d2h_count"] > 0, "gradients never moved to the CPU"
    mgr.remove()


def test_optimizer_argument_with_every_param_is_accepted() -> None:
    case = CASES["flux"]
    a = case.build("adapter")
    b = copy.deepcopy(a)
    ref, _ = reference(case, a, mode="adapter", checkpointing=False, steps=3)
    opt = make_optimizer(b)
    mgr = OffloadTrainingManager(b, target_device="cpu", enable_optimizer_cpu_offload=True, optimizer=opt)
    got = train(case, b, opt, steps=3, after_backward=mgr.after_backward)
    assert_traces_equal(ref, got)
    mgr.remove()
