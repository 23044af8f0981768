"""Optimizer offload: host masters and host gradients for streamed trainable parameters.

Each trainable parameter is streamed like a frozen one. Its fp32 master lives on the host (the store
slab itself when the parameter is fp32). Once autograd has accumulated a gradient on the device, a
hook copies it to pinned staging (the transfer's D2H primitive) and frees the device copy; a worker
thread waits for the copy and adds it into the host accumulator, so several backward passes add up
(gradient accumulation). ``after_backward`` points ``.data`` and ``.grad`` at the host tensors, so an
ordinary torch optimizer steps on the CPU.

The optimizer is found at its first ``step()`` (a global step pre-hook: the optimizer that holds
these parameters), or passed in. From then on the streamed parameters are stepped here, a unit's
parameters at a time (cpu_step.py: a twin of that optimizer sharing its state, so
``optimizer.state`` stays the one to save), and hidden from the optimizer's own step:

- **fused** (``fused_cpu_optimizer``, default): Adam and AdamW use torch's fused CPU kernel, one pass
  over memory instead of one per operation. The result is bitwise that of ``AdamW(fused=True)``; it
  differs from the default for-loop kernel in the last bit (a relative 1e-7 per step). Other
  optimizers, and ``fused_cpu_optimizer=False``, use the optimizer's own kernel: bitwise what its
  ``step()`` would have done.
- **overlapped** (``overlap_optimizer_step``, default auto): from the second step on, each parameter
  is stepped on the worker as soon as its unit's last gradients of the step land, while backward goes on;
  ``optimizer.step()`` then only waits for the worker. The first step shows how many backward passes
  a step accumulates and whether anything changes the gradients between ``after_backward()`` and
  ``step()``: clipping (``clip_grad_norm_``) or unscaling (``GradScaler``, whose unscale bumps no
  version: a fingerprint of each gradient is compared too) does, and then every step stays inside
  ``step()``, on the clipped gradients. A change noticed later, after a step already ran, raises
  ``OptimizerOverlapError`` rather than go unapplied; so does a gradient arriving after its
  parameter's step, and an overlapped step whose ``optimizer.step()`` was skipped (a GradScaler on an
  inf). LR schedulers need nothing: each step reads the group's values as it runs.
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from typing import Any, Callable

import torch

from .cpu_step import TWINS, CpuStepper, hyper
from .errors import OffloadedEditError, OptimizerOverlapError
from .hostmem import HostBuffer
from .seams import OptimizerHost

__all__ = ["OptimizerOffload"]


_SAMPLED = 64  # gradient elements kept at after_backward() to see a change at step()


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _fingerprint(g: torch.Tensor, whole: bool) -> tuple:
    """What after_backward() gave the optimizer, to compare at step(): evenly spaced elements (a
    rescale or a clip changes every nonzero one) and, while the overlap is being decided, the whole
    gradient's float64 sum too (in case the sampled elements are all zero). GradScaler's unscale_
    changes gradients in place without bumping their version, so the version alone cannot tell.
    Kept as bits, so that a NaN left as it was compares equal."""
    flat = g.reshape(-1)
    sampled = flat[:: max(flat.numel() // _SAMPLED, 1)][:_SAMPLED].view(_BITS[g.element_size()]).clone()
    return sampled, (torch.sum(flat, dtype=torch.float64).view(torch.int64) if whole else None)


def _hyper_changed(seen: dict, items: list) -> list[str]:
    """Hyperparameters of the items' groups that changed since after_backward() recorded them."""
    out = []
    for it in items:
        was = seen.get(id(it.group))
        if was is not None and was != hyper(it.group):
            out += [k for (k, v), (_, w) in zip(was, hyper(it.group)) if v != w and k not in out]
            seen[id(it.group)] = None  # reported once
    return out


def _same(g: torch.Tensor, fp: tuple) -> bool:
    return all(torch.equal(a, b) for a, b in zip(_fingerprint(g, fp[1] is not None), fp) if b is not None)


class _Trainable:
    __slots__ = ("param", "unit", "index", "name", "master", "staging", "acc", "grad_in", "issued", "landed",
                 "stepped", "hook", "opt", "group", "bucket", "twin_param", "direct", "separate", "given", "version",
                 "fp")

    def __init__(self, **kw: Any) -> None:
        self.grad_in: str | None = None  # where this step's gradient is: None, "staging" or "acc"
        self.issued = self.landed = 0  # gradients copied out / landed since the last step
        self.stepped = False
        self.opt = self.group = self.bucket = self.twin_param = self.given = None
        self.version = 0
        self.fp: tuple | None = None  # the gradient's fingerprint at after_backward() (_fingerprint)
        self.direct = False  # the gradient may stay in its staging buffer (fp32, one per step)
        for k, v in kw.items():
            setattr(self, k, v)


