"""CpuStepper: the optimizer step of streamed parameters, on their host masters.

The user's optimizer holds the Parameter objects, whose data is a placeholder on the device most of
the time. The stepper finds which parameters an optimizer steps, and in which param group
(``adopt``; again after ``load_state_dict`` replaced the groups: ``regroup``), and steps them a
unit at a time through a *twin*: an optimizer of the same class over the fp32 masters, in one
group whose values are copied from the user's group at every step (LR schedulers, changed weight
decay), with the user's own state entries (``optimizer.state[param]``, so the user's
``state_dict()`` saves it all). The user's step then skips these parameters (their gradients are
hidden during it).

With ``fused``, Adam and AdamW twins run torch's fused CPU kernel: one pass over memory per
tensor instead of one per operation. It is bitwise ``AdamW(fused=True)``, and differs from the
default for-loop kernel in the last bit. Other optimizers (and ``fused=False``) get a twin with the
user's own settings: bitwise what the user's ``step()`` would have done. Only optimizers known to
step each parameter on its own are twinned (torch's, but LBFGS; transformers' Adafactor): another
class may keep settings on itself, which a twin built from the group would not have, or compute over
the whole group (a global gradient norm), which a unit at a time would change. Those, and any that
cannot be built that way, are left to step their masters inside ``optimizer.step()``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["Bucket", "CpuStepper", "TWINS"]

log = logging.getLogger(__name__)

_FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
_NOT_COPIED = ("params", "fused", "foreach", "capturable", "differentiable")
# The twins: global optimizer step hooks leave them alone.
TWINS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def per_parameter(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt``'s step treats each parameter on its own, with settings only in its groups, so a
    unit's parameters can be stepped alone by a twin: torch's optimizers (LBFGS aside) and
    transformers' Adafactor. A subclass or a custom optimizer is not assumed to."""
    cls = type(opt)
    if cls.__module__.startswith("torch.optim"):
        return cls is not torch.optim.LBFGS
    return cls.__module__ == "transformers.optimization" and cls.__name__ == "Adafactor"


def _fused_on_cpu() -> bool:
    """Whether this torch has fused Adam/AdamW kernels for CPU tensors (2.4 on)."""
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
    except ImportError:
        return False
    return "cpu" in _get_fused_kernels_supported_devices()


def hyper(group: dict) -> tuple:
    """A param group's hyperparameters (lr, betas, weight_decay...) as comparable plain values."""
    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return tuple(v.detach().flatten().tolist())
        if isinstance(v, (tuple, list)):
            return tuple(plain(x) for x in v)
        return v

    return tuple(sorted((k, plain(v)) for k, v in group.items() if k != "params"))


class Bucket:
    """The streamed parameters of one unit in one param group: one twin steps them together."""

    __slots__ = ("items", "opt", "group", "twin", "used")

    def __init__(self, opt: torch.optim.Optimizer, group: dict) -> None:
        self.items: list[Any] = []
        self.opt, self.group = opt, group
        self.twin: Any = None  # None: not built yet; False: this optimizer cannot be twinned
        self.used: tuple | None = None  # the hyperparameters of its last step (hyper())


