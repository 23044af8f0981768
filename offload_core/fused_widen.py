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
rounding; for bf16 the kernel rounds the bits itself, NaN to torch's 0x7FC0). tests/offload_core/test_gpu_fused_widen.py compares the two bitwise.

The work is cut into chunks of ``CHUNK`` elements, each inside one tensor; a chunk table (one int64
row a chunk: source and destination element, count, first element within its tensor, columns,
scale base, scale columns) is built once per unit layout on the host and shared by every unit of
the same layout (the 19 double and 38 single blocks of Flux make two tables). Without Triton (a CPU
build of torch), or with OFFLOAD_FUSED_WIDEN=0, the torch path runs.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from .units import Unit

__all__ = ["CHUNK", "FusedWidener", "available", "chunk_table"]

CHUNK = 8192
_COLS = 7  # src, dst, n, first, cols, scale base, scale columns (0: row scaling)
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


def chunk_table(u: Unit) -> torch.Tensor:
    """The (chunks, 7) int64 table of u's scaled tensors (see the module docstring), on the CPU."""
    rows: list[tuple[int, ...]] = []
    for t in u.tensors:
        if t.store_dtype is None:
            continue
        cols = math.prod(t.shape[1:]) if len(t.shape) > 1 else 1
        esize = t.dtype.itemsize
        scols = 0 if len(t.scale_shape) == 1 else t.scale_shape[1]
        for first in range(0, t.numel, CHUNK):
            rows.append((t.store_offset + first, t.offset // esize + first, min(CHUNK, t.numel - first), first,
                         cols, t.scale_offset // 4, scols))
    return torch.tensor(rows, dtype=torch.int64).view(-1, _COLS)


def _signature(u: Unit) -> tuple:
    return tuple((t.store_offset, t.offset, tuple(t.shape), t.scale_offset, tuple(t.scale_shape))
                 for t in u.tensors if t.store_dtype is not None)


class FusedWidener:
    """Chunk tables on the device, one per unit layout, and the launch."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tables: dict[tuple, torch.Tensor] = {}
        self._by_uid: dict[int, torch.Tensor] = {}
        self._scales: dict[int, torch.Tensor] = {}  # raw buffer's data_ptr -> its float32 view

    def forget(self, uid: int) -> None:
        self._by_uid.pop(uid, None)

    def widen(self, u: Unit, raw: torch.Tensor, buf: torch.Tensor) -> None:
        """Write u's scaled tensors into the slot ``buf`` from its stored bytes in ``raw`` (both uint8)."""
        table = self._by_uid.get(u.uid)
        if table is None:
            sig = _signature(u)
            table = self._tables.get(sig)
            if table is None:
                table = self._tables[sig] = chunk_table(u).to(self.device, non_blocking=False)
            self._by_uid[u.uid] = table
        scales = self._scales.get(raw.data_ptr())
        if scales is None:
            scales = self._scales[raw.data_ptr()] = raw[: raw.numel() // 4 * 4].view(torch.float32)
        dtype = next(t.dtype for t in u.tensors if t.store_dtype is not None)
        kernel = _load_kernel()
        bf16 = dtype == torch.bfloat16  # written as its bits (int16), rounded in the kernel
        dst = buf.view(torch.int16 if bf16 else dtype)
        blocked = any(len(t.scale_shape) == 2 for t in u.tensors if t.store_dtype is not None)
        kernel[(table.shape[0],)](raw, scales, dst, table, CHUNK=CHUNK, BF16=bf16, BLOCKED=blocked)


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
    def widen_rows(src_ptr, scale_ptr, dst_ptr, table_ptr, CHUNK: tl.constexpr, BF16: tl.constexpr, BLOCKED: tl.constexpr):
        row = table_ptr + tl.program_id(0) * 7
        src0, dst0, n = tl.load(row), tl.load(row + 1), tl.load(row + 2)
        first, cols, sbase, scols = tl.load(row + 3), tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
        offs = tl.arange(0, CHUNK)
        mask = offs < n
        b = tl.load(src_ptr + src0 + offs, mask=mask, other=0).to(tl.int32)
        # e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m x 2^-9)
        e = (b >> 3) & 15
        m = b & 7
        normal = ((e + 120) << 23) | (m << 20)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
        mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
        x = tl.where((b & 128) != 0, -mag, mag)
        elem = first.to(tl.int32) + offs  # within one tensor: < 2^31, and int32 division is cheap
        c32 = cols.to(tl.int32)
        r = elem // c32
        if BLOCKED:
            sidx = (r // 128) * scols.to(tl.int32) + (elem - r * c32) // 128
        else:
            sidx = r
        s = tl.load(scale_ptr + sbase + sidx, mask=mask, other=1.0)
        y = x * s
        if BF16:  # rounded to nearest even by hand, as torch does (and Triton's interpreter does not)
            bits = y.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            out = tl.where(y != y, 0x7FC0, rounded).to(tl.int16)
        else:
            out = y.to(dst_ptr.dtype.element_ty)
        tl.store(dst_ptr + dst0 + offs, out, mask=mask)

    return widen_rows
