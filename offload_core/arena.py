"""PinnedArena: the host master copy of every streamed unit, packed into a few exact-size buffers.

Each unit is one contiguous, 64-byte aligned slab, so onloading it is one copy. The buffers are
ordinary (pageable) CPU allocations registered with cudaHostRegister: torch's pinned allocator
rounds each request up to a power of two, and pinning tensor by tensor costs ~1.88x the RAM.
Registration failing (or no CUDA at all) falls back to pageable memory, which is correct but slow.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

import torch

from .units import ALIGN, Unit

__all__ = ["PinnedArena", "pinned_empty"]

log = logging.getLogger(__name__)

_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _c_library() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name, use_errno=True) if name else None
        except OSError:
            _libc = None
    return _libc  # type: ignore[return-value]


def host_buffer(nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A page-aligned host buffer of exactly ``nbytes`` (and the allocation that holds it).

    It asks Linux for transparent huge pages before anything touches it: packing then faults in
    2 MB pages instead of 4 KB ones, and registration pins 512x fewer pages, which is most of setup
    time on a fresh buffer. Where that is not available the buffer is an ordinary one.
    """
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    skew = (-raw.data_ptr()) % _PAGE
    buf = raw[skew: skew + nbytes]
    libc = _c_library()
    if libc is not None and nbytes >= (2 << 20):
        try:
            libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes), ctypes.c_int(_MADV_HUGEPAGE))
        except (AttributeError, OSError):
            pass
    return buf, raw


_CHUNK = 1 << 30  # slabs are grouped into buffers of about this size


class PinnedArena:
    def __init__(self, units: list[Unit], *, pin: bool, chunk_bytes: int = _CHUNK) -> None:
        self.pin_requested = pin
        self._chunks: list[torch.Tensor] = []
        self._registered: list[bool] = []
        self._slabs: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
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
            total = sum(u.store_nbytes for u in group)
            # Page-aligned, so registration covers exactly our bytes.
            buf, raw = host_buffer(total)
            off = 0
            for u in group:
                self._slabs[u.uid] = buf[off: off + u.store_nbytes]
                off += u.store_nbytes
            self._chunks.append(buf)
            self._registered.append(False)
            self.used_bytes += sum(t.store_nbytes for u in group for t in u.tensors)  # data, no padding
            self.capacity_bytes += total  # what is registered (pinned)
            self.allocated_bytes += raw.numel()  # plus up to a page of alignment skew per buffer
        self.pinned = False

    def slab(self, uid: int) -> torch.Tensor:
        return self._slabs[uid]

    def view(self, unit: Unit, index: int) -> torch.Tensor:
        """The host master of one tensor of a unit, typed (in its storage dtype) and shaped."""
        t = unit.tensors[index]
        raw = self._slabs[unit.uid][t.store_offset: t.store_offset + t.store_nbytes]
        return raw.view(t.store_dtype or t.dtype).view(t.shape)

    def pin(self) -> bool:
        """Register every buffer with CUDA. Returns whether all of them are pinned."""
        if not self.pin_requested or not torch.cuda.is_available():
            return False
        cudart = torch.cuda.cudart()
        ok = True
        with self._lock:
            for i, buf in enumerate(self._chunks):
                if self._registered[i]:
                    continue
                err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
                if int(err) != 0:
                    ok = False
                    log.warning("cudaHostRegister failed (%s); streaming from pageable memory", err)
                    break
                self._registered[i] = True
        self.pinned = ok and all(self._registered)
        return self.pinned

    def release(self) -> None:
        if torch.cuda.is_available():
            cudart = torch.cuda.cudart()
            for i, buf in enumerate(self._chunks):
                if self._registered[i]:
                    cudart.cudaHostUnregister(buf.data_ptr())
                    self._registered[i] = False
        self._chunks.clear()
        self._slabs.clear()
        self.pinned = False

    @staticmethod
    def slack_bytes(units: list[Unit]) -> int:
        """Alignment padding the layout adds on top of the raw tensor bytes."""
        return sum(u.store_nbytes - sum(t.store_nbytes for t in u.tensors) for u in units) + ALIGN


def pinned_empty(nbytes: int, *, pin: bool) -> tuple[torch.Tensor, bool]:
    """One exact-size host buffer, registered with CUDA when asked and possible."""
    buf, _ = host_buffer(nbytes)
    if pin and torch.cuda.is_available() and nbytes:
        if int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)) == 0:
            return buf, True
        log.warning("cudaHostRegister failed for a %d-byte buffer; using pageable memory", nbytes)
    return buf, False


def unregister(buf: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())


def trim_host_heap() -> None:
    """Hand freed heap pages back to the OS.

    Tensors under glibc's (dynamic, up to 32 MB) mmap threshold live on the heap; once they are
    packed into the arena and freed, glibc keeps their pages, and the process would hold the
    weights twice. malloc_trim returns them.
    """
    libc = _c_library()
    if libc is None:
        return
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass
