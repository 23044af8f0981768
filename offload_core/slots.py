"""SlotRing: pre-allocated device buffers that streamed units are copied into.

Every slot is sized to the largest streamed unit, and a unit's tensors become views into its slot.
A slot is free for reuse when nothing but the ring references its storage: parameters bound to it,
activations autograd saved from it (``weight.t()``), and recomputed tensors a checkpoint holds all
keep the storage's use count up. That makes reuse safe by construction; the ``done`` event recorded
on the compute stream then orders the overwrite after every kernel already queued against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["Slot", "SlotRing"]


def _use_count(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


@dataclass
class Slot:
    index: int
    buf: torch.Tensor  # uint8, slot_bytes long
    baseline: int = 0  # storage use count when only the ring holds it
    owner: int | None = None  # uid of the unit whose bytes are (or are being) copied in
    ready: object | None = None  # event on the copy stream: owner's bytes have landed
    done: list = field(default_factory=list)  # events that must pass before overwrite
    last_use: int = 0
    unused: bool = False  # owner's copy was loaded and not used since (a prefetch)
    _typed: dict = field(default_factory=dict, repr=False)

    @property
    def ptr(self) -> int:
        return self.buf.data_ptr()

    def is_free(self) -> bool:
        return _use_count(self.buf) <= self.baseline

    def typed(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole buffer viewed as ``dtype``, kept: one strided view per tensor then binds it.

        The kept view holds the storage too, so the baseline use count rises with it.
        """
        t = self._typed.get(dtype)
        if t is None:
            before = _use_count(self.buf)
            usable = self.buf.numel() // dtype.itemsize * dtype.itemsize
            # kept for every later use: made outside inference mode even when the first use is in it,
            # or every weight view cut from it would be an inference tensor (no grad-enabled pass could
            # save one, and in-place buffer updates would have no version to show)
            with torch.inference_mode(False):
                t = self.buf[:usable].view(dtype)
            self._typed[dtype] = t
            self.baseline += _use_count(self.buf) - before
        return t


class SlotRing:
    def __init__(self, slot_bytes: int, count: int, device: torch.device) -> None:
        self.slot_bytes = max(slot_bytes, 1)
        self.device = device
        self.slots: list[Slot] = []
        self.by_ptr: dict[int, Slot] = {}
        self.by_owner: dict[int, Slot] = {}
        self.sticky: dict[int, Slot] = {}  # uid -> a buffer of the unit's own, never reused by others
        self.grows = 0
        for _ in range(count):
            self._add()

    def _add(self) -> Slot:
        with torch.inference_mode(False):  # a slot added during an inference-mode call outlives it
            buf = torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)
        slot = Slot(index=len(self.slots), buf=buf)
        slot.baseline = _use_count(buf)
        self.slots.append(slot)
        self.by_ptr[slot.ptr] = slot
        return slot

    def grow(self) -> Slot:
        """One more slot for a load that found none free (counted: it means the ring was too small)."""
        self.grows += 1
        return self._add()

    def add_slots(self, k: int) -> None:
        """Planned extra slots (not counted as grows)."""
        for _ in range(k):
            self._add()

    def resize(self, n: int, keep: Iterable[int] = ()) -> list[int]:
        """Grow to n slots, or shrink toward n by dropping free slots (empty ones first), never one
        whose owner is in ``keep`` or that something still references. Returns the owners of dropped
        slots whose copies were not used since they were loaded (prefetches to redo)."""
        unused: list[int] = []
        if n > len(self.slots):
            self.add_slots(n - len(self.slots))
            return unused
        keep = set(keep)
        for s in sorted(self.slots, key=lambda s: (s.owner is not None, s.last_use)):
            if len(self.slots) <= n:
                break
            if (s.owner is not None and s.owner in keep) or not s.is_free():
                continue
            self.slots.remove(s)
            self.by_ptr.pop(s.ptr, None)
            if s.owner is not None:
                self.by_owner.pop(s.owner, None)
                if s.unused:
                    unused.append(s.owner)
        return unused

    def forget(self, uid: int) -> None:
        """uid's device copy is stale: its slot holds nothing any more (a sticky slot stays uid's)."""
        slot = self.by_owner.pop(uid, None)
        if slot is not None:
            slot.owner = None
            slot.ready = None

    def add_sticky(self, uid: int, nbytes: int) -> Slot:
        with torch.inference_mode(False):
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        slot = Slot(index=-1, buf=buf)
        slot.baseline = _use_count(buf)
        self.sticky[uid] = slot
        self.by_ptr[slot.ptr] = slot
        # The unit's bytes may still sit in a ring slot: that slot is free again.
        old = self.by_owner.pop(uid, None)
        if old is not None:
            old.owner = None
        return slot

    def drop_sticky(self, uid: int) -> None:
        """Forget uid's own buffer (freed once nothing references it); it streams through the ring again."""
        slot = self.sticky.pop(uid, None)
        if slot is None:
            return
        self.by_ptr.pop(slot.ptr, None)
        if self.by_owner.get(uid) is slot:
            del self.by_owner[uid]

    @property
    def capacity_bytes(self) -> int:
        return self.slot_bytes * len(self.slots)

    @property
    def sticky_bytes(self) -> int:
        return sum(s.buf.numel() for s in self.sticky.values())

    def lookup(self, uid: int) -> Slot | None:
        return self.by_owner.get(uid)

    def pick_victim(self, keep: set[int]) -> Slot | None:
        """A free slot, preferring empty ones, then the least recently used owner not in keep."""
        best: Slot | None = None
        for s in self.slots:
            if s.owner is not None and s.owner in keep:
                continue
            if not s.is_free():
                continue
            if s.owner is None:
                return s
            if best is None or s.last_use < best.last_use:
                best = s
        return best

    def assign(self, slot: Slot, uid: int) -> int | None:
        """Give slot to uid; returns the previous owner (an eviction) if there was one."""
        prev = slot.owner
        if prev is not None:
            self.by_owner.pop(prev, None)
        slot.owner = uid
        self.by_owner[uid] = slot
        return prev

    def clear(self) -> None:
        self.slots.clear()
        self.sticky.clear()
        self.by_ptr.clear()
        self.by_owner.clear()
