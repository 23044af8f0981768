"""The bounce ring's fill copy: non-temporal stores through a small native helper, else libc's memmove.

Why (native/stream_copy.c says more): a fill writes a pinned buffer that the GPU's DMA reads next, so
keeping its lines in the cache is no use, and the read for ownership an ordinary store makes costs a
fourth pass over DRAM. glibc streams only copies far larger than the ring's chunks. Measured on an
H100 host (bench/RESULTS.md): the Flux-dev LoRA step through the ring 1139 ms with libc's copy, 972
with streaming stores, against 949 for the whole arena pinned.

The helper is built once per source version with the host's C compiler (``CC``, else cc, gcc or clang
on PATH: the compiler Triton needs on a GPU box anyway) into the user cache, loaded with ctypes (whose
calls release the GIL, so the fill threads copy side by side), and checked on odd alignments and
lengths before use. With no compiler, a CPU other than x86-64, or a build or check that fails, the
ring uses libc's memmove and the reason is in ``stats()["bounce_fill_copy"]``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

__all__ = ["SOURCE", "RING_SOURCE", "load", "load_ring", "cache_dirs"]

log = logging.getLogger("offload_core")

SOURCE = Path(__file__).parent / "native" / "stream_copy.c"
RING_SOURCE = Path(__file__).parent / "native" / "bounce_ring.c"  # the ring's chunk loop (built with SOURCE)
_SYMBOL = "oj_stream_copy"
_X86_64 = {"x86_64", "amd64"}

_lock = threading.Lock()
_loaded: tuple[Callable[[int, int, int], None] | None, str] | None = None
_ring_loaded: tuple[ctypes.CDLL | None, str] | None = None


class _Unavailable(Exception):
    """Why the helper cannot be used here (one line)."""


def cache_dirs() -> list[Path]:
    """Where the built helper is kept: the user cache, else a per-user folder in the temp dir."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [Path(base) / "offload-jobs" / "native", Path(tempfile.gettempdir()) / f"offload-jobs-native-{uid}"]


def _compiler() -> list[str]:
    cc = os.environ.get("CC", "").strip()
    if cc:
        argv = shlex.split(cc)
        if shutil.which(argv[0]) is None:
            raise _Unavailable(f"CC={cc!r} is not on PATH")
        return argv
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise _Unavailable("no C compiler (CC, cc, gcc or clang) on PATH")


