"""Storage dtypes: weights kept and moved in a smaller dtype, widened on the device.

fp8 (``float8_e4m3fn``) uses one fp32 scale per tensor: ``w8 = (w / s).to(fp8)`` with
``s = amax(|w|) / 448``, and is widened as ``w8.to(dtype) * s`` (the product taken in fp32). Every step is exact or
one IEEE rounding, so the CPU and the GPU give the same bits, and ``fake_quantize`` builds the
resident reference an fp8-streamed model must equal bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from .units import Unit

__all__ = ["FP8_MAX", "UnitWidener", "assign_storage", "quantize", "widen", "fake_quantize", "is_lossy", "storage_dtype"]

FP8_MAX = 448.0


def storage_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def assign_storage(units: list[Unit], weight_dtype: str | None) -> bool:
    """Give the eligible tensors of ``units`` their storage dtype and lay the units out again.

    Weights only: buffers (positional tables, running stats) and trainable parameters keep their
    dtype. Returns whether storing rounds any of them (a lossy ``weight_dtype``).
    """
    store = storage_dtype(weight_dtype)
    if store is None:
        return False
    for u in units:
        for ts in u.tensors:
            if ts.is_param and not ts.trainable and eligible(ts.tensor(), store):
                ts.store_dtype = store
        u.layout()
    return any(is_lossy(ts.dtype, ts.store_dtype) for u in units for ts in u.tensors)


def is_lossy(dtype: torch.dtype, store: torch.dtype | None) -> bool:
    """Whether storing ``dtype`` values as ``store`` rounds them (fp8, or any narrower float)."""
    if store is None or store == dtype:
        return False
    # widening into a float of more bits and a wider exponent is exact (bf16/fp16 -> fp32)
    return not (store in (torch.float32, torch.float64) and torch.finfo(store).bits > torch.finfo(dtype).bits)


def quantize(w: torch.Tensor, store: torch.dtype, out: torch.Tensor | None = None,
             chunk: int = 1 << 22) -> tuple[torch.Tensor, float | None]:
    """w in the storage dtype (written into ``out`` when given), and its scale (fp8 only).

    fp8 goes through one reused fp32 buffer of ``chunk`` elements rather than an fp32 copy of the
    whole weight: the same arithmetic (``w.float() / s``, rounded to fp8), a fraction of the memory
    traffic and page faults, which is what packing a model's gigabytes costs.
    """
    w = w.detach()
    q = torch.empty(w.shape, dtype=store) if out is None else out
    if store is not torch.float8_e4m3fn:
        q.copy_(w)
        return q, None
    amax = 0.0
    if w.numel():
        lo, hi = torch.aminmax(w)
        amax = max(abs(float(lo)), abs(float(hi)))
    scale = amax / FP8_MAX if amax > 0 else 1.0
    flat, qf = w.reshape(-1), q.view(-1)
    tmp = torch.empty(min(chunk, flat.numel()), dtype=torch.float32)
    for i in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - i)
        t = tmp[:n]
        t.copy_(flat[i: i + n])
        t.div_(scale)
        qf[i: i + n].copy_(t)
    return q, scale


def widen(stored: torch.Tensor, scale: float | None, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The compute-dtype tensor a stored one stands for (written into out when given)."""
    out = stored.to(dtype) if out is None else out.copy_(stored)
    if scale is not None:
        # fp8 -> dtype is exact; the multiply runs in fp32 (opmath) and rounds once to dtype, on
        # the CPU and the GPU alike, with no fp32 temporary the size of the weight.
        out.mul_(scale)
    return out


def eligible(t: torch.Tensor, store: torch.dtype) -> bool:
    """Floating matrices (and conv kernels) whose dtype differs; norms and biases keep theirs.

    The engine asks only for streamed frozen parameters: trainable ones and buffers (positional
    tables, running stats) are never stored narrower, as ``fake_quantize`` mirrors.
    """
    return t.is_floating_point() and t.dim() >= 2 and t.dtype != store


