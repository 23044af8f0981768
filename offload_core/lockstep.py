"""Layer-major gradient accumulation: K micro-batches through each streamed unit before the next.

    losses = handle.accumulate(micro_batches, loss_fn)   # loss_fn(batch) -> scalar loss (scaled by 1/K)
    optimizer.step(); optimizer.zero_grad()

With ``accumulation_order="micro"`` (the default) ``accumulate`` is the plain loop
(``loss_fn(b).backward()`` for each batch), which streams the model K times per optimizer step. With
``"layer"`` each weight crosses the link as often as for one micro-batch, and the gradients are
bitwise those of the plain loop. How:

- **Forward in lockstep.** One worker thread per micro-batch runs ``loss_fn(batch)``, one at a time:
  a baton passes at every streamed unit's entry (the Binder's pre-hook calls ``arrive``), round robin
  in micro-batch order, so the engine sees each unit K times in a row and copies it once.
- **One backward.** ``torch.autograd.backward`` over the K losses. Autograd runs ready nodes by
  descending sequence number, a number each thread counts for itself. At every hand-over a worker
  skips ahead to just above where the worker before it in the round ended (``Lockstep._turn``): each
  round's ranges lie above all of the last round's, so the backward (and a checkpoint's recompute) is
  layer-major too, and within a round micro-batch K's range lies above K-1's, ..., each range exactly
  as wide as that worker's segment turned out, so the backward finishes one micro-batch's part of a
  unit before the next starts (one recompute's activations alive, not K), from the first call on.
- **Same additions.** Each worker sees its own alias of every trainable parameter (the same storage,
  a leaf of its own), and the aliases' gradients are added into ``.grad`` in order 1..K, each as soon
  as the earlier ones are in (a unit's K gradients at most wait for that unit's backward): the fp32
  additions K ``backward()`` calls make, whatever order autograd ran in.

Limits (docs/engine.md): trainable parameters must not be streamed (optimizer offload); a forward
that draws random numbers inside the model (dropout) is refused (``LayerOrderError``); hooks on a
trainable parameter do not fire (its aliases get the gradients); reentrant checkpointing
(``use_reentrant=True``) and loss terms on parameters captured before the call add into ``.grad``
directly, in autograd's order (equal within rounding, not bitwise).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .errors import LayerOrderError, OffloadConfigError

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["Lockstep", "accumulate"]

ORDERS = ("micro", "layer")
_PAD_LIMIT = 1 << 18  # most sequence numbers a worker skips at one hand-over (see Lockstep._resume)


class _Aborted(Exception):
    """Unwinds a parked worker when another one failed. An Exception, so torch runs the always_call
    forward hooks on the way out (the engine's unbinding and cycle end)."""


def _seq() -> int:
    return torch._C._autograd._get_sequence_nr()


def _rng_mark() -> tuple:
    """Where the default generators stand: a draw between two marks moves one."""
    cpu = torch.random.default_generator.get_state()
    if not torch.cuda.is_initialized():
        return (cpu,)
    return (cpu, *(_cuda_mark(g) for g in torch.cuda.default_generators))


def _cuda_mark(g: torch.Generator) -> Any:
    try:
        return g.get_offset()  # philox: a draw moves the offset
    except (AttributeError, RuntimeError):
        return g.get_state()


def _same_mark(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


class _Aliases:
    """Per worker, a leaf of its own for every trainable parameter the forward reads from a module table.

    A worker's gradient is added into the parameter's ``.grad`` as soon as every earlier worker's is
    in (the backward runs micro-batch K's part of a unit first, so a unit's gradients wait for that
    unit's backward, not the whole backward's). ``reduce`` adds what is left, in order."""

    def __init__(self, model: nn.Module, k: int) -> None:
        self.slots: list[tuple[dict, str, int]] = []  # (module table, name, index into params)
        self.params: list[nn.Parameter] = []
        index: dict[int, int] = {}
        for m in model.modules():
            for name, p in m._parameters.items():
                if p is None or not p.requires_grad:
                    continue
                i = index.setdefault(id(p), len(self.params))
                if i == len(self.params):
                    self.params.append(p)
                self.slots.append((m._parameters, name, i))
        # one leaf per worker and parameter: the same storage, so the optimizer's updates reach it
        self.per_worker = [[nn.Parameter(p.detach(), requires_grad=True) for p in self.params] for _ in range(k)]
        self._next = [0] * len(self.params)  # per parameter: the first worker whose gradient is not added yet
        self.early = 0  # gradients added while the backward ran
        for w, leaves in enumerate(self.per_worker):
            for i, leaf in enumerate(leaves):
                leaf.register_post_accumulate_grad_hook(self._landed(w, i))

    def install(self, w: int) -> None:
        leaves = self.per_worker[w]
        for table, name, i in self.slots:
            table[name] = leaves[i]

    def restore(self) -> None:
        for table, name, i in self.slots:
            table[name] = self.params[i]

    def _landed(self, w: int, i: int) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            if w != self._next[i]:
                return  # an earlier worker's is still to come (or never comes: reduce() adds it in turn)
            with torch.no_grad():
                while self._next[i] < len(self.per_worker) and self.per_worker[self._next[i]][i].grad is not None:
                    self._add(i, self.per_worker[self._next[i]][i])
                    self._next[i] += 1
                    self.early += 1
        return hook

    def _add(self, i: int, leaf: torch.Tensor) -> None:
        p, g = self.params[i], leaf.grad
        leaf.grad = None
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g

    @torch.no_grad()
    def reduce(self) -> None:
        """Each parameter's gradient += the workers' in order 1..K, as K backward() calls add them."""
        for i in range(len(self.params)):
            for leaves in self.per_worker[self._next[i]:]:
                if leaves[i].grad is not None:
                    self._add(i, leaves[i])
            self._next[i] = len(self.per_worker)


class Lockstep:
    """Runs K callables in worker threads, one at a time, switching at every streamed unit's entry."""

    def __init__(self, k: int, on_resume: Callable[[int], None], context: Callable[[], Any]) -> None:
        self.k = k
        self._on_resume = on_resume  # in the worker, each time it takes the baton
        self._context = context  # entered in each worker around its callable (thread-local state)
        self._go = [threading.Semaphore(0) for _ in range(k)]
        self._back = threading.Semaphore(0)
        self._local = threading.local()
        self._seq_at = [0] * k  # each worker's sequence number where its last segment ended
        self._target = [0] * k  # where its next segment starts (set by the caller before each turn)
        self._abort = False
        self._done = [False] * k
        self._holder: int | None = None  # the worker holding the baton, while the caller waits for it
        self.results: list[Any] = [None] * k
        self.errors: list[BaseException | None] = [None] * k
        self.switches = 0
        self.padded = 0
        self._rng: list[tuple | None] = [None] * k  # each worker's generators' mark when it took the baton
        self.drew_random = False  # a draw inside the model, between two unit entries (see _layer_major)

    # ------------------------------------------------------------------ in the workers
    def arrive(self) -> None:
        """A streamed unit is about to be entered: hand the baton on (a no-op outside the workers)."""
        w = getattr(self._local, "index", None)
        if w is None:
            return
        self._seq_at[w] = _seq()
        mark = self._rng[w]
        if mark is not None and not self.drew_random and not _same_mark(mark, _rng_mark()):
            self.drew_random = True
        self._back.release()
        self._go[w].acquire()
        self._resume(w)
        self._arrived(w)

    def _resume(self, w: int) -> None:
        if self._abort:
            raise _Aborted
        behind = self._target[w] - _seq()
        if 0 < behind <= _PAD_LIMIT:
            # skip to just above where the worker before it in the round ended (run): one tiny
            # autograd node a number, dropped at once
            self.padded += behind
            pad = torch.zeros((), requires_grad=True)
            for _ in range(behind):
                pad.view(())
        self._on_resume(w)

    def _arrived(self, w: int) -> None:
        """From its first unit on, a worker's segments lie inside the model: watch them for random draws."""
        self._rng[w] = _rng_mark()

    def _body(self, w: int, fn: Callable[[], Any]) -> None:
        self._local.index = w
        self._go[w].acquire()
        try:
            self._resume(w)
            with self._context():
                self.results[w] = fn()
        except _Aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self.errors[w] = exc
        finally:
            self._seq_at[w] = _seq()  # its last segment's end: the next round starts above it
            self._done[w] = True
            self._back.release()

    # ------------------------------------------------------------------ in the caller
    def run(self, fns: Sequence[Callable[[], Any]]) -> list[Any]:
        threads = [threading.Thread(target=self._body, args=(w, fn), name=f"offload-lockstep-{w}", daemon=True)
                   for w, fn in enumerate(fns)]
        for t in threads:
            t.start()
        alive = list(range(self.k))
        try:
            while alive:
                top = max(self._seq_at)  # every range of the last round lies below
                for w in alive:
                    # this worker's segment starts where the one before it in the round ended: the ranges
                    # stack up exactly, however wide each segment turns out (autograd runs the highest first)
                    self._target[w] = top
                    self._turn(w)
                    top = max(top, self._seq_at[w])
                    if self.errors[w] is not None and not self._abort:
                        self._abort = True
                alive = [w for w in alive if not self._done[w]]
                self.switches += len(alive)
        finally:
            if not all(self._done):  # a KeyboardInterrupt in the caller: unwind the parked workers
                self._abort = True
                if self._holder is not None:  # the one running now parks (or ends) first: one at a time
                    self._back.acquire()
                    self._holder = None
                for w in range(self.k):
                    if not self._done[w]:
                        self._turn(w)
            for t in threads:
                t.join()
        first = next((e for e in self.errors if e is not None), None)
        if first is not None:
            raise first
        return self.results

    def _turn(self, w: int) -> None:
        self._holder = w
        self._go[w].release()
        self._back.acquire()
        self._holder = None


def _check_order(order: str) -> str:
    if order not in ORDERS:
        raise OffloadConfigError(f"accumulation_order: unknown value {order!r} (choose {' or '.join(ORDERS)})")
    return order


def _loss_of(result: Any) -> torch.Tensor:
    loss = result[0] if isinstance(result, (tuple, list)) else result
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"accumulate: loss_fn must return a loss tensor (or a tuple that starts with one), "
                        f"got {type(loss).__name__}")
    return loss


def _detached(result: Any) -> Any:
    if isinstance(result, torch.Tensor):
        return result.detach()
    if isinstance(result, (tuple, list)):
        return type(result)(_detached(r) for r in result)
    return result


def accumulate(engine: OffloadEngine, micro_batches: Iterable[Any], loss_fn: Callable[[Any], Any],
               order: str | None = None) -> list[Any]:
    """Forward and backward of every micro-batch, gradients accumulated into ``.grad`` (see the module doc).

    Returns what ``loss_fn`` returned for each batch, detached."""
    order = _check_order(order or engine.config.accumulation_order)
    batches = list(micro_batches)
    before = engine.counters.h2d_bytes
    try:
        if order == "micro" or len(batches) <= 1 or not engine.streamed:
            results = []
            for b in batches:
                out = loss_fn(b)
                _loss_of(out).backward()
                results.append(_detached(out))
            return results
        return _layer_major(engine, batches, loss_fn)
    finally:
        engine.counters.accumulate_calls += 1
        engine.counters.accumulate_h2d_bytes += engine.counters.h2d_bytes - before


def _layer_major(engine: OffloadEngine, batches: list[Any], loss_fn: Callable[[Any], Any]) -> list[Any]:
    if any(u.trainable for u in engine.streamed):
        raise OffloadConfigError(
            "accumulation_order: layer needs the trainable parameters resident; with enable_optimizer_cpu_offload "
            "they stream (use accumulation_order: micro)")
    if not torch.is_grad_enabled():
        raise RuntimeError("accumulate: called with grad disabled (torch.no_grad): there is nothing to accumulate")
    k = len(batches)
    aliases = _Aliases(engine.model, k)
    grad_on = torch.is_grad_enabled()
    stream = engine.transfer.compute_stream() if engine.is_cuda else None
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    autocast = [(dev, torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda") if torch.is_autocast_enabled(dev)]

    @contextlib.contextmanager
    def worker_state() -> Any:
        # what is thread-local in torch and a new thread would not see: grad mode, the stream, autocast,
        # and the engine's saved-tensor hooks (weights saved as references)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad_on))
            if device is not None:
                stack.enter_context(torch.cuda.device(device))
            if stream is not None:
                stack.enter_context(torch.cuda.stream(stream))
            for dev, dtype in autocast:
                stack.enter_context(torch.autocast(dev, dtype=dtype))
            stack.enter_context(engine.saved_weight_refs())
            yield

    ls = Lockstep(k, aliases.install, worker_state)
    engine.begin_group(ls)
    try:
        results = ls.run([lambda b=b: loss_fn(b) for b in batches])
    finally:
        aliases.restore()
        engine.end_group()
    if ls.drew_random:
        # a checkpoint stashes the generator's state at its entry, where every worker stood at once, and
        # replays each block's draws from there: they would not be the draws its forward made
        raise LayerOrderError(
            "accumulation_order: layer: the model's forward draws random numbers (dropout > 0?), which layer-major "
            "order cannot replay as a plain loop draws them; set the model's dropout to 0 or use accumulation_order: "
            "micro (no gradients were accumulated)")
    losses = [_loss_of(r) for r in results]
    torch.autograd.backward(losses)
    aliases.reduce()
    engine.counters.lockstep_switches += ls.switches
    engine.counters.lockstep_pad_nodes += ls.padded
    return [_detached(r) for r in results]
