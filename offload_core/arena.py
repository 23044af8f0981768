"""PinnedArena: the host master copy of every streamed unit, packed into a few exact-size buffers.

It is the engine's RAM host store (see hoststore.py): every unit sits in RAM from setup on, so
``acquire`` is a lookup and ``release`` does nothing. Each unit is one contiguous, 64-byte aligned
slab, so onloading it is one copy. The buffers are ordinary (pageable) CPU allocations registered
with cudaHostRegister (hostmem.HostBuffer): torch's pinned allocator rounds each request up to a
power of two, and pinning tensor by tensor costs ~1.88x the RAM. Registration failing (or no CUDA
at all) falls back to pageable memory, which is correct but slow. Every registration is undone
before its memory is freed, by ``close()`` or by the buffer's finalizer when the arena is dropped.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .hostmem import HostBuffer
from .units import ALIGN, Unit

__all__ = ["PinnedArena"]

_CHUNK = 1 << 30  # slabs are grouped into buffers of about this size


class PinnedArena:
    """A HostStore holding every unit in (pinned) RAM."""

    filled = False

    def __init__(self, units: Sequence[Unit], *, pin: bool, chunk_bytes: int = _CHUNK) -> None:
        self.pin_requested = pin
        self.host_store_reason = ""
        self.pinned_limit_bytes = 0  # the limit _pin_or_bounce checked this arena against
        self._buffers: list[HostBuffer] = []
        self._slabs: dict[int, torch.Tensor] = {}
        groups: list[list[Unit]] = [[]]
        size = 0
        for u in units:
            if groups[-1] and size + u.store_nbytes > chunk_bytes:
                groups.append([])
                size = 0
            groups[-1].append(u)
            size += u.store_nbytes
        self.used_bytes = 0
        self.capacity_bytes = 0
        self.allocated_bytes = 0
        for group in groups:
            if not group:
                continue
            # Page-aligned, so registration covers exactly our bytes.
            hb = HostBuffer(sum(u.store_nbytes for u in group))
            off = 0
            for u in group:
                self._slabs[u.uid] = hb.tensor[off: off + u.store_nbytes]
                off += u.store_nbytes
            self._buffers.append(hb)
            self.used_bytes += sum(t.store_nbytes + t.scale_nbytes for u in group for t in u.tensors)  # data, no padding
            self.capacity_bytes += hb.nbytes  # what is registered (pinned)
            self.allocated_bytes += hb._raw.numel()  # plus up to a page of alignment skew per buffer

    def buffers(self) -> list[torch.Tensor]:
        """The page-aligned buffers the slabs are cut from (a bounce store in register mode locks parts of them)."""
        return [b.tensor for b in self._buffers]

    @property
    def pinned(self) -> bool:
        return bool(self._buffers) and all(b.pinned for b in self._buffers)

    # ------------------------------------------------------------------ HostStore
    def follow_trace(self, trace: Sequence[int]) -> None:
        """Everything is in RAM already: nothing to schedule."""

    def acquire(self, uid: int, *, block: bool = True) -> torch.Tensor | None:
        return self._slabs[uid]

    def release(self, uid: int, after: Any = None) -> None:
        """Nothing to give back: the slab stays where it is."""

    def unuse(self, uid: int) -> None:
        """No trace followed: nothing to undo."""

    def master(self, uid: int) -> torch.Tensor:
        return self._slabs[uid]

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        """The host master of one tensor of a unit, typed (in its storage dtype) and shaped."""
        t = unit.tensors[index]
        raw = self._slabs[unit.uid][t.store_offset: t.store_offset + t.store_nbytes]
        return raw.view(t.store_dtype or t.dtype).view(t.shape)

    def stats(self) -> dict[str, Any]:
        return {"host_store": "arena", "host_store_reason": self.host_store_reason,
                "pinned_limit_bytes": self.pinned_limit_bytes,
                "host_arena_bytes": self.allocated_bytes, "host_buffers": len(self._buffers)}

    def close(self) -> None:
        for b in self._buffers:
            b.close()
        self._buffers.clear()
        self._slabs.clear()

    # ------------------------------------------------------------------ setup
    def pin(self) -> bool:
        """Register every buffer with CUDA (when asked at construction). Returns whether all are pinned."""
        if not self.pin_requested:
            return False
        for b in self._buffers:
            if not b.pin():
                break  # the next ones would fail the same way; the arena streams from pageable memory
        return self.pinned

    def unpin(self) -> None:
        """Undo every registration (after a partial pin failed), keeping the bytes: pageable again."""
        for b in self._buffers:
            b.unpin()

    def slab(self, uid: int) -> torch.Tensor:
        return self._slabs[uid]

    @staticmethod
    def slack_bytes(units: list[Unit]) -> int:
        """Alignment padding the layout adds on top of the raw tensor bytes."""
        return sum(u.store_nbytes - sum(t.store_nbytes + t.scale_nbytes for t in u.tensors) for u in units) + ALIGN