def fake_quantize(model: nn.Module, weight_dtype: str) -> nn.Module:
    """Round model's eligible weights through the storage dtype in place: the resident reference.

    Mirrors the engine: trainable parameters are skipped, unless no parameter is frozen (an
    inference model, whose weights the engine streams as frozen).
    """
    store = storage_dtype(weight_dtype)
    inference = not any(not p.requires_grad for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            if (inference or not p.requires_grad) and eligible(p, store):
                q, s = quantize(p.data, store)
                p.data.copy_(widen(q, s, p.dtype))
    return model


class UnitWidener:
    """The raw buffers narrow-stored units are copied into, and the kernels that widen them.

    Two raw buffers let the next unit's copy overlap the current one's widening (the engine orders
    them with events). Views of the raw buffers are made once per (unit, buffer); views of a slot
    are made per load, since a cached one would hold the slot's storage and keep it from reuse.
    """

    def __init__(self, units: list[Unit], device: torch.device) -> None:
        nbytes = max((u.store_nbytes for u in units if u.converted), default=0)
        self.raw = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2 if nbytes else 0)]
        self._src: dict[tuple[int, int], tuple] = {}

    def forget(self, uid: int) -> None:
        """uid's stored bytes or scales changed: its cached views and scales are rebuilt on next use."""
        for key in [k for k in self._src if k[0] == uid]:
            del self._src[key]

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() for b in self.raw)

    def widen(self, u: Unit, b: int, buf: torch.Tensor) -> None:
        """Fill the slot buffer ``buf`` from raw buffer ``b``: a few kernels per unit, not two per tensor."""
        if u.widen_plan is not None:
            self._widen_block(u, b, buf)
            return
        src = self._src.get((u.uid, b))
        if src is None:
            raw = self.raw[b]
            srcs = [raw[ts.store_offset: ts.store_offset + ts.store_nbytes].view(ts.store_dtype or ts.dtype).view(ts.shape)
                    for ts in u.tensors]
            scaled_idx = [i for i, ts in enumerate(u.tensors) if ts.scale is not None]
            src = self._src[(u.uid, b)] = (srcs, scaled_idx, [u.tensors[i].scale for i in scaled_idx])
        srcs, scaled_idx, scales = src
        dsts = [buf[ts.offset: ts.offset + ts.nbytes].view(ts.dtype).view(ts.shape) for ts in u.tensors]
        torch._foreach_copy_(dsts, srcs)
        _scale([dsts[i] for i in scaled_idx], scales)

    def _widen_block(self, u: Unit, b: int, buf: torch.Tensor) -> None:
        # The narrow tensors lie first and proportionally (Unit.layout): one conversion kernel for
        # all of them, one byte copy for the rest, one multi-tensor kernel for the scales.
        dtype, store, head, shead, sizes, conv_idx = u.widen_plan
        cached = self._src.get((u.uid, b))
        if cached is None:
            raw = self.raw[b]
            scaled_k = [k for k, i in enumerate(conv_idx) if u.tensors[i].scale is not None]
            cached = self._src[(u.uid, b)] = (
                raw[:shead].view(store), raw[shead: shead + u.nbytes - head], scaled_k,
                [u.tensors[conv_idx[k]].scale for k in scaled_k])
        src, tail, scaled_k, scales = cached
        dst = buf[:head].view(dtype)
        dst.copy_(src)
        if tail.numel():
            buf[head: u.nbytes].copy_(tail)
        if scaled_k:
            parts = dst.split(sizes)  # tensor, gap, tensor, gap, ...: flat views of each tensor
            _scale([parts[2 * k] for k in scaled_k], scales)


def _scale(tensors: list[torch.Tensor], scales: list[float]) -> None:
    """widen()'s arithmetic exactly: the product in fp32 (opmath), rounded once. On CUDA one
    multi-tensor kernel does that; on the CPU _foreach_mul_ with a scalar list rounds
    differently, so there each tensor gets its own mul_."""
    if not tensors:
        return
    if tensors[0].is_cuda:
        torch._foreach_mul_(tensors, scales)
    else:
        for t, s in zip(tensors, scales):
            t.mul_(s)
