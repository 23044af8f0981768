"""Units: the groups of tensors that move between host and device together.

A unit is hooked on one module (its *anchor*): the unit is needed from the anchor's forward
pre-hook to its post-hook. Units are found from the module tree:

- leaf:  every module that directly owns tensors gives a unit of those tensors
- block: each item of the model's big ModuleLists is one unit (its whole subtree); the rest is leaf
- phase: each direct child of a block is one unit; the block's own tensors form another
- strays: in block and phase mode, the tensors outside the block lists (embedders, final norm and
  projection) become leaf units marked ``stray``; the planner may keep them resident
- split threshold (bytes): a unit whose subtree is bigger than the threshold is split into its
  children, recursing into non-leaf modules; the module's own tensors become their own unit

Tensors that appear under more than one module (tied weights) or share storage with another tensor
are kept resident: splitting their storage between slabs would break the aliasing.
"""

from __future__ import annotations

import functools
import math

from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from .config import Granularity

__all__ = ["UnitTensor", "Unit", "UnitLayout", "discover_units", "find_block_lists", "ALIGN", "TensorSlot", "UnitPlan"]

ALIGN = 64


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class UnitTensor:
    """One tensor of a unit: where it is registered and where it sits in the unit's slab."""

    module: nn.Module
    attr: str
    is_param: bool
    shape: torch.Size
    dtype: torch.dtype
    offset: int = 0  # bytes into the unit's slot (compute layout)
    store_dtype: torch.dtype | None = None  # host/transfer dtype when it differs (fp8, bf16)
    store_offset: int = 0  # bytes into the unit's slab (storage layout)
    scale: float | None = None  # per-tensor scale of fp8 storage
    # fp8 row/block scaling (quant.py): the fp32 scales' shape, and their bytes into the unit's slab
    scale_shape: tuple[int, ...] | None = None
    scale_offset: int = 0
    # the model gave this weight already in fp8 (a ComfyUI fp8 checkpoint): its bytes are packed as
    # they are, ``dtype`` is the compute dtype it widens to, and remove() gives the fp8 bytes back
    native_dtype: torch.dtype | None = None
    trainable: bool = False  # bound through .data so autograd accumulates into the Parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def contiguous_stride(self) -> tuple[int, ...]:
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= max(int(n), 1)
        return tuple(reversed(stride))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def store_nbytes(self) -> int:
        return self.numel * (self.store_dtype or self.dtype).itemsize

    @property
    def scaling(self) -> str:
        """fp8 scaling of this tensor: tensor, row or block (quant.py)."""
        return "tensor" if self.scale_shape is None else ("row" if len(self.scale_shape) == 1 else "block")

    @property
    def scale_nbytes(self) -> int:
        """Bytes of the fp32 row/block scales stored after the unit's tensors (0: none)."""
        return 0 if self.scale_shape is None or self.store_dtype is None else 4 * math.prod(self.scale_shape)

    def tensor(self) -> torch.Tensor:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.attr]


