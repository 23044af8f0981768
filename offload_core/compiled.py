"""Compiled blocks: the repeated blocks' forward compiled with ``torch.compile`` (regional, static
shapes), the engine's hooks outside the compiled region.

- Which blocks: the items of the model's block lists (``units.find_block_lists``, the one authority).
  Under the engine each must be streamed whole (block granularity), so its binding hooks run in the
  block's ``__call__``, around the compiled forward, never inside it.
- One ``torch.compile`` per block class, shared by its instances: dynamo keeps its graphs on the
  class's code object and, since nn modules are inlined (torch >= 2.5), a block's tensors are graph
  inputs guarded by dtype, shape and stride only. A unit bound to another slot is the same graph
  with other inputs: swapping the weights never recompiles. Instances compile again only where
  their inputs differ (Flux's first double block gets a hidden state that needs no grad).
- fp8 storage needs nothing here: the transfer widens a unit into its slot before the block runs.
- Counted per compiler (``stats()``): graphs compiled while its blocks ran, those compiled after
  the first cycle (recompiles), and the seconds spent compiling them, the lazy backward compile of
  the same frames included (torch's compile callbacks, matched by compile id); and inductor's
  FX-graph cache hits and misses since the compiler was made (a later job that finds the graphs in
  the cache folder compiles in seconds: jobs point it at the state dir, jobs/runners/load.py).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .errors import OffloadConfigError

__all__ = ["BlockCompiler", "compile_blocks", "inductor_cache", "refuse_patched"]

_local = threading.local()  # .owner: the compiler whose block is running in this thread
_owners: dict[str, weakref.ref] = {}  # compile id -> its compiler (a backward compiled later is matched by it)
_lock = threading.Lock()


def _call(args: Any) -> tuple[str, str]:
    """(trigger, compile id) of a callback's argument: DYNAMO (a frame traced and compiled) or
    LAZY_BACKWARD (its backward, compiled at the first backward pass), matched by compile id."""
    trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
    return trigger, str(getattr(args, "compile_id", ""))


def _on_start(args: Any = None) -> None:
    trigger, cid = _call(args)
    with _lock:
        if trigger == "DYNAMO":  # ours when one of our blocks runs in this thread (ids restart after a reset)
            owner = getattr(_local, "owner", None)
            if owner is None:
                _owners.pop(cid, None)
            else:
                _owners[cid] = weakref.ref(owner)
        ref = _owners.get(cid) if trigger in ("DYNAMO", "LAZY_BACKWARD") else None
    owner = ref() if ref is not None else None
    if owner is not None:
        owner._started[cid] = time.perf_counter()


def _on_end(args: Any = None) -> None:
    trigger, cid = _call(args)
    with _lock:
        ref = _owners.get(cid) if trigger in ("DYNAMO", "LAZY_BACKWARD") else None
    owner = ref() if ref is not None else None
    if owner is None:
        return
    t0 = owner._started.pop(cid, None)
    if t0 is not None:
        owner.seconds += time.perf_counter() - t0
    if trigger == "DYNAMO":
        owner.graphs += 1
        if owner.cycle() > 1:
            owner.recompiles += 1


def _install_callbacks() -> None:
    """torch's compile start/end callbacks, once (module functions, so no compiler is kept alive).
    Checked at every block call: ``torch._dynamo.reset()`` clears them."""
    from torch._dynamo.callback import callback_handler  # imported by torch.compile already: a dict lookup

    if _on_start in callback_handler.start_callbacks:
        return
    with _lock:
        if _on_start not in callback_handler.start_callbacks:
            callback_handler.register_start_callback(_on_start)
            callback_handler.register_end_callback(_on_end)


def inductor_cache() -> dict[str, int]:
    """Inductor's FX-graph cache lookups so far in this process (hits: graphs a prior compile, in
    this process or another sharing the cache folder, already made; ``TORCHINDUCTOR_CACHE_DIR``)."""
    from torch._dynamo.utils import counters

    return {k: int(counters["inductor"].get(f"fxgraph_cache_{k}", 0)) for k in ("hit", "miss")}


def refuse_patched(blocks: list[nn.Module]) -> None:
    """A block whose forward or call is already replaced (compiled twice, or by ``module.compile()``,
    which would put the engine's hooks inside the graph) is refused, naming its class."""
    for block in blocks:
        if "forward" in block.__dict__ or getattr(block, "_compiled_call_impl", None) is not None:
            raise OffloadConfigError(
                f"compile: a {type(block).__name__} is compiled or patched already (its own forward, or "
                "module.compile() / compile_repeated_blocks()); compile it one way: leave compile off, or undo the other")


class BlockCompiler:
    """Each block's ``forward`` replaced by its class's compiled forward; ``remove()`` gives it back.

    ``cycle()`` says which cycle (step) runs now: a graph compiled after the first is a recompile.
    """

    def __init__(self, blocks: list[nn.Module], cycle: Callable[[], int] | None = None) -> None:
        _install_callbacks()
        self.cycle = cycle or (lambda: 1)
        self.graphs = 0
        self.recompiles = 0
        self.seconds = 0.0
        self._cache0 = inductor_cache()  # process-wide counters: what this compiler adds is the difference
        self._started: dict[str, float] = {}
        self._blocks: list[nn.Module] = []
        self.handles: list[Any] = []  # hooks that go with the compiled blocks (compile_blocks' call counter)
        refuse_patched(blocks)
        by_class: dict[type, Callable] = {}
        for block in blocks:
            cls = type(block)
            compiled = by_class.get(cls)
            if compiled is None:
                compiled = by_class[cls] = torch.compile(cls.forward, dynamic=False)
            block.forward = self._wrap(compiled, block)
            self._blocks.append(block)

    def _wrap(self, compiled: Callable, block: nn.Module) -> Callable:
        owner = weakref.ref(self)  # the block keeps its forward: it must not keep the compiler alive
        block_ref = weakref.ref(block)

        def forward(*args: Any, **kwargs: Any) -> Any:
            _install_callbacks()
            previous = getattr(_local, "owner", None)
            _local.owner = owner()
            try:
                return compiled(block_ref(), *args, **kwargs)
            finally:
                _local.owner = previous
        return forward

    def stats(self) -> dict[str, Any]:
        cache = inductor_cache()
        return {"compiled_blocks": len(self._blocks), "compile_graphs": self.graphs,
                "recompiles": self.recompiles, "compile_seconds": self.seconds,
                "compile_cache_hits": cache["hit"] - self._cache0["hit"],
                "compile_cache_misses": cache["miss"] - self._cache0["miss"]}

    def remove(self) -> None:
        """The blocks run their class's eager forward again (dynamo keeps what it compiled)."""
        for block in self._blocks:
            block.__dict__.pop("forward", None)
        self._blocks.clear()
        for h in self.handles:
            h.remove()
        self.handles.clear()


def compile_blocks(model: nn.Module, blocks: list[nn.Module] | None = None) -> BlockCompiler:
    """Compile ``model``'s repeated blocks as the engine's ``compile=True`` does, for a model that is
    not offloaded (the resident reference, the bench's resident-compile): the same graphs to compare."""
    from .units import find_block_lists

    if blocks is None:
        blocks = [b for _, lst in find_block_lists(model) for b in lst.children()]
    if not blocks:
        raise OffloadConfigError(f"compile: {type(model).__name__} has no block list (a ModuleList of at least "
                                 "two blocks) to compile")
    calls = [0]

    def count(module: nn.Module, args: Any) -> None:  # a cycle is a call of the model, as under the engine
        calls[0] += 1

    compiler = BlockCompiler(blocks, cycle=lambda: calls[0])
    compiler.handles.append(model.register_forward_pre_hook(count, prepend=True))
    return compiler
