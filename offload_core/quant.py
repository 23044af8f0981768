"""Storage dtypes: weights kept and moved in a smaller dtype, widened on the device.

fp8 (``float8_e4m3fn``) stores ``w8 = (w / s).to(fp8)`` with ``s = amax(|w|) / 448`` taken over a
group of elements, and is widened as ``w8.to(dtype) * s`` (the product taken in fp32, rounded once to
dtype). ``fp8_scaling`` picks the group (the weight seen as 2-D: rows = dim 0, the rest flattened):

- ``tensor``: one scale for the whole tensor (a Python float, kept on the UnitTensor and in a shard
  index). One outlier channel flattens every other channel into fp8's few low codes.
- ``row``: one fp32 scale per output channel (dim 0). Widening is one multiply by a (rows, 1) scale.
- ``block``: one fp32 scale per 128 x 128 tile, the last row and column of tiles partial (no
  padding is stored). Widening is a reshape and a multiply, four at most with partial tiles.
  Tiles rather than per-row groups of 128 along dim 1: the same one broadcast multiply, but 0.02%
  extra bytes to copy instead of 3% (one fp32 per 128 elements), and the copy is the floor.

Row and block scales are stored in the unit's slab after its tensors (``UnitTensor.scale_offset``),
so one host-to-device copy carries them and the widening reads them from the raw buffer; host
stores that hand out slabs carry them unchanged, and the shard format writes the slab as it is
(disk/format.py), so the disk tier streams them in the unit's one read. Every step is exact or one IEEE rounding, so the
CPU and the GPU give the same bits, and ``fake_quantize`` builds the resident reference an
fp8-streamed model must equal bit for bit.

``DEFAULT_SCALING`` is ``row``, from the quality measure (bench/fp8_quality.py; bench/RESULTS.md,
"fp8 quality (CPU)"): at Flux-dev widths with outlier channels x20 the output's error against bf16
weights is 7.1% for row, 9.5% for block and 15.8% for tensor (LoRA gradients 11.0%, 11.6%,
17.4%); with plain normal weights all three sit at 5.1-5.4%. Row also costs the fewest extra bytes
after tensor (4 per row: 0.13% at 3072 wide) and the cheapest widening (one broadcast multiply a
tensor). e4m3 is a float, so one scale per tensor loses only where an outlier pushes the rest of the
tensor towards fp8's subnormals; finer scales matter for checkpoints with such channels.

A model that holds fp8 weights already (ComfyUI's fp8 checkpoints, optionally with a per-tensor
``scale_weight``) is streamed as stored (``adopt_native_fp8``): its bytes go to the arena unchanged
and are widened only on the device, to the model's compute dtype (``compute_dtype_of``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from . import fused_widen
from .units import Unit, UnitTensor

__all__ = ["FP8_MAX", "BLOCK", "adopt_native_fp8", "widen_resident_fp8", "compute_dtype_of", "DEFAULT_SCALING", "SCALINGS", "UnitWidener", "assign_storage", "quantize", "widen",
           "fake_quantize", "is_lossy", "pack_into", "stored_value", "scale_shape", "scale_view", "storage_dtype"]

FP8_MAX = 448.0
BLOCK = 128  # block scaling's tile side
FP8_DTYPES = (torch.float8_e4m3fn,)
SCALINGS = ("tensor", "row", "block")
DEFAULT_SCALING = "row"


def storage_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


def scale_shape(shape: tuple[int, ...] | torch.Size, scaling: str) -> tuple[int, ...] | None:
    """The fp32 scales a weight of ``shape`` stores (None: one Python float, per tensor)."""
    if scaling == "tensor":
        return None
    rows = int(shape[0])
    if scaling == "row":
        return (rows,)
    cols = math.prod(int(n) for n in shape[1:])
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def compute_dtype_of(model: nn.Module) -> torch.dtype:
    """The dtype fp8 weights a model holds as stored widen to: that of most of its other frozen
    floating parameter bytes (bf16 norms and biases beside ComfyUI's fp8 matrices; a LoRA trains in
    fp32 beside bf16 weights and does not count), else of all of them, else bfloat16."""
    for frozen_only in (True, False):
        counts: dict[torch.dtype, int] = {}
        for p in model.parameters():
            if p.is_floating_point() and p.dtype not in FP8_DTYPES and not (frozen_only and p.requires_grad):
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel() * p.element_size()
        if counts:
            return max(counts, key=counts.__getitem__)
    return torch.bfloat16


def adopt_native_fp8(units: list[Unit], compute: torch.dtype) -> bool:
    """Weights the model holds in fp8 already are stored as they are (never widened on the host):
    each computes in ``compute``, scaled by its module's ``scale_weight`` where it has one (ComfyUI's
    "scaled fp8"; a one-element tensor). Returns whether there were any."""
    found = False
    for u in units:
        for ts in u.tensors:
            if ts.dtype not in FP8_DTYPES or not ts.is_param or ts.trainable:
                continue
            found = True
            ts.native_dtype, ts.store_dtype, ts.dtype = ts.dtype, ts.dtype, compute
            sw = getattr(ts.module, "scale_weight", None) if ts.attr == "weight" else None
            if isinstance(sw, torch.Tensor) and sw.numel() == 1 and sw.device.type != "meta":
                ts.scale = float(sw.float())
        u.layout()
    return found


def widen_resident_fp8(model: nn.Module, streamed: list[Unit], compute: torch.dtype) -> int:
    """fp8 weights held as stored that the engine does not stream (a block the planner keeps
    resident, a stray) widened once where they are, with their module's ``scale_weight``: nothing
    else would widen them before they compute. Returns how many."""
    moving = {(id(ts.module), ts.attr) for u in streamed for ts in u.tensors}
    done = 0
    for m in model.modules():
        for attr, p in m._parameters.items():
            if p is None or p.dtype not in FP8_DTYPES or (id(m), attr) in moving:  # fp8 never trains
                continue
            sw = getattr(m, "scale_weight", None) if attr == "weight" else None
            scale = float(sw.float()) if isinstance(sw, torch.Tensor) and sw.numel() == 1 and not sw.is_meta else None
            with torch.no_grad():
                p.data = widen(p.data, scale, compute)
            done += 1
    return done


def assign_storage(units: list[Unit], weight_dtype: str | None, scaling: str = "tensor") -> bool:
    """Give the eligible tensors of ``units`` their storage dtype (and fp8 scale layout) and lay the
    units out again.

    Weights only: buffers (positional tables, running stats) and trainable parameters keep their
    dtype. Returns whether storing rounds any of them (a lossy ``weight_dtype``).
    """
    store = storage_dtype(weight_dtype)
    if store is None:
        return False
    for u in units:
        for ts in u.tensors:
            if ts.native_dtype is None and ts.is_param and not ts.trainable and eligible(ts.tensor(), store):
                ts.store_dtype = store
                if store is torch.float8_e4m3fn:
                    ts.scale_shape = scale_shape(ts.shape, scaling)
        u.layout()
    return any(is_lossy(ts.dtype, ts.store_dtype) for u in units for ts in u.tensors if ts.native_dtype is None)


def is_lossy(dtype: torch.dtype, store: torch.dtype | None) -> bool:
    """Whether storing ``dtype`` values as ``store`` rounds them (fp8, or any narrower float)."""
    if store is None or store == dtype:
        return False
    # widening into a float of more bits and a wider exponent is exact (bf16/fp16 -> fp32)
    return not (store in (torch.float32, torch.float64) and torch.finfo(store).bits > torch.finfo(dtype).bits)


def quantize(w: torch.Tensor, store: torch.dtype, out: torch.Tensor | None = None,
             chunk: int = 1 << 22, scaling: str = "tensor",
             scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, float | torch.Tensor | None]:
    """w in the storage dtype (written into ``out`` when given), and its scale (fp8 only): a float
    for ``scaling="tensor"``, else an fp32 tensor of ``scale_shape`` (written into ``scale_out``).

    fp8 goes through one reused fp32 buffer of ``chunk`` elements rather than an fp32 copy of the
    whole weight: the same arithmetic (``w.float() / s``, rounded to fp8), a fraction of the memory
    traffic and page faults, which is what packing a model's gigabytes costs.
    """
    w = w.detach()
    q = torch.empty(w.shape, dtype=store) if out is None else out
    if store is not torch.float8_e4m3fn:
        q.copy_(w)
        return q, None
    if scaling != "tensor":
        return q, _quantize_grouped(w, q, scaling, scale_out, chunk)
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


def _quantize_grouped(w: torch.Tensor, q: torch.Tensor, scaling: str, scale_out: torch.Tensor | None,
                      chunk: int) -> torch.Tensor:
    """Row or block fp8 of ``w`` into ``q``; returns the fp32 scales. Bands of whole rows (of whole
    tile rows for block) go through fp32 at a time, about ``chunk`` elements each."""
    shape = scale_shape(w.shape, scaling)
    scales = torch.empty(shape, dtype=torch.float32) if scale_out is None else scale_out.view(shape)
    if w.numel() == 0:
        scales.fill_(1.0)
        return scales
    w2, q2 = w.reshape(w.shape[0], -1), q.view(q.shape[0], -1)
    rows, cols = w2.shape
    step = max(1, chunk // max(cols, 1))
    if scaling == "block":
        step = max(BLOCK, step // BLOCK * BLOCK)
    nc = scales.shape[1] if scaling == "block" else 1
    for r in range(0, rows, step):
        band = w2[r: r + step].to(torch.float32, copy=True)  # divided in place: never the caller's weight
        if scaling == "row":
            s = band.abs().amax(dim=1) / FP8_MAX
            s = torch.where(s > 0, s, torch.ones_like(s))
            scales[r: r + step] = s
            q2[r: r + step].copy_(band.div_(s[:, None]))
            continue
        # block: pad the band to whole tiles for the amax (zeros change no max), keep only real columns
        n = band.shape[0]
        tiles = -(-n // BLOCK)
        padded = band.new_zeros(tiles * BLOCK, nc * BLOCK)
        padded[:n, :cols] = band
        s = padded.view(tiles, BLOCK, nc, BLOCK).abs().amax(dim=(1, 3)) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        scales[r // BLOCK: r // BLOCK + tiles] = s
        padded.view(tiles, BLOCK, nc, BLOCK).div_(s[:, None, :, None])
        q2[r: r + n].copy_(padded[:n, :cols])
    return scales


def widen(stored: torch.Tensor, scale: float | torch.Tensor | None, dtype: torch.dtype,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """The compute-dtype tensor a stored one stands for (written into out when given)."""
    out = stored.to(dtype) if out is None else out.copy_(stored)
    if isinstance(scale, torch.Tensor):
        apply_scales(out, scale)
    elif scale is not None:
        # fp8 -> dtype is exact; the multiply runs in fp32 (opmath) and rounds once to dtype, on
        # the CPU and the GPU alike, with no fp32 temporary the size of the weight.
        out.mul_(scale)
    return out


def apply_scales(t: torch.Tensor, scales: torch.Tensor) -> None:
    """``t *= scales`` broadcast over rows (``scales`` 1-D) or 128 x 128 tiles (2-D), in place on the
    contiguous ``t``: fp32 products (mixed-dtype opmath) rounded once to t's dtype, a few kernels
    whatever the size (no loop over rows or tiles)."""
    t2 = t.view(t.shape[0], -1)
    if scales.dim() == 1:
        t2.mul_(scales.view(-1, 1))
        return
    rows, cols = t2.shape
    fr, fc = rows // BLOCK, cols // BLOCK  # whole tiles along each side
    r0, c0 = fr * BLOCK, fc * BLOCK
    if fr and fc:
        t2[:r0, :c0].unflatten(1, (fc, BLOCK)).unflatten(0, (fr, BLOCK)).mul_(scales[:fr, :fc].view(fr, 1, fc, 1))
    if fr and c0 < cols:  # the partial column of tiles
        t2[:r0, c0:].unflatten(0, (fr, BLOCK)).mul_(scales[:fr, fc:].view(fr, 1, 1))
    if r0 < rows and fc:  # the partial row of tiles
        t2[r0:, :c0].unflatten(1, (fc, BLOCK)).mul_(scales[fr, :fc].view(1, fc, 1))
    if r0 < rows and c0 < cols:  # the corner tile
        t2[r0:, c0:].mul_(scales[fr, fc:])


def eligible(t: torch.Tensor, store: torch.dtype) -> bool:
    """Floating matrices (and conv kernels) whose dtype differs; norms and biases keep theirs.

    The engine asks only for streamed frozen parameters: trainable ones and buffers (positional
    tables, running stats) are never stored narrower, as ``fake_quantize`` mirrors.
    """
    return t.is_floating_point() and t.dim() >= 2 and t.dtype != store


def fake_quantize(model: nn.Module, weight_dtype: str, fp8_scaling: str | None = None) -> nn.Module:
    """Round model's eligible weights through the storage dtype in place: the resident reference.

    Mirrors the engine: trainable parameters are skipped, unless no parameter is frozen (an
    inference model, whose weights the engine streams as frozen). ``fp8_scaling`` as the engine's
    (None: its default, DEFAULT_SCALING).
    """
    store = storage_dtype(weight_dtype)
    scaling = fp8_scaling or DEFAULT_SCALING
    inference = not any(not p.requires_grad for p in model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            if (inference or not p.requires_grad) and eligible(p, store):
                q, s = quantize(p.data, store, scaling=scaling)
                p.data.copy_(widen(q, s, p.dtype))
    return model


class UnitWidener:
    """The raw buffers narrow-stored units are copied into, and the kernels that widen them.

    Two raw buffers (keys 0 and 1) let the next unit's copy overlap the current one's widening (the
    engine orders them with events). A unit *kept narrow* (``keep``) has a raw buffer of its own
    (key ``("kept", uid)``): its stored bytes are copied in once and widened into a ring slot at each
    use, so the device holds it at its stored size (half, for fp8) and the link carries it no more.
    Views of the raw buffers are made once per (unit, buffer); views of a slot are made per load,
    since a cached one would hold the slot's storage and keep it from reuse.
    """

    def __init__(self, units: list[Unit], device: torch.device, fused: bool | None = None) -> None:
        nbytes = max((u.store_nbytes for u in units if u.converted), default=0)
        self.device = device
        self.raw: dict[Any, torch.Tensor] = {b: torch.empty(nbytes, dtype=torch.uint8, device=device)
                                             for b in range(2 if nbytes else 0)}
        self.kept: dict[int, bool] = {}  # uid kept narrow -> its raw buffer holds its stored bytes
        self._src: dict[tuple, Any] = {}
        # fp8 row/block units on CUDA: one Triton kernel each (fused_widen.py); None: the torch path
        use = fused_widen.available(device) if fused is None else fused
        self.fused = fused_widen.FusedWidener(device) if use and nbytes else None
        self.fused_units = 0  # loads widened by the fused kernel (stats)

    def forget(self, uid: int) -> None:
        """uid's stored bytes or scales changed: its cached views and scales are rebuilt on next use
        (and a unit kept narrow is copied into its raw buffer again)."""
        for key in [k for k in self._src if k[0] == uid]:
            del self._src[key]
        if self.fused is not None:
            self.fused.forget(uid)
        if uid in self.kept:
            self.kept[uid] = False

    # ------------------------------------------------------------------ units kept narrow
    def keep(self, u: Unit) -> None:
        """Give ``u`` (stored narrower) a raw buffer of its own; its next load fills it."""
        if u.uid in self.kept:
            return
        with torch.inference_mode(False):
            self.raw[("kept", u.uid)] = torch.empty(max(u.store_nbytes, 1), dtype=torch.uint8, device=self.device)
        self.kept[u.uid] = False

    def unkeep(self, uid: int) -> None:
        """Free uid's own raw buffer (once the copies queued against it are done: the caller syncs)."""
        if self.kept.pop(uid, None) is None:
            return
        raw = self.raw.pop(("kept", uid))
        for key in [k for k in self._src if k[0] == uid and k[1] == ("kept", uid)]:
            del self._src[key]
        if self.fused is not None:
            self.fused.drop_raw(raw)

    def key(self, uid: int) -> Any:
        """The raw buffer a load of uid copies into: its own when kept narrow, else None (the pair's turn)."""
        return ("kept", uid) if uid in self.kept else None

    @property
    def kept_bytes(self) -> int:
        return sum(self.raw[("kept", uid)].numel() for uid in self.kept)

    @property
    def staging_bytes(self) -> int:
        return sum(self.raw[b].numel() for b in (0, 1) if b in self.raw)

    def widen(self, u: Unit, b: int, buf: torch.Tensor) -> None:
        """Fill the slot buffer ``buf`` from raw buffer ``b``: a few kernels per unit, not two per tensor."""
        if self.fused is not None and self._widen_fused(u, b, buf):
            return
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
        for i, _, s in self._grouped(u, b):
            apply_scales(dsts[i], s)

    def _widen_fused(self, u: Unit, b: int, buf: torch.Tensor) -> bool:
        """One Triton kernel for the scaled fp8 tensors, then the others' bytes as they are; False
        (nothing done) for a unit the kernel does not take."""
        key = (u.uid, b, "fused")
        rest = self._src.get(key)
        if rest is None:
            if not fused_widen.eligible(u):
                self._src[key] = False
                return False
            raw = self.raw[b]
            if u.widen_plan is not None:  # the unscaled tensors lie after the narrow ones, as one byte run
                _, _, head, shead, _, _ = u.widen_plan
                rest = ([], (head, shead, u.nbytes - head))
            else:
                rest = ([(ts.offset, ts.nbytes, raw[ts.store_offset: ts.store_offset + ts.nbytes])
                         for ts in u.tensors if ts.store_dtype is None], None)
            self._src[key] = rest
        elif rest is False:
            return False
        try:
            self.fused.widen(u, self.raw[b], buf)
        except Exception as e:  # a Triton that cannot build or launch it (an old one, an odd card): the torch path
            warnings.warn(f"fp8 widening: the fused kernel failed ({type(e).__name__}: {e}); widening with torch "
                          "from now on", RuntimeWarning, stacklevel=2)
            self.fused = None
            return False
        pieces, tail = rest
        if tail is not None and tail[2]:
            head, shead, n = tail
            buf[head: head + n].copy_(self.raw[b][shead: shead + n])
        if pieces:
            torch._foreach_copy_([buf[o: o + n] for o, n, _ in pieces], [src for _, _, src in pieces])
        self.fused_units += 1
        return True

    def _grouped(self, u: Unit, b: int) -> list[tuple[int, int, torch.Tensor]]:
        """(tensor index, its place among the widened tensors, its row/block scales in raw buffer b):
        the scales came with the unit's bytes."""
        key = (u.uid, b, "scales")
        got = self._src.get(key)
        if got is None:
            raw, conv = self.raw[b], (u.widen_plan[5] if u.widen_plan is not None else [])
            got = self._src[key] = [(i, conv.index(i) if i in conv else -1, scale_view(raw, ts))
                                    for i, ts in enumerate(u.tensors)
                                    if ts.scale_shape is not None and ts.store_dtype is not None]
        return got

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
        grouped = self._grouped(u, b)
        if scaled_k or grouped:
            parts = dst.split(sizes)  # tensor, gap, tensor, gap, ...: flat views of each tensor
            _scale([parts[2 * k] for k in scaled_k], scales)
            for i, k, s in grouped:
                apply_scales(parts[2 * k].view(u.tensors[i].shape), s)