class _Worker:
    """One thread that runs host-side gradient work in submission order."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cv = threading.Condition()
        self._outstanding = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="offload-grad-worker", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._cv:
            self._outstanding += 1
        self._q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._q.get()
            if fn is None:
                return
            try:
                fn()
            except BaseException as exc:  # surfaced on the caller's thread by wait()
                self._error = exc
            finally:
                fn = None  # the last job must not keep its manager (and engine) alive
                with self._cv:
                    self._outstanding -= 1
                    self._cv.notify_all()

    def wait(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._outstanding == 0)
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5)

    def stop(self) -> None:
        """Let the thread end (a dropped manager's finalizer: no join, it may run on any thread)."""
        self._q.put(None)


# Every live OptimizerOffload sees every optimizer step of the process (two global hooks, installed
# while there is one).
_LIVE: "weakref.WeakSet[OptimizerOffload]" = weakref.WeakSet()
_GLOBAL: list[Any] = []


def _pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if opt not in TWINS:
        for inst in list(_LIVE):
            inst._before_step(opt)


def _post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if opt not in TWINS:
        for inst in list(_LIVE):
            inst._after_step(opt)


class OptimizerOffload:
    def __init__(self, engine: OptimizerHost, optimizer: torch.optim.Optimizer | None = None) -> None:
        cfg = engine.config
        self.engine = engine
        self.overlap_setting = cfg.overlap_optimizer_step
        self.fused = bool(cfg.fused_cpu_optimizer)
        self.target = cfg.gradient_accumulation_steps  # gradients per step; learned at the first step unless set
        self._target_set = cfg.gradient_accumulation_steps > 1
        self.overlap = False
        self.overlap_note = "not yet: the first step shows the optimizer and what happens to the gradients"
        self.steps = self.overlapped_steps = 0
        names = {id(p): n for n, p in engine.model.named_parameters(remove_duplicate=False)}
        self.items: list[_Trainable] = []
        for u in engine.streamed:
            for i, ts in enumerate(u.tensors):
                if ts.is_param and ts.tensor().requires_grad:
                    self.items.append(_Trainable(param=ts.tensor(), unit=u, index=i,
                                                 name=names.get(id(ts.tensor()), ts.attr)))
        self.stepper = CpuStepper(self.items, fused=self.fused)
        total = sum(it.unit.tensors[it.index].nbytes for it in self.items)
        self._staging = HostBuffer(total, pin=engine.is_cuda)
        off = 0
        for it in self.items:
            ts = it.unit.tensors[it.index]
            engine.store.master(it.unit.uid)  # kept by the store: the view below is its slab, not a copy
            view = engine.store.view(it.unit, it.index)
            it.separate = ts.dtype != torch.float32  # the master is an fp32 copy, not the store's slab
            it.master = view.float() if it.separate else view
            it.staging = self._staging.tensor[off: off + ts.nbytes].view(ts.dtype).view(ts.shape)
            off += ts.nbytes
            it.acc = torch.empty(ts.shape, dtype=torch.float32)
            it.hook = it.param.register_post_accumulate_grad_hook(self._make_grad_hook(it))
        self.worker = _Worker()
        self._finalizer = weakref.finalize(self, self.worker.stop)  # dropped without remove(): end the thread
        self._on_host = False
        self._warned_forgotten = False  # step() without after_backward(): said once
        self._hidden: list[tuple[_Trainable, Any]] = []
        self._hp: dict = {}  # id(param group) -> its hyperparameters at after_backward()
        if optimizer is not None:
            self.stepper.adopt(optimizer)
            if self.overlap_setting:
                self._start_overlap("overlap_optimizer_step=True with the optimizer passed in")
        _LIVE.add(self)
        if not _GLOBAL:
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

            _GLOBAL.extend([register_optimizer_step_pre_hook(_pre), register_optimizer_step_post_hook(_post)])
        engine.add_cycle_callback(self._take_back)
        engine.masters.add_hooks(self._flush, self._written)

    def _start_overlap(self, why: str) -> None:
        self.overlap = True
        self.overlap_note = why
        for it in self.items:
            # fp32 with one gradient per step: the step reads the gradient where it landed
            it.direct = self.target == 1 and not it.separate

    # ------------------------------------------------------------------ gradients
    def _make_grad_hook(self, it: _Trainable) -> Callable:
        # Only a weak reference: the hook lives in the parameter, where torch's C++ side holds it and
        # the garbage collector cannot see that cycle; a strong one would keep a dropped manager, its
        # engine and its host memory alive for good.
        me = weakref.ref(self)
        key = id(it.param)

        def hook(p: torch.Tensor) -> None:
            self = me()
            if self is not None:
                self._grad_ready(self.stepper.by_id[key], p)

        return hook

    def _grad_ready(self, it: _Trainable, p: torch.Tensor) -> None:
        g = p.grad
        if g is None:
            return
        if it.issued:
            self.worker.wait()  # the previous gradient has landed before its staging is reused
            if it.stepped:
                raise OptimizerOverlapError(
                    f"{it.name}: a gradient arrived after its optimizer step had already run during backward "
                    f"(more backward passes per step than the {self.target} the first step showed); pass "
                    "gradient_accumulation_steps=N, or overlap_optimizer_step=False")
            if it.grad_in == "staging":
                it.acc.copy_(it.staging)
                it.grad_in = "acc"
        done = self.engine.transfer.d2h(it.staging, g)
        p.grad = None
        it.issued += 1
        self.worker.submit(lambda: self._land(it, done))

    def _land(self, it: _Trainable, done: Any) -> None:
        if done is not None:
            done.synchronize()
        if it.grad_in is None:
            if it.direct and it.issued == 1:
                it.grad_in = "staging"
            else:
                it.acc.copy_(it.staging)
                it.grad_in = "acc"
        else:
            it.acc.add_(it.staging)
        it.landed += 1
        b = it.bucket
        if (self.overlap and b is not None and it.landed == self.target
                and all(x.landed == self.target and not x.stepped for x in b.items) and self.stepper.twin(b) is not None):
            self.stepper.step(b, {id(x): x.staging if x.grad_in == "staging" else x.acc for x in b.items})

    # ------------------------------------------------------------------ step boundaries
    def after_backward(self) -> None:
        self.worker.wait()
        # Fingerprints only while a change would matter: the overlap is on, or may still be turned on.
        watch = self.overlap_setting is not False
        whole = watch and not self.overlap and self.steps == 0  # deciding: the sum too (a full pass, once)
        for it in self.items:
            it.param.data = it.master
            g = None if it.grad_in is None else (it.staging if it.grad_in == "staging" else it.acc)
            it.param.grad = g
            it.given, it.version = g, (g._version if g is not None else 0)
            it.fp = _fingerprint(g, whole) if watch and g is not None else None
        # and the hyperparameters: one changed before step() (a warm-up, scheduler.step() first) is a
        # change a step run during backward would not see
        self._hp = {id(it.group): hyper(it.group) for it in self.items if it.group is not None} if watch else {}
        self._on_host = True

    def _changed(self, it: _Trainable) -> bool:
        g = it.param.grad
        if g is not it.given or (g is not None and g._version != it.version):
            return True
        return g is not None and it.fp is not None and not _same(g, it.fp)

    def _before_step(self, opt: torch.optim.Optimizer) -> None:
        if not self.stepper.adopt(opt):
            return
        self.worker.wait()
        if self._on_host:
            self._user_data(before_step=True)  # the step runs on what the user gave since after_backward()
        if not self._on_host and any(it.grad_in is not None for it in self.items):
            # after_backward() was forgotten: the step still sees the gradients, but nothing between
            # backward and step did (a clip there clipped nothing), so say so once
            if not self._warned_forgotten:
                self._warned_forgotten = True
                warnings.warn(
                    "optimizer.step() ran without manager.after_backward() since loss.backward(): the step used the "
                    "gradients, but nothing in between saw them (clip_grad_norm_ clipped nothing, GradScaler.unscale_ "
                    "and .grad reads found none). Call after_backward() right after loss.backward()", stacklevel=3)
            self.after_backward()
        mine = [it for it in self.items if it.opt is opt]
        for b in {id(it.bucket): it.bucket for it in mine}.values():
            if any(it.stepped for it in b.items) and b.used != hyper(b.group):
                key = next(k for (k, v), (_, w) in zip(b.used, hyper(b.group)) if v != w)
                raise OptimizerOverlapError(
                    f"{b.items[0].name}: the optimizer's {key} changed after this step had already run during "
                    f"backward (set between after_backward() and optimizer.step(), or scheduler.step() before "
                    "optimizer.step()?); change it after optimizer.step(), or pass overlap_optimizer_step=False")
        changed = [it.name for it in mine if self._changed(it)]
        changed += [f"its {k}" for k in _hyper_changed(self._hp, mine)]
        self.overlapped_steps += int(self.overlap)
        if self.steps == 0 and not self._target_set:
            self.target = max([it.issued for it in mine] + [1])
        for it in mine:
            if it.stepped and it.name in changed:
                raise OptimizerOverlapError(
                    f"{it.name}: its gradient was changed between after_backward() and optimizer.step() "
                    "(clip_grad_norm_, unscaling?) after its step had already run during backward; pass "
                    "overlap_optimizer_step=False to the manager to clip before every step")
        for b in {id(it.bucket): it.bucket for it in mine}.values():
            if self.stepper.twin(b) is None:
                continue  # the optimizer's own step() steps these masters
            self.stepper.step(b, {id(it): it.param.grad for it in b.items if not it.stepped and it.param.grad is not None})
            for it in b.items:
                if it.stepped:
                    self._hide(it)
        if changed:
            if self.overlap_setting:
                raise OptimizerOverlapError(
                    f"overlap_optimizer_step=True, but the gradients or the optimizer's settings were changed between after_backward() and "
                    f"optimizer.step() ({changed[0]}; clip_grad_norm_?), which a step during backward cannot see; "
                    "leave overlap_optimizer_step unset (it then steps inside step(), after the change)")
            if self.overlap or self.overlap_setting is None:
                self.overlap = False
                self.overlap_note = f"off: the gradients or settings change between after_backward() and step() ({changed[0]})"
                self.overlap_setting = False
        elif (not self.overlap and self.overlap_setting is not False and all(self.stepper.twin(it.bucket) for it in mine)
              and (self.overlap_setting or self._hp)):
            # (auto: not before a step whose settings were seen at after_backward(), the second: the
            # first step is where the optimizer and its param groups become known)
            self._start_overlap(f"on from step {self.steps + 2}: {self.target} gradient(s) per step, none changed "
                                "before step()")
        self.steps += 1

    def _hide(self, it: _Trainable) -> None:
        # the optimizer's own step skips what was stepped here; the user still sees the gradient after it
        self._hidden.append((it, it.param.grad))
        it.param.grad = None

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        if not any(it.opt is opt for it in self.items):
            return
        for it, g in self._hidden:
            it.param.grad = g
        self._hidden.clear()
        for it in self.items:
            if it.opt is opt:
                it.issued = it.landed = 0
                it.stepped = False
                it.grad_in = None if it.param.grad is None else it.grad_in

    def _user_data(self, before_step: bool = False) -> None:
        """``p.data = new`` (weight clipping written as ``p.data = p.data.clamp(...)``, SAM's restore,
        an EMA swap): the new values go into the master, as a resident model would keep them.

        On the host (after ``after_backward()``) ``.data`` is the master itself; otherwise it is the
        placeholder, and new data goes in through the masters (the store and its fp32 copy). At
        ``step()`` (``before_step``), new data for a parameter whose step already ran during backward
        cannot be stepped on: that raises OptimizerOverlapError.
        """
        for it in self.items:
            p = it.param
            if self._on_host:
                m = it.master
                if p.data_ptr() == m.data_ptr() and p.dtype == m.dtype and p.stride() == m.stride():
                    continue
            elif p.data_ptr() == self.engine.binder.placeholder_ptr(it.unit.tensors[it.index]):
                continue
            d = p.data
            if d.shape != it.master.shape or not d.numel():
                raise OffloadedEditError(
                    f"{it.name}: its .data was set to a tensor of shape {tuple(d.shape)}; an offloaded parameter keeps "
                    f"its shape {tuple(it.master.shape)} (and between calls its values are in host memory, so "
                    "`p.data = p.data * 2` reads an empty placeholder): give the new values whole, or remove() first")
            if before_step and it.stepped:
                raise OptimizerOverlapError(
                    f"{it.name}: its .data was replaced between after_backward() and optimizer.step(), but its step "
                    "had already run during backward; pass overlap_optimizer_step=False to the manager to step on "
                    "the new values")
            if self._on_host:
                if d.untyped_storage().data_ptr() == it.master.untyped_storage().data_ptr():
                    d = d.clone()  # a view of the master itself (p.data = p.data.T)
                with torch.no_grad():
                    it.master.copy_(d)
                it.param.data = it.master
            else:
                self.engine.masters.write(it.unit, it.index, d)  # and _written gives it its placeholder back

    def _take_back(self) -> None:
        """At the start of a forward: collect what the optimizer did, and stream the params again."""
        self.worker.wait()
        self._user_data()
        if not self._on_host:
            return
        skipped = [it.name for it in self.items if it.stepped and it.param.grad is None]
        if skipped:
            raise OptimizerOverlapError(
                f"{skipped[0]}: its step ran during backward, but optimizer.step() did not run before this forward "
                "(a second forward before the step, as SAM takes; or the gradients discarded, as GradScaler does on "
                "an inf or NaN); the update cannot be taken back: pass overlap_optimizer_step=False to the manager")
        for it in self.items:
            p = it.param
            g = p.grad
            if g is None:
                # discarded (zero_grad) after a step, or a step skipped from the start (GradScaler
                # on an inf): the next backward starts this step's count again
                it.grad_in = None
                it.issued = it.landed = 0
                it.stepped = False
            elif g is not it.acc:
                it.acc.copy_(g)  # a gradient kept across the step (no zero_grad) goes on accumulating
                it.grad_in = "acc"
            p.grad = None
            if it.separate:
                self.engine.store.view(it.unit, it.index).copy_(it.master)
            self.engine.binder.give_placeholder(it.unit, it.index)
        # The host masters changed: cached device copies of these units are stale.
        for u in {id(it.unit): it.unit for it in self.items}.values():
            self.engine.invalidate(u.uid)
        self.stepper.regroup()
        self._on_host = False

    def _flush(self) -> None:
        """Before the masters are read (state_dict): the optimizer's updates are in the store."""
        self.worker.wait()
        self._user_data()
        for it in self.items:
            if it.separate:
                self.engine.store.view(it.unit, it.index).copy_(it.master)

    def _written(self, unit: Any, index: int) -> None:
        """load_state_dict wrote a master in the store: an fp32 master of a narrower parameter follows."""
        for it in self.items:
            if it.unit is unit and it.index == index:
                # the loaded values win over `p.data = w` given since the last forward
                if self._on_host:
                    it.param.data = it.master
                else:
                    self.engine.binder.give_placeholder(unit, index)
                if it.separate:
                    it.master.copy_(self.engine.store.view(unit, index))

    def stats(self) -> dict[str, Any]:
        kernels = self.stepper.kernels()
        return {
            "optimizer_offload": True,
            "optimizer_step_overlapped": self.overlap,
            "optimizer_overlap_note": self.overlap_note,
            "optimizer_kernel": ",".join(sorted(kernels)) or "not chosen yet",
            "optimizer_steps": self.steps,
            "optimizer_steps_overlapped": self.overlapped_steps,
            "gradients_per_step": self.target,
            "trainable_streamed_params": len(self.items),
            "grad_staging_bytes": int(self._staging.nbytes),
            "grad_staging_pinned": self._staging.pinned,
        }

    def remove(self) -> None:
        self.worker.wait()
        self._finalizer.detach()
        self.worker.close()
        _LIVE.discard(self)
        if not _LIVE:
            for h in _GLOBAL:
                h.remove()
            _GLOBAL.clear()
        self._flush()
        stepped_note = False
        for it in self.items:
            it.hook.remove()
            if self._on_host:
                g = it.param.grad  # after after_backward(): what the user sees (None after zero_grad())
            else:
                g = None if it.grad_in is None else (it.staging if it.grad_in == "staging" else it.acc)
            # handed back in the parameter's own dtype (a bf16 parameter's fp32 gradient is refused by torch);
            # none where the step already ran during backward (the resident step() would apply it twice)
            dtype = it.unit.tensors[it.index].dtype
            it.param._offload_grad = g.detach().to(dtype, copy=True) if g is not None and not it.stepped else None
            if g is not None and it.stepped and not stepped_note:
                stepped_note = True
                warnings.warn(
                    f"{it.name}: remove() came between after_backward() and optimizer.step(), after the step had already "
                    "run during backward: the parameters hold its result, and their gradients are not handed back (a "
                    "resident step() would apply them twice). Pass overlap_optimizer_step=False to keep them", stacklevel=3)
            state = it.opt.state.get(it.param) if it.opt is not None else None
            for k, v in (state or {}).items():  # the fp32 masters' state, for the parameter's own dtype
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype:
                    state[k] = v.to(dtype)
            it.param.grad = None
            if self._on_host:  # remove() gives it its values back from the store
                it.param.data = self.engine.binder.placeholder_for(it.unit.tensors[it.index])
        self.engine.remove_cycle_callback(self._take_back)
        self.engine.masters.remove_hooks(self._flush, self._written)
        self._staging.close()
