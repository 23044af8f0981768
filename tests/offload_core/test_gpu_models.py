"""The CPU suite's bitwise equalities, on CUDA (``pytest -m gpu``): every tiny diffusers model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from offload_core import OffloadTrainingManager, enable_offload
from offload_core_test_models import CASES, DIFFUSERS_TRAINABLE, make_optimizer

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def _on(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _on(v, device) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on(v, device) for v in x)
    return x


@pytest.mark.parametrize("granularity", ["block", "leaf"])
@pytest.mark.parametrize("name", ["toy", "flux", "sd3", "wan", "qwen", "vae"])
def test_inference_matches_resident_on_cuda(name: str, granularity: str) -> None:
    case = CASES[name]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    h = enable_offload(off, target_device=CUDA, offload_granularity=granularity)
    with torch.no_grad():
        for seed in (0, 1, 2):
            inputs = _on(case.make_inputs(seed), CUDA)
            assert torch.equal(case.forward(ref, inputs), case.forward(off, inputs)), f"{name} pass {seed}"
    assert h.stats()["streamed_bytes"] > 0
    h.remove()


def _train_side_by_side(name: str, case: Any, ref: Any, off: Any, opt_r: Any, opt_o: Any, mgr: Any, steps: int) -> None:
    """Resident and offloaded, step by step on the same inputs: every loss equal bit for bit."""
    for step in range(steps):
        inputs = _on(case.make_inputs(1000 + step), CUDA)
        losses = []
        for model, opt, after in ((ref, opt_r, None), (off, opt_o, mgr.after_backward)):
            loss = case.forward(model, inputs).float().pow(2).mean()
            loss.backward()
            if after is not None:
                after()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses), f"{name} step {step}: {losses[0].item()} != {losses[1].item()}"


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("name", DIFFUSERS_TRAINABLE)
def test_lora_training_matches_resident_on_cuda(name: str, ckpt: bool) -> None:
    case = CASES[name]
    ref = case.build("adapter", checkpointing=ckpt)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    opt_r, opt_o = make_optimizer(ref), make_optimizer(off)
    mgr = OffloadTrainingManager(off, CUDA, offload_granularity="block", optimizer=opt_o)
    _train_side_by_side(name, case, ref, off, opt_r, opt_o, mgr, steps=20)
    mgr.remove()


@pytest.mark.parametrize("name", ["flux", "toy"])
def test_planner_residency_matches_resident_on_cuda(name: str) -> None:
    """Resident strays, sticky units and the measured vram_budget plan, bitwise, on CUDA."""
    case = CASES[name]
    ref = case.build("frozen")
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    probe = enable_offload(copy.deepcopy(off), target_device="cpu", offload_granularity="block", stray_resident_fraction=1.0)
    slot, total = probe.stats()["slot_bytes"], probe.stats()["streamed_bytes"]
    probe.remove()
    # The budget bounds the whole process's peak: the resident reference already on the card, 16 MiB
    # for activations, a ring of 2 slots (prefetch 1) and half the rest of the weights.
    budget = torch.cuda.memory_allocated() + (16 << 20) + 2 * slot + max(total - 2 * slot, 0) // 2
    h = enable_offload(off, target_device=CUDA, offload_granularity="block", stray_resident_fraction=1.0,
                       vram_budget=budget, prefetch=1)
    with torch.no_grad():
        for seed in range(6):
            inputs = _on(case.make_inputs(seed), CUDA)
            assert torch.equal(case.forward(ref, inputs), case.forward(off, inputs)), f"{name} pass {seed}"
    st = h.stats()
    assert (st["plan"]["stray_resident_bytes"] > 0) == (name == "flux")  # the toy has no strays
    assert st["plan"]["chosen_by"] == "measured"
    assert st["predicted_step_ms"] > 0
    h.remove()


@pytest.mark.parametrize("ckpt", [False, True])
def test_vram_budget_lora_training_matches_resident_on_cuda(ckpt: bool) -> None:
    case = CASES["wan"]
    ref = case.build("adapter", checkpointing=ckpt)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    opt_r, opt_o = make_optimizer(ref), make_optimizer(off)
    probe = enable_offload(copy.deepcopy(off), target_device="cpu", offload_granularity="block", treat_as_inference=False)
    slot, total = probe.stats()["slot_bytes"], probe.stats()["streamed_bytes"]
    probe.remove()
    # the whole process: the resident reference, 16 MiB for activations, 4 slots (Wan's ring grows
    # one for its root-anchored table) and half the streamed bytes
    budget = torch.cuda.memory_allocated() + (16 << 20) + 4 * slot + total // 2
    mgr = OffloadTrainingManager(off, CUDA, offload_granularity="block", optimizer=opt_o, vram_budget=budget)
    _train_side_by_side("wan", case, ref, off, opt_r, opt_o, mgr, steps=8)
    assert mgr.stats()["plan"]["chosen_by"] == "measured"
    mgr.remove()