@dataclass
class Unit:
    uid: int
    name: str
    anchor: nn.Module
    tensors: list[UnitTensor] = field(default_factory=list)
    nbytes: int = 0  # slot bytes in the compute layout, aligned
    store_nbytes: int = 0  # slab bytes in the storage layout (smaller with fp8)
    streamed: bool = True  # packed in the host arena (False: moved to the device once, for good)
    trainable: bool = False  # holds trainable params (only streamed with optimizer offload)
    widen_plan: tuple | None = None  # set by layout(): the one-kernel widening (see layout)
    stray: bool = False  # block/phase granularity: tensors outside the block lists (embedders, heads)

    _converted: bool = field(default=False, repr=False)  # set by layout(), after the storage dtypes

    @property
    def converted(self) -> bool:
        """Some tensor is stored in another dtype (read at every load: worked out once, in layout())."""
        return self._converted

    def layout(self) -> None:
        """Offsets of every tensor in the slot (compute dtype) and in the slab (storage dtype).

        When every narrower-stored tensor shares one (compute, storage) dtype pair, those tensors
        come first, at slab offsets proportional to their slot offsets: then one conversion kernel
        widens them all and one byte copy moves the rest (``widen_plan``), instead of a kernel per
        tensor. fp8 row/block scales follow, in the slab only (the widening reads them from the raw
        copy; the slot holds the widened weights).
        """
        self._layout_tensors()
        soff = self.store_nbytes
        for t in self.tensors:
            if t.scale_nbytes:
                t.scale_offset = soff
                soff = _align(soff + t.scale_nbytes)
        self.store_nbytes = soff

    def _layout_tensors(self) -> None:
        self.widen_plan = None
        conv = [t for t in self.tensors if t.store_dtype is not None]
        self._converted = bool(conv)
        pairs = {(t.dtype, t.store_dtype) for t in conv}
        if len(pairs) == 1:
            dtype, store = next(iter(pairs))
            ratio, rem = divmod(_esize(dtype), _esize(store))
            if ratio >= 1 and rem == 0:
                off = 0
                sizes: list[int] = []  # slot elements: tensor, gap, tensor, gap, ...
                for t in conv:
                    t.offset, t.store_offset = off, off // ratio
                    end = _align(off + t.nbytes, ALIGN * ratio)
                    sizes += [t.nbytes // _esize(dtype), (end - off - t.nbytes) // _esize(dtype)]
                    off = end
                head, shead = off, off // ratio
                for t in self.tensors:
                    if t.store_dtype is None:
                        t.offset, t.store_offset = off, shead + (off - head)
                        off = _align(off + t.nbytes)
                self.nbytes, self.store_nbytes = off, shead + (off - head)
                self.widen_plan = (dtype, store, head, shead, sizes, [self.tensors.index(t) for t in conv])
                return
        off = soff = 0
        for t in self.tensors:
            t.offset, t.store_offset = off, soff
            off = _align(off + t.nbytes)
            soff = _align(soff + t.store_nbytes)
        self.nbytes, self.store_nbytes = off, soff


@dataclass
class UnitLayout:
    """How a model splits into units: the units (streamed or not), what stays on the device, and
    the model's block lists (what discover_units found; the engine keeps it as ``engine.layout``)."""

    units: list[Unit]
    resident: list[tuple[nn.Module, str, bool]]  # (module, attr, is_param) kept on the device
    block_lists: list[str]
    granularity: str = ""  # what offload_granularity resolved to (auto: block where there are block lists, else leaf)

    def streamed(self) -> Iterator[Unit]:
        return (u for u in self.units if u.streamed)


# The old names ("slot" is a SlotRing buffer, "plan" the planner's decision): kept for code that imports them.
TensorSlot = UnitTensor
UnitPlan = UnitLayout

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
# Modules whose forward reads their children's tensors without calling the children: never split.
ATOMIC: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _direct_tensors(m: nn.Module) -> Iterator[tuple[str, torch.Tensor, bool]]:
    for n, p in m._parameters.items():
        if p is not None:
            yield n, p, True
    for n, b in m._buffers.items():
        if b is not None:
            yield n, b, False


def _subtree_bytes(m: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for sub in m.modules():
        for _, t, _ in _direct_tensors(sub):
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The outermost ModuleLists/Sequentials of at least two items that own tensors."""
    found: list[tuple[str, nn.ModuleList]] = []

    def visit(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, (nn.ModuleList, nn.Sequential)) and child is not model:
                items = [c for c in child.children() if _subtree_bytes(c) > 0]
                if len(items) >= 2:
                    found.append((path, child))
                    continue
            visit(path, child)

    visit("", model)
    return found


def discover_units(
    model: nn.Module,
    granularity: Granularity = Granularity.AUTO,
    split_threshold_bytes: int | None = None,
    stream_trainable: bool = False,
    all_frozen: bool = False,
) -> UnitLayout:
    # Which module paths hold each tensor: tied weights show up twice.
    holders: dict[int, list[tuple[nn.Module, str, bool]]] = {}
    storages: dict[tuple[str, int], set[int]] = {}
    for m in model.modules():
        for n, t, is_param in _direct_tensors(m):
            holders.setdefault(id(t), []).append((m, n, is_param))
    # named_modules de-duplicates modules; a module registered twice is the same module.
    for m in model.modules():
        for _, t, _ in _direct_tensors(m):
            if t.numel() and t.device.type != "meta":
                storages.setdefault((t.device.type, t.untyped_storage().data_ptr()), set()).add(id(t))
    aliased = {tid for ids in storages.values() if len(ids) > 1 for tid in ids}

    assigned: set[int] = set()
    resident: list[tuple[nn.Module, str, bool]] = []
    units: list[Unit] = []
    names = {m: n for n, m in model.named_modules()}
    parents: dict[int, nn.Module] = {}
    for m in model.modules():
        for c in m.children():
            parents.setdefault(id(c), m)

    def callable_anchor(m: nn.Module) -> nn.Module:
        # Containers are never called: their tensors are used inside an ancestor's forward.
        while isinstance(m, _CONTAINERS) and id(m) in parents:
            m = parents[id(m)]
        return m

    def keep_resident(tid: int) -> bool:
        return len({id(h[0]) for h in holders[tid]}) > 1 or tid in aliased

    def add_unit(anchor: nn.Module, modules: list[nn.Module], label: str, stray: bool = False) -> None:
        anchor = callable_anchor(anchor)
        unit = Unit(uid=len(units), name=label, anchor=anchor, stray=stray)
        for m in modules:
            for n, t, is_param in _direct_tensors(m):
                tid = id(t)
                if tid in assigned:
                    continue
                assigned.add(tid)
                trainable = is_param and t.requires_grad and not all_frozen
                if keep_resident(tid) or (trainable and not stream_trainable) or t.numel() == 0:
                    for h in holders[tid]:
                        resident.append(h)
                    continue
                unit.trainable |= trainable
                unit.tensors.append(UnitTensor(m, n, is_param, t.shape, t.dtype, trainable=trainable))
        if unit.tensors:
            unit.layout()
            units.append(unit)

    def leaf_units(root: nn.Module, skip: set[int] | None = None) -> None:
        inside: set[int] = set(skip or ())
        stray = skip is not None
        for m in root.modules():
            if id(m) in inside:
                continue
            if isinstance(m, ATOMIC):
                inside.update(id(x) for x in m.modules())
                add_unit(m, list(m.modules()), names.get(m, "") or "<root>", stray)
            elif any(True for _ in _direct_tensors(m)):
                add_unit(m, [m], names.get(m, "") or "<root>", stray)

    def subtree_unit(m: nn.Module) -> None:
        if isinstance(m, _CONTAINERS):
            add_unit(m, [m], (names.get(m, "") or "<root>") + ":own")
            for child in m.children():
                subtree_unit(child)
        elif (split_threshold_bytes is not None and _subtree_bytes(m) > split_threshold_bytes
              and not isinstance(m, ATOMIC)):
            split(m)
        else:
            add_unit(m, list(m.modules()), names.get(m, "") or "<root>")

    def split(m: nn.Module) -> None:
        # Own tensors first (anchored on m, live for m's whole forward), then children.
        add_unit(m, [m], (names.get(m, "") or "<root>") + ":own")
        for child in m.children():
            subtree_unit(child)

    g = Granularity(granularity)
    block_lists = find_block_lists(model)
    if g is Granularity.AUTO:
        g = Granularity.BLOCK if block_lists else Granularity.LEAF

    if g is Granularity.LEAF:
        if split_threshold_bytes is None:
            leaf_units(model)
        else:
            subtree_unit(model)
    else:
        in_block: set[int] = set()
        for _, lst in block_lists:
            for block in lst.children():
                in_block.update(id(x) for x in block.modules())
                if g is Granularity.BLOCK or isinstance(block, ATOMIC):
                    subtree_unit(block)
                else:  # phase
                    add_unit(block, [block], names[block] + ":own")
                    for child in block.children():
                        subtree_unit(child)
        leaf_units(model, skip=in_block)
    return UnitLayout(units=units, resident=resident, block_lists=[n for n, _ in block_lists], granularity=g.value)
