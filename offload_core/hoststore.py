"""HostStore: where the engine gets a unit's bytes from, and gives them back to.

The engine never asks where the bytes live. It asks the store for a unit's slab (``acquire``),
copies it to the device, and hands it back once the copy has read it (``release``, with the copy's
event). ``PinnedArena`` (arena.py) keeps every unit in pinned RAM from setup on, so its acquire is a
lookup and its release does nothing; a disk store reads unit files into a cache of pinned slabs in
trace order (``follow_trace``) and evicts what the trace needs last. The hot path is the same for both.

Writes go through ``master``: in-place-updated buffers written back from the device, optimizer
masters and ``load_state_dict``. A unit written to is the store's to keep (a disk store never
evicts it, since its file no longer holds its bytes).

Optional, with defaults the engine assumes when a store lacks them:

- ``filled: bool = False``: the store already holds every unit's bytes (a shard directory), so the
  engine does not pack the model's tensors into it.
- ``scales(unit, index) -> Tensor``: an fp8 row/block tensor's fp32 scales, for reading
  (``state_dict``); default: the view into ``master(uid)``, which a disk store would have to keep.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import torch

from .units import Unit

__all__ = ["HostStore"]


@runtime_checkable
class HostStore(Protocol):
    pinned: bool            # slabs are page-locked (async H2D possible)
    capacity_bytes: int     # host bytes held for slabs
    used_bytes: int         # tensor bytes currently held

    def follow_trace(self, trace: Sequence[int]) -> None:
        """The traced order of unit uses (one cycle, repeating); called whenever the schedule (re)learns."""

    def acquire(self, uid: int, *, block: bool = True) -> torch.Tensor | None:
        """The unit's slab (uint8, unit.store_nbytes long), valid until release().

        block=False returns None when the bytes are not in host memory yet (the engine then skips
        that prefetch).
        """

    def release(self, uid: int, after: Any = None) -> None:
        """The engine has finished reading the slab once ``after`` (a CUDA event on the copy stream,
        or None = now) completes."""

    def unuse(self, uid: int) -> None:
        """The engine dropped uid's copy before the use it was acquired for, and acquires it again for that
        use (a store that follows the trace must not take the second acquire for the next use)."""

    def master(self, uid: int) -> torch.Tensor:
        """A writable slab for write-back (buffers) and optimizer masters; a unit written to is kept."""

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        """One tensor's host master, typed and shaped (from master())."""

    def stats(self) -> dict[str, Any]:
        """Merged into handle.stats() (disk bytes, cache hits... for a disk store)."""

    def close(self) -> None:
        """Unregister and free everything (also run by a finalizer)."""
