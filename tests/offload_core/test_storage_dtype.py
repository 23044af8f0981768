"""Weights stored and moved in a narrower dtype (fp8 with per-tensor scales, or bf16), widened on the device.

The CPU runs the same path as CUDA: the slab holds the narrow copy, a raw buffer receives it and
the widening fills the slot. The reference is a resident model whose weights went through the
same rounding (``fake_quantize``); the two must agree bit for bit.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from offload_core import LossyStorageWarning, enable_offload
from offload_core.quant import fake_quantize
from offload_core_test_models import CASES, assert_bitwise, infer


@pytest.mark.parametrize("granularity", ["block", "leaf"])
@pytest.mark.parametrize("name", ["toy", "flux", "sd3"])
def test_fp8_storage_matches_fake_quantized_resident(name: str, granularity: str) -> None:
    case = CASES[name]
    base = case.build("frozen")
    off = copy.deepcopy(base)
    ref = fake_quantize(copy.deepcopy(base), "float8_e4m3fn")
    h = enable_offload(off, target_device="cpu", offload_granularity=granularity, weight_dtype="float8_e4m3fn")
    seeds = (0, 1, 2, 3)
    assert_bitwise(infer(case, ref, seeds), infer(case, off, seeds), f"{name} fp8 output")
    st = h.stats()
    # the weight matrices are held in one byte per element (buffers such as SD3's positional table
    # keep their dtype): the arena is smaller than the compute-dtype bytes
    assert st["pinned_used_bytes"] < (0.8 if name != "sd3" else 0.95) * st["streamed_bytes"]
    assert st["staging_bytes"] > 0
    # and the error against the unquantized model is small but not zero
    full = infer(case, base, (0,))[0]
    got = infer(case, off, (0,))[0]
    rel = ((got.double() - full.double()).norm() / full.double().norm()).item()
    assert 0 < rel < 0.25, rel
    # state_dict() while offloaded: the values the model computes with (fp8-rounded, widened)
    for (n, a), (_, b) in zip(ref.state_dict().items(), off.state_dict().items()):
        assert torch.equal(a, b), f"{n}: state_dict() while offloaded must give the widened weights"
    with pytest.warns(LossyStorageWarning, match="float8_e4m3fn") as record:
        h.remove()
    assert len(record) == 1, "remove() warns once, not per tensor"
    for (n, a), (_, b) in zip(ref.state_dict().items(), off.state_dict().items()):
        assert torch.equal(a, b), f"{n}: remove() must give back the widened weights"


def test_bf16_storage_of_an_fp32_model() -> None:
    case = CASES["toy"]
    base = case.build("frozen")
    off = copy.deepcopy(base)
    ref = fake_quantize(copy.deepcopy(base), "bfloat16")
    h = enable_offload(off, target_device="cpu", offload_granularity="block", weight_dtype="bfloat16")
    assert_bitwise(infer(case, ref), infer(case, off), "toy bf16-stored output")
    st = h.stats()
    assert st["pinned_used_bytes"] <= 0.55 * st["streamed_bytes"]
    with pytest.warns(LossyStorageWarning, match="bfloat16"):
        h.remove()


def test_lossless_storage_does_not_warn() -> None:
    case = CASES["toy"]
    model = case.build("frozen").to(torch.bfloat16)
    h = enable_offload(model, target_device="cpu", weight_dtype="float32")  # widening bf16 is exact
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyStorageWarning)
        h.remove()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_fp8_quantize_is_the_plain_formula(dtype: torch.dtype) -> None:
    from offload_core.quant import FP8_MAX, quantize

    torch.manual_seed(0)
    w = (torch.randn(37, 101) * 3).to(dtype)
    w[5, 7] = -50.0  # the amax is a negative number
    scale = w.abs().max().float().item() / FP8_MAX
    want = (w.float() / scale).to(torch.float8_e4m3fn)
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    got, s = quantize(w, torch.float8_e4m3fn, out=out, chunk=64)  # many chunks, a ragged last one
    assert got is out and s == scale
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