def pack_into(store: Any, u: Unit, index: int, value: torch.Tensor) -> None:
    """Write ``value`` as tensor ``index`` of ``u`` into a host store, in its storage dtype: fp8
    with its scale (a float on the UnitTensor, or row/block scales into the slab)."""
    ts = u.tensors[index]
    value = value.detach()
    if ts.store_dtype is None or value.dtype == ts.store_dtype:  # as stored (native fp8: its scale kept)
        store.view(u, index).copy_(value)
        return
    grouped = ts.scale_shape is not None
    _, s = quantize(value, ts.store_dtype, out=store.view(u, index), scaling=ts.scaling,
                    scale_out=scale_view(store.master(u.uid), ts) if grouped else None)
    if not grouped:
        ts.scale = s


def stored_value(store: Any, u: Unit, index: int) -> torch.Tensor:
    """Tensor ``index`` of ``u`` as the model computes with it: the host master, widened (a new
    tensor) when it is stored narrower."""
    ts = u.tensors[index]
    stored = store.view(u, index)
    if ts.store_dtype is None:
        return stored
    if ts.scale_shape is None:
        return widen(stored, ts.scale, ts.dtype)
    # a disk store hands out copies of its scales (master() would keep the unit); the others a view
    scales = store.scales(u, index) if hasattr(store, "scales") else scale_view(store.master(u.uid), ts)
    return widen(stored, scales, ts.dtype)


def scale_view(slab: torch.Tensor, ts: UnitTensor) -> torch.Tensor:
    """The fp32 row/block scales of tensor ``ts`` inside a unit's slab (or a raw copy of it)."""
    n = math.prod(ts.scale_shape) * 4
    return slab[ts.scale_offset: ts.scale_offset + n].view(torch.float32).view(ts.scale_shape)


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
