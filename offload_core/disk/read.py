"""UnitReader: one unit's slab read from its shard file in one large read, checked against the index.

Where the filesystem allows it, the file is opened with O_DIRECT and the read lands straight in a
page-aligned (pinned) slab: no page cache, so the kernel does not hold a second copy of what the
cache holds. Offsets, lengths and buffers are all 4096-aligned (the format guarantees the first
two; ``HostPool`` the third). Elsewhere (tmpfs, some network filesystems) a buffered read is
followed by ``posix_fadvise(DONTNEED)`` on the range.

Each read checks the file's size against the index (a truncated or replaced file). A unit's bytes
are checked against the index on its first read in this process (xxh3, or the sha256 of an older
index; see checksum.py), and with ``verify=True`` against the sha256 on every read. Files are
opened per read: a shard deleted while a run goes on is an error on its next read, not bytes read
from an unlinked inode.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import torch

from . import checksum
from .errors import ShardChecksumError, ShardReadError, one_line
from .format import FILE_ALIGN, ShardIndex, SlabEntry, TensorEntry
from .source import writable_buffer

__all__ = ["UnitReader"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_MAX_READ = 1 << 30  # per syscall (Linux caps a read near 2 GiB)


class UnitReader:
    def __init__(self, index: ShardIndex, *, direct: bool | None = None, verify: bool = False) -> None:
        """direct: True insists on O_DIRECT where it opens, False never uses it, None (default) tries it."""
        self.index = index
        self.root = index.root
        self.verify = verify
        self.direct = _O_DIRECT != 0 and direct is not False
        self._no_direct: set[str] = set()  # files whose filesystem refused O_DIRECT
        self._lock = threading.Lock()
        self.first_checks = 0  # units checked on their first read in this process (by this reader)
        self.full_checks = 0  # sha256 checks of verify=True

    def _open(self, path: Path, direct: bool) -> int:
        try:
            return os.open(path, os.O_RDONLY | (_O_DIRECT if direct else 0))
        except FileNotFoundError:
            raise ShardReadError(f"{path}: missing (deleted or moved since the index was written)") from None
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                raise
            raise ShardReadError(f"{path}: cannot open: {exc.strerror or one_line(exc)}") from None

    def read_into(self, entry: SlabEntry, buf: torch.Tensor) -> tuple[int, bool]:
        """Read ``entry``'s slab into ``buf`` (uint8, at least ``entry.read_nbytes`` for O_DIRECT).

        Returns the bytes read from the disk and whether the read was O_DIRECT. Raises
        ShardReadError / ShardChecksumError naming the file.
        """
        length, direct, first = self.read_unchecked(entry, buf)
        if first is not None:
            self.check_first_read(entry, buf, first)
        return length, direct

    def read_unchecked(self, entry: SlabEntry, buf: torch.Tensor) -> tuple[int, bool, os.stat_result | None]:
        """``read_into`` less the first-read check: also returns the file's stat when that check is
        still due (pass it to ``check_first_read`` before the bytes are used), else None.
        With ``verify=True`` the sha256 is checked here, on every read."""
        path = self.root / entry.file
        aligned = buf.data_ptr() % FILE_ALIGN == 0 and buf.numel() >= entry.read_nbytes
        direct = self.direct and aligned and entry.file not in self._no_direct
        try:
            fd = self._open(path, direct)
        except OSError:  # EINVAL: this filesystem has no O_DIRECT
            with self._lock:
                self._no_direct.add(entry.file)
            direct = False
            fd = self._open(path, False)
        try:
            st = os.fstat(fd)
            size = st.st_size
            want = self.index.files.get(entry.file)
            if want is not None and size != want:
                raise ShardReadError(f"{path}: {size} bytes, the index says {want} (truncated or replaced; re-shard)")
            length = entry.read_nbytes if direct else entry.nbytes
            try:
                self._pread(fd, buf[:length], entry.offset, path, entry.name)
            except ShardReadError:
                raise
            except OSError as exc:
                if not (direct and exc.errno == errno.EINVAL):
                    raise ShardReadError(f"{path}: cannot read unit {entry.name}: {exc.strerror or one_line(exc)}") from None
                with self._lock:  # the device wants a larger alignment than 4096: read buffered from now on
                    self._no_direct.add(entry.file)
                direct, length = False, entry.nbytes
                self._pread(fd, buf[:length], entry.offset, path, entry.name)
            if not direct and hasattr(os, "posix_fadvise"):
                try:
                    os.posix_fadvise(fd, entry.offset, entry.read_nbytes, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
        finally:
            os.close(fd)
        if self.verify:
            self.check(entry, buf, path)
            with self._lock:
                self.full_checks += 1
        elif not checksum.seen(st, entry.offset, entry.nbytes):
            return length, direct, st
        return length, direct, None

    def check_first_read(self, entry: SlabEntry, buf: torch.Tensor, st: os.stat_result) -> None:
        self.check_first(entry, buf, self.root / entry.file)
        checksum.mark_seen(st, entry.offset, entry.nbytes)

    @staticmethod
    def _pread(fd: int, buf: torch.Tensor, offset: int, path: Path, unit: str) -> None:
        view = writable_buffer(buf)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done: done + _MAX_READ]], offset + done)
            if n == 0:
                raise ShardReadError(f"{path}: truncated: unit {unit} needs bytes {offset}..{offset + len(view)}, "
                                     f"the file ends at {offset + done}")
            done += n

    def check(self, entry: SlabEntry, buf: torch.Tensor, path: Path | None = None) -> None:
        if checksum.sha256_digest(writable_buffer(buf[: entry.nbytes])) != entry.sha256:
            raise ShardChecksumError(f"{path or self.root / entry.file}: unit {entry.name} does not match its sha256 "
                                     "in the index (the file changed since it was written; re-shard or verify_shards)")

    def check_first(self, entry: SlabEntry, buf: torch.Tensor, path: Path | None = None) -> None:
        """The once-per-process check: xxh3 where the index has it, else the sha256."""
        fast = checksum.fast_digest(writable_buffer(buf[: entry.nbytes])) if entry.xxh3 else None
        if fast is None:
            self.check(entry, buf, path)
        elif fast != entry.xxh3:
            raise ShardChecksumError(f"{path or self.root / entry.file}: unit {entry.name} does not match its "
                                     f"{checksum.FAST_HASH} in the index (the file changed since it was written; "
                                     "re-shard, or verify_shards to find every changed unit)")
        with self._lock:
            self.first_checks += 1

    def _check_slab_once(self, entry: SlabEntry, fd: int, path: Path) -> None:
        """Before a single tensor is served from a slab not yet checked here: read and check the whole slab."""
        st = os.fstat(fd)
        if checksum.seen(st, entry.offset, entry.nbytes):  # verify=True too: a tensor read is not a unit read
            return
        whole = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._pread(fd, whole, entry.offset, path, entry.name)
        if self.verify:
            self.check(entry, whole, path)
        else:
            self.check_first(entry, whole, path)
        checksum.mark_seen(st, entry.offset, entry.nbytes)

    def read_tensor(self, entry: SlabEntry, t: TensorEntry) -> torch.Tensor:
        """One tensor of a slab, typed and shaped, in a fresh buffer (a buffered read of its bytes only)."""
        path = self.root / entry.file
        out = torch.empty(t.shape, dtype=t.dtype)
        fd = self._open(path, False)
        try:
            self._check_slab_once(entry, fd, path)
            raw = out.view(-1).view(torch.uint8) if out.numel() else out
            self._pread(fd, raw, entry.offset + t.offset, path, f"{entry.name} (tensor {t.name})")
        except ShardReadError:
            raise
        except OSError as exc:
            raise ShardReadError(f"{path}: cannot read tensor {t.name}: {exc.strerror or one_line(exc)}") from None
        finally:
            os.close(fd)
        return out

    def read_scales(self, entry: SlabEntry, t: TensorEntry) -> torch.Tensor:
        """The fp32 row/block scales of fp8 tensor ``t`` (in its slab after the unit's tensors), fresh."""
        assert t.scale_shape is not None
        return self.read_tensor(entry, TensorEntry(f"{t.name} (scales)", torch.float32, list(t.scale_shape),
                                                   t.scale_offset, t.scale_nbytes))
