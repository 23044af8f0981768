"""Optimizer offload: host masters and host gradients for streamed trainable parameters.

Each trainable parameter is streamed like a frozen one. Its fp32 master lives on the host (the arena
slab itself when the parameter is fp32). Once autograd has accumulated a gradient on the device, a
hook copies it to pinned staging on the D2H stream and frees the device copy; a worker thread waits
for the copy and adds it into the host accumulator, so several backward passes add up (gradient
accumulation). ``after_backward`` points ``.data`` and ``.grad`` at the host tensors, so an ordinary
torch optimizer steps on the CPU.

With ``overlap_optimizer_step`` the worker also steps each parameter as soon as its last
micro-batch gradient lands, while backward goes on, through a one-parameter twin of the user's
optimizer that shares its state dict; ``optimizer.step()`` then only waits for the worker.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any, Callable

import torch
from torch import nn

from .arena import pinned_empty, unregister
from .engine import OffloadEngine

__all__ = ["OptimizerOffload"]


class _Trainable:
    __slots__ = ("param", "unit", "index", "name", "master", "staging", "acc", "has_grad", "stepped",
                 "micro", "hook", "twin", "twin_param", "group", "direct")

    def __init__(self, **kw: Any) -> None:
        self.has_grad = False
        self.stepped = False
        self.micro = 0
        self.twin = self.twin_param = self.group = None
        self.direct = False  # the gradient is used from the staging buffer, with no accumulator copy
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


class OptimizerOffload:
    def __init__(self, engine: OffloadEngine, optimizer: torch.optim.Optimizer | None = None) -> None:
        cfg = engine.config
        self.engine = engine
        self.optimizer = optimizer
        self.overlap = bool(cfg.overlap_optimizer_step)
        if self.overlap and optimizer is None:
            from .errors import OffloadConfigError

            raise OffloadConfigError("overlap_optimizer_step: pass the optimizer to the manager (optimizer=...)")
        self.accumulation = cfg.gradient_accumulation_steps
        names = {id(p): n for n, p in engine.model.named_parameters(remove_duplicate=False)}
        self.items: list[_Trainable] = []
        for u in engine.streamed:
            for i, ts in enumerate(u.tensors):
                if ts.is_param and ts.tensor().requires_grad:
                    self.items.append(_Trainable(param=ts.tensor(), unit=u, index=i, name=names.get(id(ts.tensor()), ts.attr)))
        total = sum(it.unit.tensors[it.index].nbytes for it in self.items)
        self._staging_buf, self._pinned = pinned_empty(total, pin=engine.is_cuda)
        groups = {}
        if optimizer is not None:
            groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        off = 0
        for it in self.items:
            ts = it.unit.tensors[it.index]
            arena_view = engine.arena.view(it.unit, it.index)
            it.master = arena_view if ts.dtype == torch.float32 else arena_view.float()
            it.staging = self._staging_buf[off: off + ts.nbytes].view(ts.dtype).view(ts.shape)
            off += ts.nbytes
            it.acc = torch.empty(ts.shape, dtype=torch.float32)
            # Overlapped fp32 steps with no accumulation read the landed gradient where it landed:
            # one host copy of every gradient fewer (the step is CPU-bound).
            it.direct = self.overlap and self.accumulation == 1 and ts.dtype == torch.float32
            it.group = groups.get(id(it.param))
            it.hook = it.param.register_post_accumulate_grad_hook(self._make_grad_hook(it))
        self.worker = _Worker()
        self._on_host = False
        self._orig_step = None
        if self.overlap:
            self._install_step_wrapper()
        engine._cycle_callbacks.append(self._take_back)

    # ------------------------------------------------------------------ gradients
    def _make_grad_hook(self, it: _Trainable):
        engine = self.engine

        def hook(p: torch.Tensor) -> None:
            g = p.grad
            if g is None:
                return
            done = None
            if engine.use_streams:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(engine.device))
                engine.d2h_stream.wait_event(ev)
                with torch.cuda.stream(engine.d2h_stream):
                    it.staging.copy_(g, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(engine.d2h_stream)
                g.record_stream(engine.d2h_stream)
            else:
                it.staging.copy_(g)
            p.grad = None
            engine.counters.d2h_bytes += g.numel() * g.element_size()
            engine.counters.d2h_count += 1
            self.worker.submit(lambda: self._land(it, done))

        return hook

    def _land(self, it: _Trainable, done: Any) -> None:
        if done is not None:
            done.synchronize()
        if it.direct:
            it.has_grad = True
            it.micro += 1
            self._step_one(it)
            return
        if it.has_grad:
            it.acc.add_(it.staging)
        else:
            it.acc.copy_(it.staging)
            it.has_grad = True
        it.micro += 1
        if self.overlap and it.micro % self.accumulation == 0:
            self._step_one(it)

    # ------------------------------------------------------------------ overlapped step
    def _step_one(self, it: _Trainable) -> None:
        opt = self.optimizer
        hp = {k: v for k, v in it.group.items() if k != "params"}
        if it.twin is None:
            it.twin_param = nn.Parameter(it.master, requires_grad=True)
            it.twin = type(opt)([dict(hp, params=[it.twin_param])])
            it.twin.state[it.twin_param] = opt.state[it.param]  # one state, seen by both
        else:
            it.twin.param_groups[0].update(hp)
        it.twin_param.grad = it.staging if it.direct else it.acc
        it.twin.step()
        it.twin_param.grad = None
        it.stepped = True

    def _install_step_wrapper(self) -> None:
        opt = self.optimizer
        orig = opt.step
        self._orig_step = orig

        @functools.wraps(orig)  # keeps the LR scheduler's marker on step
        def step(*args: Any, **kwargs: Any) -> Any:
            self.worker.wait()
            # Parameters the worker already stepped must not be stepped twice.
            hidden = [(it.param, it.param.grad) for it in self.items if it.stepped]
            for p, _ in hidden:
                p.grad = None
            try:
                return orig(*args, **kwargs)
            finally:
                for p, g in hidden:
                    p.grad = g

        opt.step = step

    # ------------------------------------------------------------------ step boundaries
    def _take_back(self) -> None:
        """At the start of a forward: collect what the optimizer did, and stream the params again."""
        self.worker.wait()
        if not self._on_host:
            return
        for it in self.items:
            p = it.param
            g = p.grad
            if it.stepped or g is None:
                it.has_grad = False
            elif g is not it.acc:
                it.acc.copy_(g)
                it.has_grad = True
            it.stepped = False
            p.grad = None
            if it.master is not self.engine.arena.view(it.unit, it.index):
                self.engine.arena.view(it.unit, it.index).copy_(it.master)
            ts = it.unit.tensors[it.index]
            p.data = self.engine._trainable_placeholder(ts.dtype, ts.shape)
        # The host masters changed: cached device copies of these units are stale.
        for u in {id(it.unit): it.unit for it in self.items}.values():
            slot = self.engine.ring.lookup(u.uid)
            if slot is not None and slot.is_free():
                self.engine.ring.by_owner.pop(u.uid, None)
                slot.owner = None
        self._on_host = False

    def after_backward(self) -> None:
        self.worker.wait()
        for it in self.items:
            it.param.data = it.master
            it.param.grad = (it.staging if it.direct else it.acc) if (it.has_grad or it.stepped) else None
        self._on_host = True

    def stats(self) -> dict[str, Any]:
        return {
            "optimizer_offload": True,
            "optimizer_step_overlapped": self.overlap,
            "trainable_streamed_params": len(self.items),
            "grad_staging_bytes": int(self._staging_buf.numel()),
            "grad_staging_pinned": self._pinned,
        }

    def remove(self) -> None:
        self.worker.wait()
        self.worker.close()
        if self._orig_step is not None:
            self.optimizer.step = self._orig_step
        for it in self.items:
            it.hook.remove()
            if it.master is not self.engine.arena.view(it.unit, it.index):
                self.engine.arena.view(it.unit, it.index).copy_(it.master)
            it.param._offload_grad = (it.staging if it.direct else it.acc).clone() if it.has_grad else None
            it.param.grad = None
        self.engine._cycle_callbacks.remove(self._take_back)
        if self._pinned:
            unregister(self._staging_buf)
