"""fp8 storage with per-tensor, per-row and per-128x128-tile scales (``fp8_scaling``).

The row/block scales travel in the unit's slab after its tensors; the widening multiplies by them on
the device. The reference is a resident model rounded by ``fake_quantize`` with the same scaling: the
streamed model must equal it bit for bit, in inference and in LoRA training (losses and gradients),
on shapes that are not multiples of 128 (partial tiles on both sides) and in units whose tensors
mix dtypes (the per-tensor widening path) as well as the one-kernel path.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from offload_core import OffloadConfigError, enable_offload
from offload_core.quant import BLOCK, FP8_MAX, apply_scales, fake_quantize, quantize, scale_shape, widen
from offload_core_test_models import (CASES, Case, assert_bitwise, assert_traces_equal, infer, make_optimizer,
                                      train)

FP8 = "float8_e4m3fn"
SCALINGS = ["tensor", "row", "block"]
# remove() after fp8 warns that the model keeps the rounded weights (test_storage_dtype checks it)
pytestmark = pytest.mark.filterwarnings("ignore::offload_core.LossyStorageWarning")


# ---------------------------------------------------------------- a model with ragged shapes
class RaggedBlock(nn.Module):
    """Widths of 128 + 8 and 2 x 128 + 8: every block has partial tiles on both sides; ``side`` is
    bf16 in an fp32 block, so the unit mixes two (compute, storage) pairs."""

    def __init__(self, d: int = 136, h: int = 264) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)
        self.conv = nn.Conv1d(d, d, kernel_size=3, padding=1)  # (136, 136, 3): 408 columns as 2-D
        self.side = nn.Linear(d, d).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(x)))
        x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
        return x + self.side(x.to(torch.bfloat16)).float()


class RaggedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.adapter_in = nn.Linear(136, 136)
        self.blocks = nn.ModuleList(RaggedBlock() for _ in range(3))
        with torch.no_grad():  # an outlier channel, as real checkpoints have
            self.blocks[1].fc1.weight[7] *= 20
        self.head = nn.Linear(136, 136)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


RAGGED = Case("ragged", RaggedModel, lambda: {"x": torch.randn(2, 5, 136)}, trainable=("adapter_in.",))


# ---------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("shape", [(300, 200), (128, 256), (130, 257), (5, 3), (136, 136, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_scales_are_the_plain_formula(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    w = (torch.randn(shape) * torch.rand(shape[0], *([1] * (len(shape) - 1))) * 4).to(dtype)
    w[1] = 0  # an all-zero row (and, for small shapes, tile): scale 1, not 0
    w2 = w.float().reshape(shape[0], -1)
    rows, cols = w2.shape
    for scaling in ("row", "block"):
        q, s = quantize(w, torch.float8_e4m3fn, scaling=scaling, chunk=64)  # many bands
        assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(shape, scaling)
        if scaling == "row":
            full = s[:, None].expand(rows, cols)
        else:
            full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
        # each group's scale is its amax / 448 (1 for an all-zero group)
        amax = torch.zeros_like(s)
        if scaling == "row":
            amax = w2.abs().amax(1)
        else:
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    amax[i, j] = w2[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max()
        assert torch.equal(s, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
        want_q = (w2 / full).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8).reshape(rows, -1), want_q.view(torch.uint8))
        # widening: fp32 products rounded once, whatever the path (broadcast views or a full scale map)
        got = widen(q, s, dtype)
        assert torch.equal(got.reshape(rows, -1), (q.float().reshape(rows, -1) * full).to(dtype))


def test_finer_scales_keep_an_outlier_channel_from_flattening_the_rest() -> None:
    # e4m3 is a float: one scale for all loses only where the outlier pushes the rest into its
    # subnormals (an amax thousands of times the typical weight)
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    w[3] *= 30000
    err = {}
    for scaling in SCALINGS:
        q, s = quantize(w, torch.float8_e4m3fn, scaling=scaling)
        rest = torch.ones(256, dtype=torch.bool)
        rest[3] = False
        d = widen(q, s, torch.float32)[rest] - w[rest]
        err[scaling] = (d.norm() / w[rest].norm()).item()
    assert err["row"] < 0.5 * err["tensor"] and err["block"] < 0.8 * err["tensor"], err


def test_apply_scales_covers_every_partial_tile() -> None:
    t = torch.ones(2 * BLOCK + 3, BLOCK + 5)
    s = torch.arange(1, 7, dtype=torch.float32).view(3, 2)
    apply_scales(t, s)
    assert torch.equal(t, s.repeat_interleave(BLOCK, 0)[:t.shape[0]].repeat_interleave(BLOCK, 1)[:, :t.shape[1]])


# ---------------------------------------------------------------- the engine, bitwise
@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("name", ["flux", "sd3", "hetero", "mha", "ragged"])
def test_inference_matches_fake_quantized_resident(name: str, scaling: str) -> None:
    case = RAGGED if name == "ragged" else CASES[name]
    base = case.build("frozen")
    off = copy.deepcopy(base)
    ref = fake_quantize(copy.deepcopy(base), FP8, scaling)
    h = enable_offload(off, target_device="cpu", offload_granularity="block", weight_dtype=FP8, fp8_scaling=scaling)
    assert_bitwise(infer(case, ref), infer(case, off), f"{name} fp8 {scaling} output")
    for (n, a), (_, b) in zip(ref.state_dict().items(), off.state_dict().items()):
        assert torch.equal(a, b), f"{n}: state_dict() while offloaded must give the widened weights"
    # row/block scales lie in the slab beside the fp8 bytes (tensor's is a float on the tensor)
    grouped = [t for u in h.engine.streamed for t in u.tensors if t.scale_nbytes]
    assert bool(grouped) == (scaling != "tensor") and all(t.scaling == scaling for t in grouped)
    h.remove()


def test_scales_travel_in_the_slab() -> None:
    """Row scales are stored (and copied) with the unit: the arena grows by 4 bytes a row, no more."""
    model = RaggedModel().requires_grad_(False)
    sizes = {}
    for scaling in ("tensor", "row", "block"):
        h = enable_offload(copy.deepcopy(model), target_device="cpu", offload_granularity="block", weight_dtype=FP8,
                           fp8_scaling=scaling)
        sizes[scaling] = h.stats()["pinned_used_bytes"]
        h.remove()
    rows = sum(m.weight.shape[0] for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d)))
    assert sizes["row"] - sizes["tensor"] == 4 * rows
    assert 0 < sizes["block"] - sizes["tensor"] < sizes["row"] - sizes["tensor"]


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_bounce_ring_carries_the_scales(scaling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import offload_core.bounce as bounce

    monkeypatch.setattr(bounce, "DEFAULT_CHUNK", 4096)
    monkeypatch.delenv(bounce.PINNED_LIMIT_ENV, raising=False)
    base = RAGGED.build("frozen")
    off = copy.deepcopy(base)
    ref = fake_quantize(copy.deepcopy(base), FP8, scaling)
    h = enable_offload(off, target_device="cpu", offload_granularity="block", weight_dtype=FP8, fp8_scaling=scaling,
                       pinned_limit="16KiB", num_copy_threads=2)
    assert h.stats()["host_store"] == "bounce"
    assert_bitwise(infer(RAGGED, ref), infer(RAGGED, off), f"ragged fp8 {scaling} through the ring")
    h.remove()


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("name", ["flux", "ragged", "hetero"])
def test_lora_training_matches_fake_quantized_resident(name: str, scaling: str) -> None:
    case = RAGGED if name == "ragged" else CASES[name]
    a = case.build("adapter", checkpointing=name != "ragged")
    b = copy.deepcopy(a)
    fake_quantize(a, FP8, scaling)  # frozen weights only: the LoRA/adapter keeps its values
    ref = train(case, a, make_optimizer(a), steps=3)
    h = enable_offload(b, target_device="cpu", offload_granularity="leaf", weight_dtype=FP8, fp8_scaling=scaling)
    got = train(case, b, make_optimizer(b), steps=3)
    assert_traces_equal(ref, got)
    h.remove()


def test_load_state_dict_requantizes_with_the_scaling() -> None:
    base = RAGGED.build("frozen")
    other = RaggedModel().requires_grad_(False)  # other weights
    off = copy.deepcopy(base)
    h = enable_offload(off, target_device="cpu", offload_granularity="block", weight_dtype=FP8, fp8_scaling="block")
    off.load_state_dict(other.state_dict())
    ref = fake_quantize(copy.deepcopy(other).eval(), FP8, "block")
    assert_bitwise(infer(RAGGED, ref), infer(RAGGED, off), "after load_state_dict")
    h.remove()


@pytest.mark.parametrize("kwargs, match", [
    ({"weight_dtype": FP8, "fp8_scaling": "channel"}, "fp8_scaling: unknown value 'channel'"),
    ({"weight_dtype": "bfloat16", "fp8_scaling": "row"}, "fp8_scaling: applies to weight_dtype float8_e4m3fn"),
])
def test_bad_scaling_names_the_key(kwargs: dict, match: str) -> None:
    with pytest.raises(OffloadConfigError, match=match):
        enable_offload(nn.Linear(4, 4), target_device="cpu", **kwargs)


# ---------------------------------------------------------------- weights the model holds in fp8 already
def _as_comfy_fp8(model: nn.Module, scaled: bool) -> nn.Module:
    """model's block matrices as a ComfyUI fp8 checkpoint holds them: float8_e4m3fn parameters, and
    with ``scaled`` a one-element ``scale_weight`` beside each (the rest stays bf16)."""
    for m in model.blocks.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, nn.Parameter) and w.dim() >= 2:
            q, s = quantize(w.data, torch.float8_e4m3fn) if scaled else (w.data.to(torch.float8_e4m3fn), None)
            m.weight = nn.Parameter(q, requires_grad=False)
            if scaled:
                m.register_buffer("scale_weight", torch.tensor([s], dtype=torch.float32))
    return model


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scale_weight"])
def test_a_model_already_in_fp8_streams_as_stored(scaled: bool) -> None:
    """No widening on the host: the arena holds the fp8 bytes (half the bf16 ones), the device widens
    them to the model's bf16 (times scale_weight), bitwise what a resident model holding the widened
    weights computes; remove() gives the fp8 parameters back."""
    torch.manual_seed(0)
    base = RaggedModel().to(torch.bfloat16).requires_grad_(False).eval()
    for b in base.blocks:
        b.forward = _bf16_forward.__get__(b)  # the whole model in bf16: no fp32 side path
    fp8 = _as_comfy_fp8(copy.deepcopy(base), scaled)
    ref = copy.deepcopy(base)
    with torch.no_grad():  # the resident reference: the same fp8 weights widened to bf16
        for (n, p), (_, q) in zip(ref.blocks.named_parameters(), fp8.blocks.named_parameters()):
            if q.dtype == torch.float8_e4m3fn:
                mod = fp8.blocks.get_submodule(n.rsplit(".", 1)[0])
                p.copy_(widen(q, float(mod.scale_weight) if scaled else None, torch.bfloat16))
    stored = {n: p.detach().clone() for n, p in fp8.named_parameters() if p.dtype == torch.float8_e4m3fn}
    assert stored
    h = enable_offload(fp8, target_device="cpu", offload_granularity="block")
    x = torch.randn(2, 5, 136, dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = ref(x), fp8(x)
    assert torch.equal(want, got)
    fp8_bytes = sum(p.numel() for p in stored.values())
    st = h.stats()
    # every streamed byte is the fp8 matrices' plus the small bf16 tensors: under half of all-bf16
    assert st["pinned_used_bytes"] < 0.55 * st["streamed_bytes"] and st["pinned_used_bytes"] > fp8_bytes
    h.remove()
    for n, p in fp8.named_parameters():
        if n in stored:
            assert p.dtype == torch.float8_e4m3fn and torch.equal(p.view(torch.uint8), stored[n].view(torch.uint8)), n


def _bf16_forward(self: RaggedBlock, x: torch.Tensor) -> torch.Tensor:
    x = x + self.fc2(F.gelu(self.fc1(x)))
    x = x + self.conv(x.transpose(1, 2)).transpose(1, 2)
    return x + self.side(x)
