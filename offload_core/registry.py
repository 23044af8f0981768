"""Which modules have a live engine: a second ``enable_offload`` on any of them is refused.

Two engines on one module would each pack the other's placeholders, hook the same forwards and
restore different data on ``remove()``. The registry holds the models weakly: a model that dies
takes its entry with it, and ``remove()`` takes it out at once.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

from .errors import AlreadyOffloadedError

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["forget", "note", "refuse_if_offloaded"]

_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def refuse_if_offloaded(model: nn.Module) -> None:
    mine = {id(m): n for n, m in model.named_modules()}
    for root, ref in list(_ACTIVE.items()):
        if ref() is None:
            continue
        if root is model:
            raise AlreadyOffloadedError("model: this module is already offloaded; call remove() on its handle "
                                        "(or manager) before enabling offload again")
        theirs = {id(m): n for n, m in root.named_modules()}
        if id(model) in theirs:
            raise AlreadyOffloadedError(f"model: this module is {theirs[id(model)]!r} of a model that is already "
                                        "offloaded; call remove() on that model's handle first")
        inside = [mine[i] for i in theirs & mine.keys()]
        if inside:
            raise AlreadyOffloadedError(f"model: its submodule {min(inside)!r} is already offloaded; call remove() "
                                        "on that handle first")


def note(model: nn.Module, engine: OffloadEngine) -> None:
    _ACTIVE[model] = weakref.ref(engine)


def forget(model: nn.Module) -> None:
    _ACTIVE.pop(model, None)
