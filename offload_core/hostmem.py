"""Host memory the engine copies from and to: page-aligned buffers, page-locked with cudaHostRegister.

A registration must end before its memory is freed. If torch frees a buffer that CUDA still holds
registered, the next buffer at that address fails to register, and the driver may DMA from the
stale pinned pages: silently wrong weights, or every later CUDA call failing. So every
``HostBuffer`` carries a finalizer that unregisters it the moment the buffer object dies (it is
called before the buffer's own references, and so the memory, are released), whether or not
anyone called ``close()``. The finalizer holds only the address, never the buffer. It first waits
for the device, so no copy still in flight reads or writes the pages as they are let go. At
interpreter exit it does nothing: the process's memory and registrations end with it.

A failed registration leaves its error as CUDA's "last error", which torch's next kernel-launch
check would report as its own. It is read and cleared at once, logged by name, and the buffer is
used as pageable memory: correct, only slower.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import weakref
from typing import Any

import torch

__all__ = ["HostBuffer", "host_buffer", "trim_host_heap", "cuda_error_name", "clear_cuda_error"]

log = logging.getLogger(__name__)

_PAGE = 4096
_MADV_HUGEPAGE = 14  # Linux
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet
_cudart: ctypes.CDLL | None | bool = False


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


# ---------------------------------------------------------------- CUDA's last error
# torch.cuda.cudart() has no cudaGetLastError; the runtime library torch already loaded has. Its
# "last error" is per library instance and per thread, so it must be that very library (found by
# path among the loaded ones), called on the thread that made the failed call.
_NAMES = {
    1: "cudaErrorInvalidValue", 2: "cudaErrorMemoryAllocation", 3: "cudaErrorInitializationError",
    100: "cudaErrorNoDevice", 101: "cudaErrorInvalidDevice", 208: "cudaErrorAlreadyMapped",
    304: "cudaErrorOperatingSystem", 712: "cudaErrorHostMemoryAlreadyRegistered",
    713: "cudaErrorHostMemoryNotRegistered", 800: "cudaErrorNotPermitted", 801: "cudaErrorNotSupported",
}


def _runtime_library() -> ctypes.CDLL | None:
    global _cudart
    if _cudart is False:
        _cudart = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart.so" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                lib.cudaGetLastError.restype = ctypes.c_int
                lib.cudaGetErrorName.restype = ctypes.c_char_p
                lib.cudaGetErrorName.argtypes = [ctypes.c_int]
                _cudart = lib
                break
        except (OSError, AttributeError):
            _cudart = None
    return _cudart  # type: ignore[return-value]


def cuda_error_name(code: int) -> str:
    """cudaErrorHostMemoryAlreadyRegistered for 712: the runtime's own name where it can be asked."""
    lib = _runtime_library()
    if lib is not None:
        try:
            name = lib.cudaGetErrorName(int(code))
            if name:
                return name.decode()
        except (OSError, AttributeError):
            pass
    return _NAMES.get(int(code), f"cudaError {int(code)}")


def clear_cuda_error(device: torch.device | int | None = None) -> None:
    """Read and reset CUDA's last error on this thread, so torch's next launch check does not see it."""
    lib = _runtime_library()
    if lib is not None:
        lib.cudaGetLastError()
        return
    # No runtime library to ask (a static build): a kernel launch's check reads, raises and clears it.
    try:
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device() if device is None else device))
    except Exception:
        pass


# ---------------------------------------------------------------- registered buffers
class _Registration:
    __slots__ = ("ptr", "nbytes", "registered", "device")

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr, self.nbytes = ptr, nbytes
        self.registered = False
        self.device: int | None = None


def _unregister(reg: _Registration) -> None:
    """Undo a registration (the finalizer's body: it must not touch the buffer object)."""
    if not reg.registered:
        return
    reg.registered = False
    try:
        # copies queued against these pages finish before the pages stop being pinned
        torch.cuda.synchronize(reg.device)
        err = int(torch.cuda.cudart().cudaHostUnregister(reg.ptr))
        if err != 0:
            clear_cuda_error(reg.device)
            log.warning("cudaHostUnregister of a %d-byte buffer failed: %s", reg.nbytes, cuda_error_name(err))
    except Exception as exc:  # a finalizer must not raise; a broken CUDA context ends here
        log.debug("unregistering a host buffer failed: %s", exc)


class HostBuffer:
    """Exactly ``nbytes`` of page-aligned host memory, registered with CUDA (pinned) when asked.

    ``tensor`` is the uint8 buffer. ``pin()`` registers it; a failure is logged by name and leaves
    it pageable. ``close()`` (or the finalizer, when the buffer is dropped) unregisters it.
    """

    def __init__(self, nbytes: int, *, pin: bool = False) -> None:
        self.tensor, self._raw = host_buffer(nbytes)
        self.nbytes = nbytes
        self._reg = _Registration(self.tensor.data_ptr(), nbytes)
        self._lock = threading.Lock()
        # Holds the registration record only: the buffer itself can die, and the call comes first.
        self._finalizer = weakref.finalize(self, _unregister, self._reg)
        self._finalizer.atexit = False
        if pin:
            self.pin()

    @property
    def pinned(self) -> bool:
        return self._reg.registered

    def pin(self) -> bool:
        """Register with CUDA (no-op without CUDA or for an empty buffer). Returns whether it is pinned."""
        if self._reg.registered:
            return True
        if not self.nbytes or not torch.cuda.is_available():
            return False
        with self._lock:
            device = torch.cuda.current_device()
            err = int(torch.cuda.cudart().cudaHostRegister(self._reg.ptr, self.nbytes, 0))
            if err != 0:
                clear_cuda_error(device)
                log.warning("cudaHostRegister of a %d-byte host buffer failed: %s; using it as pageable memory "
                            "(correct, slower copies)", self.nbytes, cuda_error_name(err))
                return False
            self._reg.device = device
            self._reg.registered = True
        return True

    def unpin(self) -> None:
        """Unregister now and keep the buffer (pageable again); close() still frees it as before."""
        with self._lock:
            _unregister(self._reg)

    def close(self) -> None:
        """Unregister now; the memory is freed once nothing else references it."""
        self._finalizer()

    @property
    def finalizer(self) -> Any:
        return self._finalizer
