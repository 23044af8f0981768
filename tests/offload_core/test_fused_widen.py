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
from offload_core.fused_widen import TILES, FusedWidener, eligible, tile_table
from offload_core.quant import UnitWidener

FP8 = "float8_e4m3fn"


class Odd(nn.Module):
    """Blocks of awkward shapes: rows and columns off the tiles and the 128 x 128 scale blocks, a conv
    kernel, a bias and a norm kept in bf16 (``even``: every width a multiple of 16, the aligned kernel)."""

    def __init__(self, even: bool = False) -> None:
        super().__init__()
        a, b = ((256, 144), (64, 400)) if even else ((257, 131), (64, 389))
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "a": nn.Linear(*a), "b": nn.Linear(*b, bias=False), "c": nn.Conv2d(4, 5, 2) if even else nn.Conv2d(3, 5, 3),
            "n": nn.LayerNorm(a[1])}) for _ in range(3))
        self.width = a[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            h = blk["n"](blk["a"](x))
            x = x + blk["b"](h[..., :64]).sum() * 1e-3 + blk["c"].weight.sum()
        return x


def _units(scaling: str, device: str = "cpu", even: bool = False):
    torch.manual_seed(0)
    m = Odd(even).to(torch.bfloat16)
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


def _assert_kernel_bitwise(h, units, device: str) -> None:
    """Every unit's scaled tensors widened by the kernel equal the torch path's, bit for bit; removes h."""
    fused = FusedWidener(torch.device(device))
    for u in units:
        want, got = _widen_both(h, u, fused, device)
        for w, g in zip(_scaled_bytes(u, want), _scaled_bytes(u, got)):
            assert torch.equal(w, g)
    h.remove()


def _scaled_bytes(u, buf: torch.Tensor) -> list[torch.Tensor]:
    return [buf[t.offset: t.offset + t.nbytes] for t in u.tensors if t.store_dtype is not None]


@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_tile_table_covers_every_scaled_element_once(scaling: str, even: bool) -> None:
    h, units = _units(scaling, even=even)
    tr, tc = TILES[scaling == "block"]
    for u in units:
        assert eligible(u)
        table, aligned = tile_table(u)
        narrow = [t for t in u.tensors if t.store_dtype is not None]
        # offsets lie on 64 bytes: the widths decide (every one in the even model)
        assert aligned == all(t.numel // t.shape[0] % 16 == 0 for t in narrow) and (aligned or not even)
        if aligned:
            table[:, [0, 1, 3, 4]] *= 16
        covered = set()
        for src, dst, nr, nc, stride, sidx, _ in table.tolist():
            assert 0 < nr <= tr and 0 < nc <= tc
            t = next(t for t in narrow if t.store_offset <= src < t.store_offset + t.numel)
            r0, c0 = divmod(src - t.store_offset, stride)
            assert dst == t.offset // 2 + r0 * stride + c0 and c0 + nc <= stride
            want = (r0 // 128) * t.scale_shape[1] + c0 // 128 if scaling == "block" else r0
            assert sidx == t.scale_offset // 4 + want
            if scaling == "block":  # the tile lies inside one 128 x 128 scale block
                assert r0 // 128 == (r0 + nr - 1) // 128 and c0 // 128 == (c0 + nc - 1) // 128
            cells = {src + r * stride + c for r in range(nr) for c in range(nc)}
            assert not cells & covered
            covered |= cells
        assert len(covered) == sum(t.numel for t in narrow)
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
@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_kernel_bitwise_in_the_interpreter(scaling: str, even: bool) -> None:
    h, units = _units(scaling, even=even)
    _assert_kernel_bitwise(h, units, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_kernel_bitwise_on_cuda(scaling: str, even: bool) -> None:
    h, units = _units(scaling, "cuda", even)
    assert h.engine.widener.fused is not None  # the engine took the kernel
    _assert_kernel_bitwise(h, units, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("even", [False, True])
@pytest.mark.parametrize("scaling", ["row", "block"])
def test_engine_outputs_equal_with_and_without_the_kernel(scaling: str, even: bool, monkeypatch) -> None:
    torch.manual_seed(1)
    base = Odd(even).to(torch.bfloat16)
    x = torch.randn(4, base.width, dtype=torch.bfloat16, device="cuda")
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


def test_a_kernel_that_fails_falls_back_to_torch_with_a_warning(monkeypatch) -> None:
    """A Triton that cannot build the kernel (an old one, an unknown card) costs speed, never the run."""
    h, units = _units("row")
    u = units[0]
    plain = UnitWidener([u], torch.device("cpu"), fused=False)
    widener = UnitWidener([u], torch.device("cpu"), fused=False)
    widener.fused = FusedWidener(torch.device("cpu"))

    def broken(*_a, **_k):
        raise RuntimeError("PTX too new for this driver")

    monkeypatch.setattr(widener.fused, "widen", broken)
    slab = h.engine.store.acquire(u.uid)
    for w in (plain, widener):
        w.raw[0][: u.store_nbytes].copy_(slab[: u.store_nbytes])
    h.engine.store.release(u.uid)
    want, got = torch.zeros(u.nbytes, dtype=torch.uint8), torch.zeros(u.nbytes, dtype=torch.uint8)
    plain.widen(u, 0, want)
    with pytest.warns(RuntimeWarning, match="fused kernel failed .*PTX too new"):
        widener.widen(u, 0, got)
    assert widener.fused is None and widener.fused_units == 0
    for w, g in zip(_scaled_bytes(u, want), _scaled_bytes(u, got)):
        assert torch.equal(w, g)
    h.remove()
