"""Binding a live model to a shard index: its units to their slabs, its other tensors to their bytes.

``bind_units`` matches each streamed unit the engine found to the index entry of the same name,
puts its tensors in the index's order, takes each tensor's storage dtype (and fp8 scale, or the
shape of its row/block scales in the slab) from the index, re-lays the unit out, and checks that
the result is byte for byte the slab on disk: same tensors, same shapes, same offsets (scales'
included). It must run before the engine builds anything from the units'
layout (the arena's views, the ring's slot size, the widener). Anything else is a ShardMismatchError that names the unit, the tensor and the index:
reading a slab into a unit laid out differently would be a silent wrong result.

peft's LoRA wrapping renames a frozen Linear's tensors ``<path>.base_layer.weight``; names are
compared with those ``base_layer`` steps removed, so a LoRA-injected model binds to the shards of
its base model.

``materialize`` fills the model's tensors that no streamed unit holds (resident units, tied
weights, the embedders the planner keeps) from the index, for a model built on the meta device.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..units import Unit
from ..weights import base_name  # peft's base_layer steps removed: the checkpoint's name
from .errors import ShardMismatchError
from .format import ShardIndex, SlabEntry, TensorEntry, dtype_name
from .grouping import tensor_names
from .read import UnitReader

__all__ = ["bind_units", "materialize", "base_name"]


def bind_units(units: Iterable[Unit], index: ShardIndex, model: nn.Module | None = None) -> dict[int, SlabEntry]:
    """uid -> the unit's slab entry; sets store_dtype/scale from the index and checks the layout."""
    names = tensor_names(model) if model is not None else None
    where = index.path
    out: dict[int, SlabEntry] = {}
    for u in units:
        key = base_name(u.name)
        entry = index.units.get(key)
        if entry is None:
            known = ", ".join(list(index.units)[:4])
            raise ShardMismatchError(f"{where}: the model's unit {u.name} is not in the index (it has {len(index.units)} "
                                     f"units: {known}, ...); shards of another model or granularity?")
        if len(entry.tensors) != len(u.tensors):
            raise ShardMismatchError(f"{where}: unit {u.name} has {len(u.tensors)} tensors in the model, "
                                     f"{len(entry.tensors)} in the index")
        if names is not None:
            # The index's order is the slab's: take it (the engine has built nothing from the order yet).
            by_name = {base_name(names[(id(ts.module), ts.attr)]): ts for ts in u.tensors}
            if set(by_name) == {te.name for te in entry.tensors}:
                u.tensors[:] = [by_name[te.name] for te in entry.tensors]
        for ts, te in zip(u.tensors, entry.tensors):
            label = names[(id(ts.module), ts.attr)] if names is not None else f"{u.name}.{ts.attr}"
            if names is not None and base_name(label) != te.name:
                raise ShardMismatchError(f"{where}: unit {u.name}: the model has {label} where the index has {te.name}")
            if list(ts.shape) != te.shape:
                raise ShardMismatchError(f"{where}: tensor {te.name}: shape {list(ts.shape)} in the model, "
                                         f"{te.shape} in the index")
            store = None if te.dtype == ts.dtype else te.dtype
            if store is not None and (ts.trainable or not (ts.dtype.is_floating_point and te.dtype.is_floating_point)):
                raise ShardMismatchError(
                    f"{where}: tensor {te.name} is {dtype_name(te.dtype)} in the shards and {dtype_name(ts.dtype)} in the "
                    "model" + ("; a trained tensor must be stored in its own dtype" if ts.trainable else ""))
            ts.store_dtype, ts.scale = store, te.scale
            ts.scale_shape = tuple(te.scale_shape) if te.scale_shape is not None and store is not None else None
        u.layout()
        bad = [(ts, te) for ts, te in zip(u.tensors, entry.tensors)
               if ts.store_offset != te.offset or (ts.scale_nbytes and ts.scale_offset != te.scale_offset)]
        if bad or u.store_nbytes != entry.nbytes:
            compute = {dtype_name(te.source_dtype) for te in entry.tensors if te.source_dtype is not None}
            have = {dtype_name(ts.dtype) for ts in u.tensors}
            raise ShardMismatchError(
                f"{where}: unit {u.name} lays out differently from its slab on disk "
                f"({u.store_nbytes} bytes against {entry.nbytes}; the shards were laid out for compute dtype "
                f"{', '.join(sorted(compute)) or 'as stored'}, the model computes in {', '.join(sorted(have))}); "
                "build the model in that dtype or re-shard")
        out[u.uid] = entry
    return out


def _lookup(index: ShardIndex) -> dict[str, tuple[SlabEntry, TensorEntry]]:
    return {t.name: (s, t) for s in index.slabs() for t in s.tensors}


def _replace(holders: list[tuple[nn.Module, str, bool]], old: torch.Tensor, new: torch.Tensor) -> None:
    """Put ``new`` wherever ``old`` is registered (a tied tensor stays tied); a meta tensor's .data
    cannot be reassigned to another device, so the object itself is replaced."""
    obj = nn.Parameter(new, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else new
    for m, attr, is_param in holders:
        (m._parameters if is_param else m._buffers)[attr] = obj


def materialize(model: nn.Module, index: ShardIndex, streamed: Iterable[Unit] = (), device: str | torch.device = "cpu",
                reader: UnitReader | None = None) -> int:
    """Give every meta tensor of ``model`` a value on ``device``; returns the bytes read from the shards.

    Tensors of the ``streamed`` units get a 0-element placeholder (their bytes stay on disk, and the
    engine binds them per use); every other meta tensor is read from the index and widened to the
    model's dtype (fp8 with its scale) when stored narrower.
    """
    from ..quant import widen

    reader = reader or UnitReader(index)
    by_name = _lookup(index)
    in_unit = {(id(ts.module), ts.attr) for u in streamed for ts in u.tensors}
    holders: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for is_param, table in ((True, m._parameters), (False, m._buffers)):
            for attr, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                holders.setdefault(id(t), []).append((m, attr, is_param))
                first.setdefault(id(t), (f"{mname}.{attr}" if mname else attr, t))
    total = 0
    dev = torch.device(device)
    for tid, (name, t) in first.items():
        if any((id(m), attr) in in_unit for m, attr, _ in holders[tid]):
            _replace(holders[tid], t, torch.empty(0, dtype=t.dtype, device=dev))
            continue
        hit = by_name.get(base_name(name))
        if hit is None:
            raise ShardMismatchError(
                f"{index.path}: {name} is on the meta device and not in the shards (a non-persistent buffer? build "
                "the model with its buffers materialized, e.g. accelerate.init_empty_weights(include_buffers=False))")
        slab, te = hit
        if te.shape != list(t.shape):
            raise ShardMismatchError(f"{index.path}: tensor {te.name}: shape {list(t.shape)} in the model, "
                                     f"{te.shape} in the index")
        value = reader.read_tensor(slab, te)
        if te.dtype != t.dtype:  # fp8 of a unit the planner keeps resident: its row/block scales from the slab too
            value = widen(value, reader.read_scales(slab, te) if te.scale_shape is not None else te.scale, t.dtype)
        _replace(holders[tid], t, value.to(dev))
        total += te.nbytes
    return total
