"""Which unit each checkpoint tensor belongs to, and each unit's slab layout: units.py decides.

A diffusers folder's model is built on the meta device from its config.json and handed to
``discover_units``, so the units and their layout are the engine's own. A checkpoint without a
config gets a *skeleton*: empty modules on the meta device shaped after the tensor names (digit
children make a ModuleList, as a model's block lists are), handed to the same ``discover_units``.
There is no second unit finder here.

A unit becomes a slab in the shards only when the checkpoint holds every one of its tensors; the
checkpoint tensors no such unit holds (tied weights, or part of a unit whose other tensors are
non-persistent buffers) are written as the index's ``resident`` tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import Granularity
from ..units import Unit, discover_units
from .errors import ShardError, one_line
from .format import read_json
from .source import SourceTensor

__all__ = ["Grouping", "group_checkpoint", "group_model", "skeleton", "storage_for", "tensor_names"]


@dataclass
class Grouping:
    units: list[Unit]  # the units written as slabs, in the engine's order, laid out for storage
    names: dict[int, list[str]]  # uid -> the checkpoint name of each of its tensors, in unit order
    resident: list[str]  # checkpoint tensors outside every written unit
    block_lists: list[str]
    granularity: str  # resolved (auto -> block or leaf)
    kind: str  # "model" (built from config.json) or "names" (a skeleton)
    model_class: str | None = None


def tensor_names(model: nn.Module) -> dict[tuple[int, str], str]:
    """(id(module), attr) -> the tensor's first full name in the model."""
    out: dict[tuple[int, str], str] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr in [*m._parameters, *m._buffers]:
            out.setdefault((id(m), attr), f"{mname}.{attr}" if mname else attr)
    return out


def storage_for(dtype: torch.dtype, shape: list[int], is_param: bool, target: torch.dtype | None) -> torch.dtype | None:
    """The dtype a tensor is stored in, when it differs: fp8 for weight matrices only (as
    ``quant.eligible``); bf16/fp16/fp32 for every floating tensor."""
    if target is None or not dtype.is_floating_point or dtype == target:
        return None
    if target is torch.float8_e4m3fn:
        return target if is_param and len(shape) >= 2 else None
    return target


def native_fp8_compute(tensors: dict[str, SourceTensor]) -> torch.dtype | None:
    """The dtype a checkpoint holding fp8 weights computes in: that of most of its other floating
    bytes (as quant.compute_dtype_of reads a live model); None without fp8 tensors, bf16 with nothing else."""
    if not any(t.dtype is torch.float8_e4m3fn for t in tensors.values()):
        return None
    counts: dict[torch.dtype, int] = {}
    for t in tensors.values():
        if t.dtype.is_floating_point and t.dtype is not torch.float8_e4m3fn:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
    return max(counts, key=counts.__getitem__) if counts else torch.bfloat16


def skeleton(tensors: dict[str, SourceTensor]) -> nn.Module:
    """Empty meta-device modules shaped after the tensor names (in natural order); digit children
    make ModuleLists. A model's own order may differ inside a unit: ``bind_units`` takes the index's."""
    tree: dict[str, Any] = {}
    for name in sorted(tensors, key=_natural):  # blocks.2 before blocks.10; lists in name order
        node = tree
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ShardError(f"{tensors[name].file}: tensor {name} lies under another tensor's name")
        if isinstance(node.get(leaf), dict):
            raise ShardError(f"{tensors[name].file}: tensor {name} is also a module path")
        node[leaf] = name

    def build(node: dict[str, Any]) -> nn.Module:
        children = {k: v for k, v in node.items() if isinstance(v, dict)}
        if children and all(k.isdigit() for k in node):
            lst = nn.ModuleList([nn.Module() for _ in range(max(int(k) for k in children) + 1)])
            for k, v in children.items():
                lst[int(k)] = build(v)
            return lst
        m = nn.Module()
        for k in [k for k, v in node.items() if not isinstance(v, dict)]:
            t = tensors[node[k]]
            m.register_parameter(k, nn.Parameter(torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False))
        for k, v in children.items():
            m.add_module(k, build(v))
        return m

    return build(tree)


