"""Which units this process has already checked, and the fast checksum the index carries for that.

By default a unit's slab is checked once per process, on its first read: its xxh3-64 (about ten
times faster than sha256 on one core, so it hides behind the disk) against the index. Later reads
of the same unit skip the hash while the file is the same file: same device and inode, same size,
mtime and ctime; any write to the file (even one that restores the mtime) changes its ctime, so it
is checked again. ``disk_verify: true`` keeps the full sha256 on every read instead.

An index written before the fast checksum (no ``xxh3`` on its slabs), or a machine without the
``xxhash`` package, falls back to the slab's sha256, still once per process.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any

__all__ = ["FAST_HASH", "fast_hasher", "fast_digest", "sha256_digest", "seen", "mark_seen", "forget_all"]

FAST_HASH = "xxh3_64"

try:  # a dependency; kept optional at import so that an older environment still reads (by sha256)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - exercised only without the package
    _xxhash = None


def fast_hasher() -> Any | None:
    """A streaming xxh3-64 hasher (``update`` / ``hexdigest``), or None without the xxhash package."""
    return _xxhash.xxh3_64() if _xxhash is not None else None


def fast_digest(data: Any) -> str | None:
    return _xxhash.xxh3_64_hexdigest(data) if _xxhash is not None else None


def sha256_digest(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


# (st_dev, st_ino, slab offset, slab nbytes) -> (st_size, st_mtime_ns, st_ctime_ns) when it was checked
_SEEN: dict[tuple[int, int, int, int], tuple[int, int, int]] = {}
_LOCK = threading.Lock()


def _keys(st: os.stat_result, offset: int, nbytes: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    return (st.st_dev, st.st_ino, offset, nbytes), (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def seen(st: os.stat_result, offset: int, nbytes: int) -> bool:
    key, stamp = _keys(st, offset, nbytes)
    with _LOCK:
        return _SEEN.get(key) == stamp


def mark_seen(st: os.stat_result, offset: int, nbytes: int) -> None:
    key, stamp = _keys(st, offset, nbytes)
    with _LOCK:
        _SEEN[key] = stamp


def forget_all() -> None:
    """Check every unit again on its next read (tests, and a bench that measures first reads)."""
    with _LOCK:
        _SEEN.clear()
