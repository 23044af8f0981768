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

import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .errors import FrozenWeightError, OffloadedCopyError, OffloadedEditError, copied_module_error
from .parking import Parked
from .seams import BinderHost
from .slots import Slot
from .units import Unit

__all__ = ["Binder", "SlotRef", "TensorBinding", "set_data"]


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


def _version(t: torch.Tensor) -> int | None:
    """t's version counter, or None where it keeps none (a tensor made under inference mode)."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass(slots=True)
class TensorBinding:
    """What binding one streamed tensor needs, worked out once per tensor (layouts are fixed after setup)."""

    ts: Any  # the unit's record of the tensor (units.py)
    module: nn.Module
    is_param: bool
    attr: str
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int  # in elements of dtype, into the slot
    # a trainable tensor's placeholder (its shape at stride 0), kept: unbind gives it back; None when frozen
    placeholder: torch.Tensor | None
    # a parameter that did not require grad at setup (in a model not taken for inference), which must not
    # start to: its plain view would get no gradient, silently
    frozen: bool
    own: torch.Tensor  # the tensor object the engine was given


@dataclass
class SlotRef:
    """What autograd keeps instead of a streamed weight view."""

    uid: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype


class Binder:
    def __init__(self, engine: BinderHost) -> None:
        self.e = engine
        self.bound: dict[int, list] = {}  # uid -> (table, attr, original, view, version or placeholder) per tensor, while its module runs
        self.depth: dict[int, int] = {}
        self._placeholders: dict[Any, torch.Tensor] = {}
        self._specs: dict[int, list[TensorBinding]] = {}  # uid -> per-tensor binding spec (see _spec)
        # uid -> each tensor object's version while it holds its placeholder (None: an inference tensor, which
        # keeps none): an in-place edit between uses shows as a change (see bind, adopt)
        self._versions: dict[int, list] = {}
        self._recompute_hooks: dict[int, Any] = {}  # id(anchor) -> saved-tensor hooks held over a recompute

    def placeholder_for(self, ts: Any) -> torch.Tensor:
        """What a streamed tensor holds between uses: 0 elements, or (trainable) its shape at stride 0.

        AccumulateGrad shapes a new .grad after the leaf's current sizes, so a streamed trainable
        parameter keeps its shape between uses: one element, expanded. That element is NaN: a read
        outside its module's forward (a weight penalty, a head tied to an embedding's weight) then
        shows as NaN rather than a plausible zero.
        """
        # a trainable tensor's own: an in-place edit of one (nn.init.zeros_) must not change what others read
        key = ("trained", id(ts)) if ts.trainable else ts.dtype
        ph = self._placeholders.get(key)
        if ph is None:
            with torch.inference_mode(False):  # kept for good, whatever mode the first call ran in
                if ts.trainable:
                    ph = torch.full((1,), float("nan"), dtype=ts.dtype, device=self.e.device)
                else:
                    ph = torch.zeros(0, dtype=ts.dtype, device=self.e.device)
                self._placeholders[key] = ph
        return ph.expand(ts.shape) if ts.trainable else ph

    def own(self, u: Unit, i: int) -> torch.Tensor:
        """The tensor object the engine streams as tensor ``i`` of ``u`` (the one it was given)."""
        return self._spec(u)[i].own

    def placeholder_ptr(self, ts: Any) -> int:
        """Where a trainable tensor's placeholder lies (its .data points there between uses)."""
        ph = self._placeholders.get(("trained", id(ts)))
        return (ph if ph is not None else self.placeholder_for(ts)).data_ptr()

    # ------------------------------------------------------------------ module hooks
    def make_pre(self, units: list[Unit], last: list[int]) -> Callable:
        """``last``: the forward hooks kept last, in this order (the unbinding; on the root module, the
        engine's cycle end after it), so the user's forward hooks, even those added later, see the weights."""
        anchor = units[0].anchor
        post_id = last[0]

        def pre(module: nn.Module, args: Any) -> None:
            if module is not anchor:  # a deepcopy of the module carries this hook along
                raise copied_module_error(next((n for n, m in self.e.model.named_modules() if m is anchor), ""))
            hooks = module._forward_hooks
            tail = reversed(hooks)
            if next(tail) != last[-1] or len(last) > 1 and next(tail, None) != post_id:
                for hid in last:
                    hooks.move_to_end(hid)
            if (id(module) not in self._recompute_hooks and torch._C._current_graph_task_id() != -1
                    and torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
                # a reentrant checkpoint's recompute, inside backward and outside the root's hooks: what it
                # saves of a streamed weight must be a reference too, or unbind empties a trained one before
                # its backward, and a BatchNorm's running-stat update in the same slot bumps the version
                # counter every view of the slot shares ("modified by an inplace operation")
                ctx = torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved)
                ctx.__enter__()
                self._recompute_hooks[id(module)] = ctx
            lockstep = self.e.lockstep
            if lockstep is not None and any(self.depth.get(u.uid, 0) == 0 for u in units):
                lockstep.arrive()  # layer-major accumulation: the next micro-batch's turn first (lockstep.py)
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

    def _spec(self, u: Unit) -> list[TensorBinding]:
        """What binding u needs per tensor (TensorBinding), worked out once. The engine works them
        all out at the end of its setup, so the tensor object is the one it was given: one the user
        puts in its place later is refused at bind, not silently overridden."""
        spec = self._specs.get(u.uid)
        if spec is None:
            inference = self.e.treat_as_inference
            spec = self._specs[u.uid] = [
                TensorBinding(ts, ts.module, ts.is_param, ts.attr, ts.dtype, tuple(ts.shape), ts.contiguous_stride,
                              ts.offset // ts.dtype.itemsize, self.placeholder_for(ts) if ts.trainable else None,
                              ts.is_param and not ts.trainable and not inference, ts.tensor())
                for ts in u.tensors]
            self._versions[u.uid] = [_version(b.own) for b in spec]
        return spec

    def bind(self, u: Unit, slot: Slot) -> None:
        # The hot path of every use: one strided view per tensor, nothing else worked out here.
        bound = []
        add = bound.append
        typed = slot.typed
        base_dtype = base = None
        versions = self._versions[u.uid] if u.uid in self._specs else None
        placeholders = self._placeholders
        for k, b in enumerate(self._spec(u)):
            dtype, is_param, ph = b.dtype, b.is_param, b.placeholder
            if dtype is not base_dtype:
                base_dtype, base = dtype, typed(dtype)
            view = base.as_strided(b.shape, b.stride, b.offset)
            table = b.module._parameters if is_param else b.module._buffers
            attr = b.attr
            orig = table[attr]
            if orig is not b.own:
                self._undo(u, bound)
                raise OffloadedCopyError(
                    f"{self._qualname(b.ts)}: this {'parameter' if is_param else 'buffer'} was replaced after "
                    "enable_offload (a re-tie, a new Parameter or tensor); the engine streams the one it was given. "
                    "Replace it before enable_offload, or remove() first")
            if ph is not None:
                if versions is not None and versions[k] is not None and orig._version != versions[k]:
                    self._undo(u, bound)
                    raise OffloadedEditError(self._lost_edit(b.ts))
            elif (not orig.is_set_to(placeholders[dtype]) or versions is not None
                  and versions[k] is not None and orig._version != versions[k]):
                # edited between uses, while its values were on the host: what reached them goes in, the slot's
                # bytes are stale now, so the unit is loaded again
                self._undo(u, bound)
                self.adopt(u)
                self.bind(u, self.e.use(u))
                return
            if ph is not None:
                orig.data = view
                add((table, attr, orig, None, ph))
            else:
                if b.frozen and orig.requires_grad:
                    self._undo(u, bound)
                    raise FrozenWeightError(
                        f"{self._qualname(b.ts)}: this weight was frozen when offloading began, so it streams as a "
                        "frozen view and would get no gradient; it now requires grad. Call remove(), change what "
                        "trains, then enable offloading again")
                table[attr] = view
                # A buffer's version tells unbind whether it was updated in place; inference tensors
                # keep none (None: ask the module). A frozen parameter needs neither.
                add((table, attr, orig, view, None if is_param or view.is_inference() else view._version))
        self.bound[u.uid] = bound

    def adopt(self, u: Unit, lost: str = "raise") -> None:
        """Take in what the user did to u's tensors between uses, as a resident model would see it.

        ``p.data = tensor`` (same shape and dtype) is written into the host master, and the tensor
        gets its placeholder back. An in-place edit (``mul_``, ``nn.init.*``, ``model.apply``) acted
        on the empty placeholder and cannot be recovered: ``lost="raise"`` raises
        OffloadedEditError naming it; ``"warn"`` (remove()) warns and goes on. Trainable streamed
        parameters are optimizer offload's (their ``.data`` is the host master between
        ``after_backward()`` and the next forward): it takes in their new ``.data`` itself.
        """
        spec = self._spec(u)
        versions = self._versions[u.uid]
        for i, b in enumerate(spec):
            ts, dtype, shape, own = b.ts, b.dtype, b.shape, b.own
            if b.placeholder is not None or (b.module._parameters if b.is_param else b.module._buffers).get(b.attr) is not own:
                continue  # trainable, or a replaced object (bind raises OffloadedCopyError)
            placeholder = self.placeholder_for(ts)
            if not own.is_set_to(placeholder):
                new = own.data
                own.data = placeholder
                if tuple(new.shape) == shape and new.dtype == dtype:
                    self.e.masters.write(u, i, new)
                else:
                    msg = (f"{self._qualname(ts)}: its .data was set to a {str(new.dtype).removeprefix('torch.')} "
                           f"tensor of shape {tuple(new.shape)} after enable_offload; an offloaded tensor keeps its "
                           f"shape {shape} and dtype {str(dtype).removeprefix('torch.')}: remove() first to change them")
                    if not new.numel():
                        msg = (f"{self._qualname(ts)}: its .data was set to a tensor computed from its empty placeholder "
                               "(`p.data = p.data * 2`, `.half()`, `.to(dtype)`: its values are in host memory between "
                               "calls); give the new values whole (`p.data = new_tensor`, load_state_dict), or remove() "
                               "first")
                    if lost == "raise":
                        raise OffloadedEditError(msg)
                    warnings.warn(msg + " (remove() gives it back its offloaded values)", stacklevel=3)
            elif versions[i] is not None and own._version != versions[i]:
                msg = self._lost_edit(ts)
                if lost == "raise":
                    raise OffloadedEditError(msg)
                warnings.warn(msg, stacklevel=3)
            if versions[i] is not None:
                versions[i] = own._version

    def _lost_edit(self, ts: Any) -> str:
        return (f"{self._qualname(ts)}: edited in place after enable_offload (mul_, nn.init.*, model.apply, ...) "
                "while its values were in host memory: the edit acted on a placeholder and is lost. Give new values "
                "as `p.data = new_tensor` or through model.load_state_dict(...) (both reach the host copy), or "
                "remove() first, edit, and enable offloading again")

    def give_placeholder(self, u: Unit, i: int) -> None:
        """Tensor ``i`` of ``u`` holds its placeholder again (optimizer offload takes a trained
        parameter back from the host): an in-place edit is told from here on."""
        own = self.own(u, i)
        own.data = self.placeholder_for(u.tensors[i])
        self._versions[u.uid][i] = _version(own)

    def discard_edits(self, u: Unit, i: int) -> None:
        """load_state_dict writes tensor ``i`` of ``u``: an edit the user made to it between uses is moot.
        (A trained parameter's is optimizer offload's to drop, once the write reaches it.)"""
        if not u.tensors[i].trainable:
            self.give_placeholder(u, i)

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
        dirty = bad = None
        versions = self._versions[u.uid]
        for k, ((table, attr, orig, view, extra), spec) in enumerate(zip(bound, self._specs[u.uid])):
            if view is None:
                orig.data = extra  # the trainable tensor's placeholder
                if versions[k] is not None:
                    versions[k] = orig._version
                continue
            now = table.get(attr)
            table[attr] = orig
            if now is not view:
                # the forward assigned it anew (`self.cache = new`): a buffer of the same shape and dtype goes
                # into the slot and home like an in-place update; anything else cannot be streamed
                if spec.is_param or not isinstance(now, torch.Tensor) or now.shape != view.shape or now.dtype != view.dtype:
                    what = "None" if now is None else (f"a {str(now.dtype).removeprefix('torch.')} tensor of shape "
                                                       f"{tuple(now.shape)}" if isinstance(now, torch.Tensor) else type(now).__name__)
                    bad = bad or OffloadedEditError(
                        f"{self._qualname(spec.ts)}: the module's forward set this {'parameter' if spec.is_param else 'buffer'} "
                        f"to {what}; an offloaded tensor keeps its object, shape {tuple(view.shape)} and dtype "
                        f"{str(view.dtype).removeprefix('torch.')} (update it in place instead), or keep this module "
                        "out of the offloaded model")
                    continue
                with torch.no_grad():
                    view.copy_(now)
                (dirty := dirty or []).append((spec.ts, view))
                continue
            if not spec.is_param:  # a buffer: written back if it changed while bound
                changed = spec.module.training if extra is None else view._version != extra
                if changed:
                    (dirty := dirty or []).append((spec.ts, view))
        if dirty:
            with e.lock:
                e.transfer.write_back(u, dirty, e.store.master(u.uid), e.ring.lookup(u.uid))
        if bad is not None:
            raise bad

    # ------------------------------------------------------------------ autograd saved tensors
    def pack_saved(self, t: torch.Tensor) -> Any:
        e = self.e
        if t.device != e.device or not t.numel():
            return t
        slot = e.ring.by_ptr.get(t.untyped_storage().data_ptr())
        if slot is None or slot.owner is None:
            if e.parking is not None and e.parking.wants(t):  # park_saved_tensors (parking.py)
                return e.parking.park(t)
            return t
        e.counters.saved_refs += 1
        return SlotRef(slot.owner, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def unpack_saved(self, ref: Any) -> torch.Tensor:
        if isinstance(ref, Parked):
            return self.e.parking.unpark(ref)
        if not isinstance(ref, SlotRef):
            return ref
        slot = self.e.use(self.e.units[ref.uid], backward=True)
        return slot.buf.view(ref.dtype).as_strided(ref.size, ref.stride, ref.offset)
