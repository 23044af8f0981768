"""The fused fp8 widening (offload_core/fused_widen.py): its chunk table on the CPU, the Triton kernel
bitwise against the torch path on a GPU (and on the CPU through Triton's interpreter where Triton is
installed: TRITON_INTERPRET=1)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from offload_core import enable_offload
from offload_core.fused_widen import CHUNK, FusedWidener, chunk_table, eligible
from offload_core.quant import UnitWidener

FP8 = "float8_e4m3fn"


class Odd(nn.Module):
    """Blocks of awkward shapes: rows and columns off the 128 tiles and the chunk, a conv kernel, a
    matrix bigger than one chunk, a bias and a norm kept in bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "a": nn.Linear(257, 131), "b": nn.Linear(64, 3 * CHUNK // 64 + 5, bias=False),
            "c": nn.Conv2d(3, 5, 3), "n": nn.LayerNorm(131)}) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            h = blk["n"](blk["a"](x))
            x = x + blk["b"](h[..., :64])[..., :257].sum() * 1e-3 + blk["c"].weight.sum()
        return x


def _units(scaling: str, device: str = "cpu"):
    torch.manual_seed(0)
    m = Odd().to(torch.bfloat16)
    with torch.no_grad():
        m.blocks[0]["a"].weight[3] *= 40  # an outlier row
    h = enable_offload(m, target_device=device, offload_granularity="block", weight_dtype=FP8, fp8_scaling=scaling)
    return h, [u for u in h.engine.streamed if u.converted]


def _widen_both(h, u, fused: FusedWidener, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot bytes of unit u widened by the torch path and by the kernel, from the same slab."""
    plain = UnitWidener([u], torch.device(device), fused=False)
    slab = h.engine.store.acquire(u.uid)
    plain.raw[0][: u.store_nbytes].copy_(slab[: u.store_nbytes])
    h.engine.store.release(u.uid)
    want = torch.zeros(u.nbytes, dtype=torch.uint8, device=device)
    got = torch.zeros_like(want)
    plain.widen(u, 0, want)
    fused.widen(u, plain.raw[0], got)
    return want, got


def _scaled_bytes(u, buf: torch.Tensor) -> list[torch.Tensor]:
    return [buf[t.offset: t.offset + t.nbytes] for t in u.tensors if t.store_dtype is not None]


@pytest.mark.parametrize("scaling", ["row", "block"])
def test_chunk_table_covers_every_scaled_element_once(scaling: str) -> None:
    h, units = _units(scaling)
    for u in units:
        assert eligible(u)
        table = chunk_table(u)
        narrow = [t for t in u.tensors if t.store_dtype is not None]
        assert int(table[:, 2].sum()) == sum(t.numel for t in narrow)
        assert int(table[:, 2].max()) <= CHUNK
        for t in narrow:  # each tensor's chunks tile it from its first element to its last
            mine = table[table[:, 5] == t.scale_offset // 4]
            assert mine[:, 3].tolist() == list(range(0, t.numel, CHUNK))
            assert (mine[:, 0] - mine[:, 3]).unique().tolist() == [t.store_offset]
            assert (mine[:, 6] == (0 if scaling == "row" else t.scale_shape[1])).all()
    h.remove()


def test_tensor_scaled_and_bf16_units_are_not_taken() -> None:
    torch.manual_seed(0)
    h = enable_offload(Odd().to(torch.bfloat16), target_device="cpu", offload_granularity="block",
                       weight_dtype=FP8, fp8_scaling="tensor")
    assert not any(eligible(u) for u in h.engine.streamed)
    h.remove()


def _interpreting() -> bool:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _interpreting(), reason="Triton's CPU interpreter: TRITON_INTERPRET=1 with triton installed")
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_kernel_bitwise_in_the_interpreter(scaling: str) -> None:
    h, units = _units(scaling)
    fused = FusedWidener(torch.device("cpu"))
    for u in units:
        want, got = _widen_both(h, u, fused, "cpu")
        for w, g in zip(_scaled_bytes(u, want), _scaled_bytes(u, got)):
            assert torch.equal(w, g)
    h.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_kernel_bitwise_on_cuda(scaling: str) -> None:
    h, units = _units(scaling, "cuda")
    assert h.engine.widener.fused is not None  # the engine took the kernel
    fused = FusedWidener(torch.device("cuda"))
    for u in units:
        want, got = _widen_both(h, u, fused, "cuda")
        for w, g in zip(_scaled_bytes(u, want), _scaled_bytes(u, got)):
            assert torch.equal(w, g)
    h.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_engine_outputs_equal_with_and_without_the_kernel(scaling: str, monkeypatch) -> None:
    torch.manual_seed(1)
    base = Odd().to(torch.bfloat16)
    x = torch.randn(4, 257, dtype=torch.bfloat16, device="cuda")
    outs, counts = [], []
    for env in ("1", "0"):
        monkeypatch.setenv("OFFLOAD_FUSED_WIDEN", env)
        m = copy.deepcopy(base)
        h = enable_offload(m, target_device="cuda", offload_granularity="block", weight_dtype=FP8, fp8_scaling=scaling)
        with torch.no_grad():
            outs.append([m(x) for _ in range(2)])
        torch.cuda.synchronize()
        counts.append(h.engine.widener.fused_units)
        h.remove()
    assert counts[0] > 0 and counts[1] == 0
    for a, b in zip(*outs):
        assert torch.equal(a, b)