class CpuStepper:
    """Steps items (objects with param, master, unit, opt, group, bucket, twin_param, stepped)."""

    def __init__(self, items: list[Any], *, fused: bool) -> None:
        self.items = items
        self.fused = fused
        self.by_id = {id(it.param): it for it in items}
        self._seen: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    def adopt(self, opt: torch.optim.Optimizer) -> bool:
        """Whether ``opt`` steps any of the items (taking note of which, and in which group)."""
        if opt in self._seen:
            return any(it.opt is opt for it in self.items)
        self._seen.add(opt)
        mine = False
        for group in opt.param_groups:
            for p in group["params"]:
                it = self.by_id.get(id(p))
                if it is not None and it.param is p:
                    it.opt, it.group, mine = opt, group, True
        if mine:
            self._rebucket()
        return mine

    def regroup(self) -> None:
        """Find each parameter's group again (``load_state_dict`` gives an optimizer new group dicts)."""
        moved = False
        for opt in {id(it.opt): it.opt for it in self.items if it.opt is not None}.values():
            for group in opt.param_groups:
                for p in group["params"]:
                    it = self.by_id.get(id(p))
                    if it is not None and it.opt is opt and it.group is not group:
                        it.group, moved = group, True
        if moved:
            self._rebucket()

    def _rebucket(self) -> None:
        buckets: dict[tuple, Bucket] = {}
        for it in self.items:
            if it.opt is None:
                continue
            key = (it.unit.uid, id(it.opt), id(it.group))
            b = buckets.get(key)
            if b is None:
                b = buckets[key] = Bucket(it.opt, it.group)
            b.items.append(it)
            it.bucket = b

    def twin(self, b: Bucket) -> Any:
        """The bucket's twin optimizer (None: this optimizer cannot be twinned)."""
        if b.twin is None:
            opt = b.opt
            for it in b.items:
                it.twin_param = nn.Parameter(it.master, requires_grad=True)
            params = [it.twin_param for it in b.items]
            twin = None
            if self.fused and type(opt) in _FUSABLE and not b.group.get("differentiable") and _fused_on_cpu():
                try:
                    hp = {k: v for k, v in b.group.items() if k not in _NOT_COPIED}
                    twin = type(opt)([dict(hp, params=params)], fused=True)
                except (RuntimeError, TypeError, ValueError) as exc:
                    log.info("fused CPU %s unavailable (%s); using the optimizer's own kernel", type(opt).__name__, exc)
            if twin is None and not per_parameter(opt):
                log.info("%s is not known to step each parameter on its own; it steps inside optimizer.step()",
                         type(opt).__name__)
                twin = False
            if twin is None:
                try:
                    twin = type(opt)([dict({k: v for k, v in b.group.items() if k != "params"}, params=params)])
                except Exception as exc:  # a custom optimizer: its own step() steps the masters
                    log.info("cannot step %s per unit (%s); it steps inside optimizer.step()", type(opt).__name__, exc)
                    twin = False
            if twin:
                TWINS.add(twin)
            b.twin = twin
        return b.twin or None

    def step(self, b: Bucket, grads: dict[int, torch.Tensor]) -> None:
        """Step the bucket's items that have a gradient in ``grads`` (keyed by id of the item)."""
        twin = self.twin(b)
        fused_here = twin.param_groups[0].get("fused") and not b.group.get("fused")
        skip = _NOT_COPIED if fused_here else ("params",)
        twin.param_groups[0].update({k: v for k, v in b.group.items() if k not in skip})
        b.used = hyper(b.group)
        stepped = []
        for it in b.items:
            g = grads.get(id(it))
            if g is None:
                continue
            state = b.opt.state[it.param]  # the optimizer's own entry: its state_dict() saves it
            for k, v in list(state.items()):
                # loaded onto the placeholder's device, and cast to its dtype (a bf16 parameter's
                # optimizer.load_state_dict before the first forward): the master's state is fp32
                if isinstance(v, torch.Tensor) and (v.device != it.master.device
                                                    or v.is_floating_point() and v.dtype != torch.float32):
                    state[k] = v.to(it.master.device, torch.float32 if k == "step" or v.is_floating_point() else v.dtype)
            twin.state[it.twin_param] = state
            it.twin_param.grad = g if g.dtype == it.master.dtype else g.to(it.master.dtype)
            stepped.append(it)
        if not stepped:
            return
        twin.step()
        for it in stepped:
            it.twin_param.grad = None
            it.stepped = True

    def kernels(self) -> set[str]:
        """How the buckets are stepped: 'fused', 'own' or 'optimizer.step()' (not twinned)."""
        buckets = {id(it.bucket): it.bucket for it in self.items if it.bucket is not None}.values()
        return {("fused" if b.twin.defaults.get("fused") else "own") if b.twin else "optimizer.step()"
                for b in buckets if b.twin is not None}
