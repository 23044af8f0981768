"""One kernel a unit for fp8 row/block widening on CUDA: read fp8, multiply by the scale, write the dtype.

The torch path (quant.UnitWidener) widens a row-scaled unit in two passes over the slot: one
conversion kernel (fp8 -> bf16: 1 byte read, 2 written an element) and one broadcast multiply a
tensor (2 read, 2 written). At Flux-dev dims that is ~15 kernels and 7 bytes of device memory
traffic an element, twice a training step, on a stream beside the compute: measured as the
fp8 step's whole excess over the resident one (bench/RESULTS.md). This kernel does one pass, 3 bytes an
element, one launch for every scaled tensor of the unit.

The same bits as the torch path: fp8 -> fp32 is exact (decoded from the byte here, so it needs no
fp8 support in the GPU: sm_80 and sm_86 cards have none), the product is one fp32 multiply, and the
cast to the dtype rounds to nearest even, as torch's mixed-dtype ``mul_`` does (fp32 opmath, one
rounding; for bf16 the kernel rounds the bits itself, NaN to torch's 0x7FC0).
tests/offload_core/test_fused_widen.py compares the two bitwise.

Each program widens one tile of one tensor (the weight seen as rows x columns): row scaling takes
4 x 1024 tiles and one scale per tile row; block scaling 32 x 128 tiles, each inside one 128 x 128
scale block, so one scale per tile. A tile table (one int64 row a tile: source and destination
element, rows, columns, row stride, scale index) is built once per unit layout on the host and
shared by every unit of that layout (Flux's 19 double and 38 single blocks make two). Where every
offset, width and stride is a multiple of 16 (any real model's), the table holds them divided by 16
and the kernel multiplies back, which tells Triton they are: 16-byte loads and stores instead of
one byte at a time. Without Triton (a CPU build of torch), or with OFFLOAD_FUSED_WIDEN=0, the torch
path runs.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .units import Unit

__all__ = ["FusedWidener", "TILES", "available", "eligible", "tile_table"]

# (rows, columns) of a tile: row scaling, block scaling. 4096 elements: 32 a thread at Triton's 4 warps,
# within the registers (8192 chunks of the first kernel were 64 a thread)
TILES = {False: (4, 1024), True: (32, 128)}
_COLS = 7  # src, dst, rows, columns, row stride, scale index, unused
_Q = 16  # the alignment the aligned kernel is told of
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ENV = "OFFLOAD_FUSED_WIDEN"

_kernel: Any = None


def available(device: torch.device) -> bool:
    """Triton imports and the device is CUDA (and OFFLOAD_FUSED_WIDEN is not 0)."""
    if device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    return _load_kernel() is not None


def eligible(u: Unit) -> bool:
    """Every narrow tensor of u is fp8 e4m3 with row scales, or every one with block scales, widening to one float dtype."""
    conv = [t for t in u.tensors if t.store_dtype is not None]
    return bool(conv) and all(t.store_dtype == torch.float8_e4m3fn and t.scale_shape is not None
                              and t.dtype in _DTYPES for t in conv) and len({t.dtype for t in conv}) == 1 \
        and len({len(t.scale_shape) for t in conv}) == 1  # one scaling: row or block, a constant of the launch


def _blocked(u: Unit) -> bool:
    return any(len(t.scale_shape) == 2 for t in u.tensors if t.store_dtype is not None)


def tile_table(u: Unit) -> tuple[torch.Tensor, bool]:
    """The (tiles, 7) int64 table of u's scaled tensors on the CPU, and whether it is aligned (its
    offsets, widths and strides then stored divided by 16)."""
    blocked = _blocked(u)
    tr, tc = TILES[blocked]
    rows: list[tuple[int, ...]] = []
    for t in u.tensors:
        if t.store_dtype is None:
            continue
        nr, cols = t.shape[0], math.prod(t.shape[1:])
        dst = t.offset // t.dtype.itemsize
        for r0 in range(0, nr, tr):
            for c0 in range(0, cols, tc):
                sidx = (r0 // 128) * t.scale_shape[1] + c0 // 128 if blocked else r0
                rows.append((t.store_offset + r0 * cols + c0, dst + r0 * cols + c0, min(tr, nr - r0), min(tc, cols - c0),
                             cols, t.scale_offset // 4 + sidx, 0))
    table = torch.tensor(rows, dtype=torch.int64).view(-1, _COLS)
    aligned = bool(len(rows)) and bool((table[:, [0, 1, 3, 4]] % _Q == 0).all())
    if aligned:
        table[:, [0, 1, 3, 4]] //= _Q
    return table, aligned


def _signature(u: Unit) -> tuple:
    return tuple((t.store_offset, t.offset, tuple(t.shape), t.scale_offset, tuple(t.scale_shape))
                 for t in u.tensors if t.store_dtype is not None)


class FusedWidener:
    """Chunk tables on the device, one per unit layout, and the launch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple, tuple[torch.Tensor, bool, bool]] = {}
        self._by_uid: dict[int, tuple[torch.Tensor, bool, bool]] = {}
        self._scales: dict[int, torch.Tensor] = {}  # raw buffer's data_ptr -> its float32 view

    def forget(self, uid: int) -> None:
        self._by_uid.pop(uid, None)

    def drop_raw(self, raw: torch.Tensor) -> None:
        """A raw buffer being freed: its cached float32 view must not keep its memory."""
        self._scales.pop(raw.data_ptr(), None)

    def widen(self, u: Unit, raw: torch.Tensor, buf: torch.Tensor) -> None:
        """Write u's scaled tensors into the slot ``buf`` from its stored bytes in ``raw`` (both uint8)."""
        got = self._by_uid.get(u.uid)
        if got is None:
            sig = _signature(u)
            got = self._tables.get(sig)
            if got is None:
                table, aligned = tile_table(u)
                got = self._tables[sig] = (table.to(self.device), aligned, _blocked(u))
            self._by_uid[u.uid] = got
        table, aligned, blocked = got
        scales = self._scales.get(raw.data_ptr())
        if scales is None:
            scales = self._scales[raw.data_ptr()] = raw[: raw.numel() // 4 * 4].view(torch.float32)
        dtype = next(t.dtype for t in u.tensors if t.store_dtype is not None)
        bf16 = dtype == torch.bfloat16  # written as its bits (int16), rounded in the kernel
        dst = buf.view(torch.int16 if bf16 else dtype)
        tr, tc = TILES[blocked]
        _load_kernel()[(table.shape[0],)](raw, scales, dst, table, TR=tr, TC=tc, BF16=bf16, BLOCKED=blocked,
                                          ALIGNED=aligned)


def _load_kernel() -> Any:
    global _kernel
    if _kernel is None:
        try:
            _kernel = _build()
        except ImportError:
            _kernel = False
    return _kernel or None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def widen_tiles(src_ptr, scale_ptr, dst_ptr, table_ptr, TR: tl.constexpr, TC: tl.constexpr, BF16: tl.constexpr,
                    BLOCKED: tl.constexpr, ALIGNED: tl.constexpr):
        row = table_ptr + tl.program_id(0) * 7
        src0, dst0, nr = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        nc, stride, sidx = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5)
        if ALIGNED:  # stored divided by 16: multiplied back, Triton knows they are multiples of 16
            src0, dst0, nc, stride = src0 * 16, dst0 * 16, nc * 16, stride * 16
        r = tl.arange(0, TR)[:, None]
        c = tl.arange(0, TC)[None, :]
        mask = (r < nr) & (c < nc)
        at = r * stride + c
        b = tl.load(src_ptr + src0 + at, mask=mask, other=0).to(tl.int32)
        # e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m x 2^-9)
        e = (b >> 3) & 15
        m = b & 7
        normal = ((e + 120) << 23) | (m << 20)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
        mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
        x = tl.where((b & 128) != 0, -mag, mag)
        if BLOCKED:  # the tile lies in one 128 x 128 block: one scale
            s = tl.load(scale_ptr + sidx)
        else:  # one scale a row
            s = tl.load(scale_ptr + sidx + r, mask=r < nr, other=1.0)
        y = x * s
        if BF16:  # rounded to nearest even by hand, as torch does (and Triton's interpreter does not)
            bits = y.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            out = tl.where(y != y, 0x7FC0, rounded).to(tl.int16)
        else:
            out = y.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + dst0 + at, out, mask=mask)

    return widen_tiles
