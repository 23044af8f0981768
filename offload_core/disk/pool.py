"""HostPool: one page-aligned host buffer, pinned once, carved into 4096-aligned slabs.

The cache and the streaming slots live in one allocation registered with cudaHostRegister (one
registration, no per-slab pinning, which costs 0.6 s/GB and rounds to powers of two in torch's
pinned allocator). Slabs start at 4096-byte multiples and are whole multiples of 4096 long, which
is what O_DIRECT asks of a read's buffer and length.

The registration is undone by the buffer's finalizer before its memory is freed, whether or not
``close()`` is called: freeing registered memory leaves CUDA holding a stale mapping.
"""

from __future__ import annotations

import bisect

import torch

from ..hostmem import HostBuffer, trim_host_heap
from .format import align

__all__ = ["HostPool", "Runs", "trim_host_heap"]


class Runs:
    """The bookkeeping of a HostPool with no memory behind it: first fit of FILE_ALIGN-aligned slabs in
    ``nbytes``. The cache's plan (cache.py) replays a cycle of uses on one."""

    def __init__(self, nbytes: int) -> None:
        self.capacity_bytes = align(nbytes)
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)] if self.capacity_bytes else []  # (start, end)
        self.used_bytes = 0

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free block of align(nbytes) bytes, or None when no free run is that long."""
        need = align(max(nbytes, 1))
        for i, (a, b) in enumerate(self._free):
            if b - a >= need:
                if b - a == need:
                    del self._free[i]
                else:
                    self._free[i] = (a + need, b)
                self.used_bytes += need
                return a
        return None

    def alloc_at(self, offset: int, nbytes: int) -> int | None:
        """``offset`` itself, when align(nbytes) bytes from there are free; else None."""
        need = align(max(nbytes, 1))
        for i, (a, b) in enumerate(self._free):
            if a <= offset and offset + need <= b:
                self._free[i: i + 1] = [r for r in ((a, offset), (offset + need, b)) if r[0] < r[1]]
                self.used_bytes += need
                return offset
        return None

    def free_runs(self) -> list[tuple[int, int]]:
        """The free (start, end) runs, in address order."""
        return list(self._free)

    def fits(self, nbytes: int) -> bool:
        need = align(max(nbytes, 1))
        return any(b - a >= need for a, b in self._free)

    def free(self, offset: int, nbytes: int) -> None:
        need = align(max(nbytes, 1))
        self.used_bytes -= need
        i = bisect.bisect(self._free, (offset, offset + need))
        a, b = offset, offset + need
        if i < len(self._free) and self._free[i][0] == b:  # merge with the next run
            b = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == a:  # and the previous one
            a = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (a, b))


class HostPool(Runs):
    """First-fit allocation of FILE_ALIGN-aligned slabs out of one host buffer."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        super().__init__(nbytes)
        self._host = HostBuffer(self.capacity_bytes, pin=pin)
        self.buf = self._host.tensor

    @property
    def pinned(self) -> bool:
        return self._host.pinned

    def slab(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset: offset + align(max(nbytes, 1))]

    def close(self) -> None:
        self._free = []
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._host.close()
