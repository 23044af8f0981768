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
import logging
import weakref

import torch

from .format import FILE_ALIGN, align

__all__ = ["HostPool", "trim_host_heap"]

log = logging.getLogger(__name__)

try:  # offload_core part 3: registered host buffers with a finalizer and CUDA error clearing
    from ..hostmem import HostBuffer, trim_host_heap
except ImportError:  # until it is merged: the same contract, kept here (delete this branch then)
    from ..arena import host_buffer, trim_host_heap

    def _release(reg: list) -> None:
        if reg[0]:
            reg[0] = False
            torch.cuda.synchronize()  # no copy still reads the pages as they stop being pinned
            torch.cuda.cudart().cudaHostUnregister(reg[1])

    class HostBuffer:  # type: ignore[no-redef]
        def __init__(self, nbytes: int, *, pin: bool = False) -> None:
            self.tensor, self._raw = host_buffer(nbytes)
            self.nbytes = nbytes
            self._reg = [False, self.tensor.data_ptr()]
            self._finalizer = weakref.finalize(self, _release, self._reg)  # holds the address, not the buffer
            self._finalizer.atexit = False
            if pin:
                self.pin()

        @property
        def pinned(self) -> bool:
            return self._reg[0]

        def pin(self) -> bool:
            if self._reg[0] or not self.nbytes or not torch.cuda.is_available():
                return self._reg[0]
            err = int(torch.cuda.cudart().cudaHostRegister(self._reg[1], self.nbytes, 0))
            if err != 0:
                log.warning("cudaHostRegister of a %d-byte disk cache failed (%s); reading into pageable memory",
                            self.nbytes, err)
                return False
            self._reg[0] = True
            return True

        def close(self) -> None:
            self._finalizer()


class HostPool:
    """First-fit allocation of FILE_ALIGN-aligned slabs out of one host buffer."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.capacity_bytes = align(nbytes)
        self._host = HostBuffer(self.capacity_bytes, pin=pin)
        self.buf = self._host.tensor
        self._free: list[tuple[int, int]] = [(0, self.capacity_bytes)] if self.capacity_bytes else []  # (start, end)
        self.used_bytes = 0

    @property
    def pinned(self) -> bool:
        return self._host.pinned

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

    def slab(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset: offset + align(max(nbytes, 1))]

    def close(self) -> None:
        self._free = []
        self.buf = torch.empty(0, dtype=torch.uint8)
        self._host.close()
