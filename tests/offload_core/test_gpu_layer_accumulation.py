"""Layer-major gradient accumulation on CUDA (accumulation_order="layer", lockstep.py): the LoRA
gradients after K micro-batches match the plain loop on a resident model within 1e-6 relative, and
the weights cross once per optimizer step. Skips without CUDA."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from offload_core import enable_offload
from offload_core_test_models import CASES, trainable_grads

pytestmark = pytest.mark.gpu
CUDA = "cuda"
K = 4


def _inputs(seed: int) -> dict:
    case = CASES["flux"]
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in case.make_inputs(seed).items()}


def _loss_fn(model: torch.nn.Module):
    def loss_fn(seed: int) -> torch.Tensor:
        return _mse(CASES["flux"].forward(model, _inputs(seed)), seed) / K
    return loss_fn


def _mse(out: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 7919)
    return torch.nn.functional.mse_loss(out.float(), torch.randn(out.shape, generator=g).to(CUDA))


def _max_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for name, ga in a.items():
        gb = b[name]
        assert (ga is None) == (gb is None), name
        if ga is not None:
            worst = max(worst, float((ga.double() - gb.double()).abs().max() / ga.double().abs().max().clamp_min(1e-30)))
    return worst


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ckpt", "ckpt"])
def test_layer_major_lora_gradients_on_cuda(no_cudnn_sdp: None, checkpointing: bool) -> None:
    case = CASES["flux"]
    ref = case.build("adapter", checkpointing=checkpointing)
    off = copy.deepcopy(ref)
    ref.to(CUDA)
    handle = enable_offload(off, target_device=CUDA, offload_granularity="block", prefetch=1,
                            accumulation_order="layer")
    opt_r = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    opt_o = torch.optim.AdamW([p for p in off.parameters() if p.requires_grad], lr=1e-3)
    worst, per_step = 0.0, []
    for step in range(3):
        seeds = [1000 + 100 * step + k for k in range(K)]
        fn = _loss_fn(ref)
        for s in seeds:
            fn(s).backward()
        before = handle.stats()["h2d_bytes"]
        handle.accumulate(seeds, _loss_fn(off))
        per_step.append(handle.stats()["h2d_bytes"] - before)
        worst = max(worst, _max_rel(trainable_grads(ref), trainable_grads(off)))
        for opt in (opt_r, opt_o):
            opt.step()
            opt.zero_grad()
        # the next step starts from the same weights, so one step's drift cannot grow into the next
        with torch.no_grad():
            for (n, a), b in zip(ref.named_parameters(), off.parameters()):
                if a.requires_grad:
                    b.copy_(a)
    streamed = handle.stats()["streamed_bytes"]
    print(json.dumps({"max_rel_grad_diff": worst, "h2d_bytes_per_step": per_step, "streamed_bytes": streamed}))
    handle.remove()
    assert worst <= 1e-6, f"LoRA gradients differ by {worst:.3g} relative"
    # forward, then the recompute (or, without checkpointing, backward's re-fetch): twice, not 2K times
    assert per_step[-1] <= 1.1 * 2 * streamed, f"{per_step[-1] / streamed:.2f}x the streamed bytes a step"


def test_parked_activations_on_cuda_are_the_unparked_gradients_bitwise(no_cudnn_sdp: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """park_saved_tensors on CUDA: each block's checkpointed inputs go to pinned host memory on the parking
    stream and come back for the backward; the gradients are the unparked run's bitwise, and the
    activations the K micro-batches keep until the backward leave the device."""
    from offload_core import parking

    monkeypatch.setattr(parking, "PARK_MIN", 4096)  # the test model's block inputs
    case = CASES["flux"]
    base = case.build("adapter", checkpointing=True)
    grads, peaks, parked = [], [], []
    for park in (False, True):
        model = copy.deepcopy(base)
        handle = enable_offload(model, target_device=CUDA, offload_granularity="block", prefetch=1,
                                accumulation_order="layer", park_saved_tensors=park)
        for step in range(2):  # the second step runs the settled plan
            for p in model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            handle.accumulate([1000 + 100 * step + k for k in range(K)], _loss_fn(model))
            torch.cuda.synchronize()
        grads.append(trainable_grads(model))
        peaks.append(torch.cuda.max_memory_allocated())
        parked.append(handle.stats()["parked_bytes"])
        handle.remove()
    print(json.dumps({"peak_bytes": peaks, "parked_bytes": parked}))
    assert _max_rel(grads[0], grads[1]) == 0.0, "parking changed the gradients"
    assert parked[0] == 0 and parked[1] > 0