def _ours(path: Path) -> bool:
    """A folder or file we may load code from: owned by this user and writable by no one else (the temp
    dir's fallback folder is shared ground: another user's file there must never be loaded)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def _build(sources: tuple[Path, ...] = (SOURCE,), stem: str = "stream_copy", flags: tuple[str, ...] = ()) -> Path:
    text = b"".join(p.read_bytes() for p in sources) + " ".join(flags).encode()
    digest = hashlib.sha256(text + platform.machine().encode()).hexdigest()[:16]
    name = f"{stem}-{digest}.so"
    for d in cache_dirs():
        if _ours(d) and (d / name).is_file() and _ours(d / name):
            return d / name
    cc, why = _compiler(), "no writable cache folder of this user's own"
    for d in cache_dirs():
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError:
            continue
        if not _ours(d):
            why = f"{d} is not this user's alone"
            continue
        tmp = d / f".{name}.{os.getpid()}.{threading.get_ident()}"  # then renamed: a reader never sees half a file
        try:
            r = subprocess.run([*cc, "-O2", "-fPIC", "-shared", *flags, "-o", str(tmp), *map(str, sources)],
                               capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            raise _Unavailable(f"{cc[0]} could not run: {exc}") from None
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:200])
            raise _Unavailable(f"{Path(cc[0]).name} failed on {sources[-1].name}: {first}")
        try:
            os.replace(tmp, d / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            why = f"{d}: {exc}"
            continue
        return d / name
    raise _Unavailable(why)


def _check(fn: Callable[[int, int, int], None]) -> None:
    """The helper copies exactly, at odd alignments, across its short-copy cut and its tail."""
    pattern = bytes((i * 131 + 7) & 0xFF for i in range(70_000))
    src = ctypes.create_string_buffer(pattern, len(pattern))
    for dst_off, src_off, n in ((0, 0, 65_536), (1, 3, 12_345), (63, 5, 8_191), (17, 0, 4_096), (5, 9, 100), (0, 0, 0)):
        dst = ctypes.create_string_buffer(n + 128)
        fn(ctypes.addressof(dst) + dst_off, ctypes.addressof(src) + src_off, n)
        raw = dst.raw
        if raw[dst_off: dst_off + n] != pattern[src_off: src_off + n] or any(raw[:dst_off]) or any(raw[dst_off + n:]):
            raise _Unavailable(f"the built helper copied {n} bytes wrong (alignment {dst_off}/{src_off})")


def _load() -> tuple[Callable[[int, int, int], None] | None, str]:
    if platform.machine().lower() not in _X86_64:
        return None, f"streaming stores are x86-64's; this CPU is {platform.machine() or 'unknown'}"
    try:
        lib = ctypes.CDLL(str(_build()))
        fn = getattr(lib, _SYMBOL)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        fn.restype = None
        _check(fn)
    except _Unavailable as exc:
        return None, str(exc)
    except (OSError, AttributeError) as exc:
        return None, f"the built helper would not load: {exc}"
    return fn, "stream"


def load() -> tuple[Callable[[int, int, int], None] | None, str]:
    """(the streaming copy ``fn(dst, src, nbytes)``, "stream"), or (None, why not). Built and checked
    once per process; later calls return the first answer."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
            if _loaded[0] is None:
                log.info("offload: the bounce ring fills with libc's memmove: %s", _loaded[1])
        return _loaded


def _load_ring() -> tuple[ctypes.CDLL | None, str]:
    fn, why = load()  # the ring copies with the checked streaming copy: built, and checked, first
    if fn is None:
        return None, why
    try:
        lib = ctypes.CDLL(str(_build((SOURCE, RING_SOURCE), "bounce_ring", ("-pthread",))))
        lib.oj_stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        lib.oj_stream_copy.restype = None
        _check(lib.oj_stream_copy)
    except _Unavailable as exc:
        return None, str(exc)
    except (OSError, AttributeError) as exc:
        return None, f"the built ring would not load: {exc}"
    p, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    sigs = {
        "oj_ring_new": (p, [ctypes.c_int, ctypes.c_size_t, p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                            ctypes.POINTER(ctypes.c_int), ctypes.c_int, i64]),
        "oj_ring_request": (i64, [p, u64, u64, ctypes.POINTER(i64)]),
        "oj_ring_copy": (ctypes.c_int, [p, i64, i64, u64, p]),
        "oj_ring_failed": (ctypes.c_int, [p]),
        "oj_ring_error": (ctypes.c_char_p, [p]),
        "oj_ring_fail_at": (None, [p, i64]),
        "oj_ring_stats": (None, [p, ctypes.POINTER(ctypes.c_double * 3)]),
        "oj_ring_threads": (ctypes.c_int, [p]),
        "oj_ring_stop": (None, [p]),
        "oj_ring_join": (None, [p]),
        "oj_ring_close": (None, [p]),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib, "native"


def load_ring() -> tuple[ctypes.CDLL | None, str]:
    """(the native ring's library, "native"), or (None, why not): the bounce ring's chunk loop in
    pthreads (native/bounce_ring.c), built with the streaming copy. Once per process."""
    global _ring_loaded
    if _ring_loaded is None:
        got = _load_ring()  # outside the lock, which load() takes (two first callers build alike)
        with _lock:
            if _ring_loaded is None:
                _ring_loaded = got
                if got[0] is None:
                    log.info("offload: the bounce ring runs its chunk loop in Python threads: %s", got[1])
    return _ring_loaded
