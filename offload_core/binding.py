"""Binding: a streamed unit's tensors are views into its slot while its module runs, placeholders otherwise.

- The anchor module's forward pre-hook asks the engine for the unit's slot (``use``) and binds
  every tensor to a view into it; the forward hook (``always_call``) unbinds them. Nested entries of
  the same anchor count depth, so only the outermost binds.
- Frozen tensors: the module's table holds the plain view while it runs; the Parameter object
  keeps its placeholder, so nothing autograd or a checkpoint saved can be swapped out from under it.
  Trainable streamed parameters stay the leaf autograd accumulates into: their ``.data`` is the view.
- Buffers updated in place while bound (BatchNorm running stats) are written back to the host
  master when the unit is unbound.
- Autograd's saved weight views become references (``SlotRef``) that backward loads again, so the
  weights do not stay on the device between forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import FrozenWeightError, OffloadedCopyError, copied_module_error
from .slots import Slot
from .units import Unit

__all__ = ["Binder", "SlotRef", "set_data"]


def set_data(ts: Any, value: torch.Tensor) -> None:
    """Give a streamed tensor its placeholder. A filled store may have left a meta tensor there
    (a model built on the meta device), whose .data cannot take a tensor of another device: the
    meta Parameter is replaced by one that can (it had no value anyone could hold on to)."""
    obj = ts.tensor()
    if obj.device.type != "meta":
        obj.data = value
        return
    table = ts.module._parameters if ts.is_param else ts.module._buffers
    table[ts.attr] = nn.Parameter(value, requires_grad=obj.requires_grad) if isinstance(obj, nn.Parameter) else value


@dataclass
class SlotRef:
    """What autograd keeps instead of a streamed weight view."""

    uid: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


class Binder:
    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.bound: dict[int, list] = {}  # uid -> (table, attr, original, view, version or placeholder) per tensor, while its module runs
        self.depth: dict[int, int] = {}
        self._placeholders: dict[Any, torch.Tensor] = {}
        self._specs: dict[int, list] = {}  # uid -> per-tensor binding spec (see _spec)
        self._recompute_hooks: dict[int, Any] = {}  # id(anchor) -> saved-tensor hooks held over a recompute

    def placeholder_for(self, ts: Any) -> torch.Tensor:
        """What a streamed tensor holds between uses: 0 elements, or (trainable) its shape at stride 0.

        AccumulateGrad shapes a new .grad after the leaf's current sizes, so a streamed trainable
        parameter keeps its shape between uses: one element, expanded.
        """
        key = (ts.dtype, 1) if ts.trainable else ts.dtype
        ph = self._placeholders.get(key)
        if ph is None:
            with torch.inference_mode(False):  # kept for good, whatever mode the first call ran in
                ph = self._placeholders[key] = torch.zeros(1 if ts.trainable else 0, dtype=ts.dtype, device=self.e.device)
        return ph.expand(ts.shape) if ts.trainable else ph

    # ------------------------------------------------------------------ module hooks
    def make_pre(self, units: list[Unit], post_id: int | None) -> Callable:
        anchor = units[0].anchor

        def pre(module: nn.Module, args: Any) -> None:
            if module is not anchor:  # a deepcopy of the module carries this hook along
                raise copied_module_error(next((n for n, m in self.e.model.named_modules() if m is anchor), ""))
            if post_id is not None:
                hooks = module._forward_hooks
                if next(reversed(hooks)) != post_id:
                    hooks.move_to_end(post_id)  # unbind after the user's forward hooks, even those added later
            if (self.e._trains_streamed and id(module) not in self._recompute_hooks
                    and torch._C._current_graph_task_id() != -1
                    and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
                # a reentrant checkpoint's recompute, inside backward and outside the root's hooks: what it
                # saves of a trained weight must be a reference too, or unbind empties it before its backward
                ctx = torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved)
                ctx.__enter__()
                self._recompute_hooks[id(module)] = ctx
            for u in units:
                depth = self.depth.get(u.uid, 0)
                self.depth[u.uid] = depth + 1
                if depth == 0:
                    self.bind(u, self.e.use(u))
        return pre

    def make_post(self, units: list[Unit]) -> Callable:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            for u in units:
                depth = self.depth.get(u.uid, 0) - 1
                self.depth[u.uid] = max(depth, 0)
                if depth <= 0:
                    self.unbind(u)
            if self._recompute_hooks and all(self.depth.get(u.uid, 0) == 0 for u in units):
                ctx = self._recompute_hooks.pop(id(module), None)
                if ctx is not None:
                    ctx.__exit__(None, None, None)
        return post

    def _spec(self, u: Unit) -> list:
        """What binding u needs per tensor, worked out once (layouts are fixed after setup):
        (tensor slot, module, is_param, attr, dtype, shape, stride, element offset, placeholder or None,
        frozen, the tensor object). A trainable tensor's placeholder (its shape at stride 0) is kept:
        unbind gives it back. frozen: a parameter that did not require grad at setup (in a model not
        taken for inference), which must not start to: its plain view would get no gradient, silently.
        The engine works them all out at the end of its setup, so the tensor object is the one it was
        given: one the user puts in its place later is refused at bind, not silently overridden."""
        spec = self._specs.get(u.uid)
        if spec is None:
            inference = self.e.treat_as_inference
            spec = self._specs[u.uid] = [
                (ts, ts.module, ts.is_param, ts.attr, ts.dtype, tuple(ts.shape), ts.contiguous_stride,
                 ts.offset // ts.dtype.itemsize, self.placeholder_for(ts) if ts.trainable else None,
                 ts.is_param and not ts.trainable and not inference, ts.tensor())
                for ts in u.tensors]
        return spec

    def bind(self, u: Unit, slot: Slot) -> None:
        # The hot path of every use: one strided view per tensor, nothing else worked out here.
        bound = []
        add = bound.append
        typed = slot.typed
        base_dtype = base = None
        for ts, m, is_param, attr, dtype, shape, stride, eoff, ph, frozen, own in self._spec(u):
            if dtype is not base_dtype:
                base_dtype, base = dtype, typed(dtype)
            view = base.as_strided(shape, stride, eoff)
            table = m._parameters if is_param else m._buffers
            orig = table[attr]
            if orig is not own:
                self._undo(u, bound)
                raise OffloadedCopyError(
                    f"{self._qualname(ts)}: this {'parameter' if is_param else 'buffer'} was replaced after "
                    "enable_offload (a re-tie, a new Parameter or tensor); the engine streams the one it was given. "
                    "Replace it before enable_offload, or remove() first")
            if ph is not None:
                orig.data = view
                add((table, attr, orig, None, ph))
            else:
                if frozen and orig.requires_grad:
                    self._undo(u, bound)
                    raise FrozenWeightError(
                        f"{self._qualname(ts)}: this weight was frozen when offloading began, so it streams as a "
                        "frozen view and would get no gradient; it now requires grad. Call remove(), change what "
                        "trains, then enable offloading again")
                table[attr] = view
                # A buffer's version tells unbind whether it was updated in place; inference tensors
                # keep none (None: ask the module). A frozen parameter needs neither.
                add((table, attr, orig, view, None if is_param or view.is_inference() else view._version))
        self.bound[u.uid] = bound

    def _qualname(self, ts: Any) -> str:
        mod = next((n for n, m in self.e.model.named_modules() if m is ts.module), "")
        return f"{mod}.{ts.attr}" if mod else ts.attr

    def _undo(self, u: Unit, bound: list) -> None:
        """A bind that cannot go on: what it swapped so far goes back."""
        self.bound[u.uid] = bound
        self.unbind(u)

    def unbind(self, u: Unit) -> None:
        bound = self.bound.pop(u.uid, None)
        if bound is None:
            return
        e = self.e
        e.delay()
        dirty = None
        for (table, attr, orig, view, extra), spec in zip(bound, self._specs[u.uid]):
            if view is None:
                orig.data = extra  # the trainable tensor's placeholder
                continue
            table[attr] = orig
            if not spec[2]:  # a buffer: written back if it changed while bound
                changed = spec[1].training if extra is None else view._version != extra
                if changed:
                    (dirty := dirty or []).append((spec[0], view))
        if dirty:
            with e.lock:
                e.transfer.write_back(u, dirty, e.store.master(u.uid), e.ring.lookup(u.uid))

    # ------------------------------------------------------------------ autograd saved tensors
    def pack_saved(self, t: torch.Tensor) -> Any:
        e = self.e
        if t.device != e.device or not t.numel():
            return t
        slot = e.ring.by_ptr.get(t.untyped_storage().data_ptr())
        if slot is None or slot.owner is None:
            return t
        e.counters.saved_refs += 1
        return SlotRef(slot.owner, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def unpack_saved(self, ref: Any) -> torch.Tensor:
        if not isinstance(ref, SlotRef):
            return ref
        slot = self.e.use(self.e.units[ref.uid], backward=True)
        return slot.buf.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)