def _natural(name: str) -> list[tuple[int, int, str]]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.:]", name)]


def _model_from_config(config_path: Path) -> tuple[nn.Module, str]:
    cfg = read_json(config_path)
    cls_name = cfg.get("_class_name")
    try:
        import diffusers

        cls = getattr(diffusers, cls_name, None) if isinstance(cls_name, str) else None
    except Exception:  # a lazy diffusers import that fails is an unknown class here
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ShardError(f"{config_path}: unknown model class {cls_name!r} (not a diffusers model)")
    try:
        with torch.device("meta"):
            model = cls.from_config(cfg)
    except Exception as exc:
        raise ShardError(f"{config_path}: cannot build {cls_name} from this config: {one_line(exc)}") from None
    return model, cls_name


def group_checkpoint(tensors: dict[str, SourceTensor], granularity: Granularity, target: torch.dtype | None,
                     config_path: Path | None = None, fp8_scaling: str = "tensor") -> Grouping:
    """Units for a checkpoint: from its model when a diffusers config names one, else from a skeleton.
    ``fp8_scaling`` (tensor, row, block) lays out the fp8 tensors' scales as the engine's slabs do."""
    from ..quant import scale_shape
    kind, model_class = "names", None
    if config_path is not None and "_class_name" in read_json(config_path):
        model, model_class = _model_from_config(config_path)
        kind = "model"
    else:
        model = skeleton(tensors)
    model.requires_grad_(False)  # frozen, as the engine streams it; trainable tensors stay resident there
    names = tensor_names(model)
    if kind == "model":
        shapes = {names[(id(m), a)]: list(t.shape) for m in model.modules()
                  for a, t in [*m._parameters.items(), *m._buffers.items()] if t is not None}
        matched = [n for n in tensors if n in shapes]
        if tensors and not matched:
            raise ShardError(f"{config_path}: no tensor of the checkpoint belongs to {model_class} (wrong config.json?)")
        for n in matched:
            if tensors[n].shape != shapes[n]:
                raise ShardError(f"{tensors[n].file}: tensor {n} has shape {tensors[n].shape}, "
                                 f"{config_path.name} makes it {shapes[n]}")
    plan = discover_units(model, granularity)
    resolved = Granularity(granularity)
    if resolved is Granularity.AUTO:
        resolved = Granularity.BLOCK if plan.block_lists else Granularity.LEAF
    out = Grouping([], {}, [], plan.block_lists, resolved.value, kind, model_class)
    compute = native_fp8_compute(tensors)
    in_unit: set[str] = set()
    for u in plan.units:
        tnames = [names[(id(ts.module), ts.attr)] for ts in u.tensors]
        if not all(n in tensors for n in tnames):
            continue  # e.g. a non-persistent buffer: its checkpoint tensors go to `resident`
        for ts, n in zip(u.tensors, tnames):
            ts.dtype = tensors[n].dtype  # laid out for the checkpoint's dtype: the one the model computes in
            if ts.dtype is torch.float8_e4m3fn and compute is not None:
                # fp8 in the file (ComfyUI's fp8 checkpoints): it computes in the file's other dtype, and is
                # kept as stored (its scale, if any, one a tensor in the index) unless another dtype is asked for
                store = torch.float8_e4m3fn if target is None or target is torch.float8_e4m3fn else target
                ts.dtype, ts.store_dtype = compute, (None if store == compute else store)
                continue
            ts.store_dtype = storage_for(ts.dtype, list(ts.shape), ts.is_param, target)
            if ts.store_dtype is torch.float8_e4m3fn:
                ts.scale_shape = scale_shape(ts.shape, fp8_scaling)
        u.layout()
        u.uid = len(out.units)
        out.units.append(u)
        out.names[u.uid] = tnames
        in_unit.update(tnames)
    out.resident = [n for n in tensors if n not in in_unit]
    return out


def group_model(model: nn.Module, units: list[Unit]) -> dict[int, list[str]]:
    """uid -> tensor names, for units the engine found on a live model."""
    names = tensor_names(model)
    return {u.uid: [names[(id(ts.module), ts.attr)] for ts in u.tensors] for u in units}
