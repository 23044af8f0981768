"""SafetensorsSource: a checkpoint read tensor by tensor, straight into the caller's memory.

A diffusers folder (one or several safetensors files plus their ``*.safetensors.index.json``) or a
single ``.safetensors`` file. Each tensor's bytes are read with ``os.preadv`` into a destination
the caller gives (an arena slab view, a shard writer's buffer), so the host never holds the
checkpoint twice: there is no mmap whose pages stay resident, and each file's page cache is dropped
(``posix_fadvise(DONTNEED)``) once it has been read. A tensor whose file dtype differs from the
destination's goes through a bounded temporary (``chunk_bytes``), a piece at a time.

    src = SafetensorsSource.open("/models/FLUX.1-dev/transformer")
    for name, info in src.tensors.items():
        src.read_into(name, model_slab_view(name))
    src.close()
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .errors import ShardError, ShardSourceNotFound, one_line
from .format import FROM_ST, read_json

__all__ = ["SafetensorsSource", "SourceTensor", "source_files", "drop_page_cache", "writable_buffer",
           "check_data_offsets", "check_no_overlap"]

CHUNK_BYTES = 16 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass
class SourceTensor:
    name: str
    file: Path
    dtype: torch.dtype
    shape: list[int]
    start: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def source_files(src: Path) -> tuple[list[Path], Path | None]:
    """The safetensors files of SRC, and its config.json when it has one."""
    if not src.exists():
        raise ShardSourceNotFound(f"{src}: no such file or directory")
    if src.is_file():
        if not src.name.endswith(".safetensors"):
            raise ShardError(f"{src}: not a .safetensors file (only safetensors checkpoints can be read)")
        return [src], None
    config = src / "config.json" if (src / "config.json").is_file() else None
    indexes = sorted(src.glob("*.safetensors.index.json"))
    if indexes:
        preferred = src / "diffusion_pytorch_model.safetensors.index.json"
        index = preferred if preferred in indexes else indexes[0]  # the others are variants (fp16, ...)
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ShardError(f"{index}: no weight_map (not a safetensors index)")
        files = [src / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ShardSourceNotFound(f"{f}: listed in {index.name} but missing")
        return files, config
    single = src / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single], config
    files = sorted(src.glob("*.safetensors"))
    if not files:
        hint = "; a pipeline folder: pass its transformer/ subfolder" if (src / "model_index.json").exists() else ""
        raise ShardError(f"{src}: no .safetensors files found{hint}")
    return files, config


def _header(path: Path) -> dict[str, SourceTensor]:
    """Parse one safetensors header and check every tensor lies inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ShardError(f"{path}: not a readable safetensors file: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ShardError(f"{path}: not a readable safetensors file: header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except ShardError:
        raise
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ShardError(f"{path}: not a readable safetensors file: {one_line(exc)}") from None
    if not isinstance(header, dict):
        raise ShardError(f"{path}: not a readable safetensors file: the header is not a JSON object")
    base = 8 + n
    out: dict[str, SourceTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (a, b) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ShardError(f"{path}: not a readable safetensors file: bad header entry for {name}") from None
        if code not in FROM_ST:
            raise ShardError(f"{path}: tensor {name} has dtype {code}, which offload-jobs does not carry")
        check_data_offsets(path, name, a, b, base, size)
        t = SourceTensor(name, path, FROM_ST[code], shape, base + a, b - a)
        if t.nbytes != t.numel * t.dtype.itemsize or any(d < 0 for d in shape):
            raise ShardError(f"{path}: tensor {name}: {t.nbytes} bytes do not fit its shape {shape} and dtype {code}")
        out[name] = t
    check_no_overlap(path, {k: (t.start - base, t.start - base + t.nbytes) for k, t in out.items()})
    return out


def check_data_offsets(path: Path, name: str, a: Any, b: Any, base: int, size: int) -> None:
    """A header entry's ``data_offsets`` are two integers 0 <= a <= b inside the data section; a
    negative one would read the header's own bytes as weights."""
    if not (type(a) is int and type(b) is int):
        raise ShardError(f"{path}: tensor {name}: data_offsets {[a, b]!r} are not two integers")
    if a < 0 or b < a:
        raise ShardError(f"{path}: tensor {name}: data_offsets [{a}, {b}] are negative or reversed "
                         "(a damaged or hand-made header)")
    if base + b > size:
        raise ShardError(f"{path}: truncated: tensor {name} ends at byte {base + b}, the file has {size}")


def check_no_overlap(path: Path, spans: dict[str, tuple[int, int]]) -> None:
    """No two tensors share bytes (one written through the other would change both)."""
    reach, holder = 0, ""  # the furthest end so far, and whose
    for name, (start, end) in sorted(spans.items(), key=lambda kv: kv[1]):
        if end == start:
            continue  # an empty tensor shares no bytes
        if start < reach:
            raise ShardError(f"{path}: tensor {name}: data_offsets overlap tensor {holder}'s "
                             f"(bytes {start}..{min(reach, end)} of the data); a damaged or hand-made header")
        reach, holder = end, name


def writable_buffer(t: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no numpy needed)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("destination must be a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def drop_page_cache(path: Path, fd: int | None = None) -> None:
    """Ask the kernel to forget a file's cached pages (so reading it does not grow RAM)."""
    if not hasattr(os, "posix_fadvise"):
        return
    with contextlib.suppress(OSError):
        own = fd is None
        fd = os.open(path, os.O_RDONLY) if own else fd
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            if own:
                os.close(fd)


def pread_exact(fd: int, buf: memoryview, offset: int, path: Path, what: str) -> None:
    """Fill ``buf`` from ``offset``; a short read is a truncated file, named."""
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError as exc:
            raise ShardError(f"{path}: cannot read {what}: {exc.strerror or one_line(exc)}") from None
        if n == 0:
            raise ShardError(f"{path}: truncated: {what} needs bytes {offset}..{offset + len(buf)}, "
                             f"the file ends at {offset + done}")
        done += n


class SafetensorsSource:
    """The tensors of a safetensors checkpoint, read one at a time with pread."""

    def __init__(self, files: list[Path], config: Path | None = None, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.files = files
        self.config = config
        self.chunk_bytes = chunk_bytes
        self.tensors: dict[str, SourceTensor] = {}
        self._fds: dict[Path, int] = {}
        self._tmp: torch.Tensor | None = None
        self.bytes_read = 0
        for path in files:
            for name, t in _header(path).items():
                if name in self.tensors:
                    raise ShardError(f"{path}: tensor {name} is also in {self.tensors[name].file} "
                                     "(two checkpoints in one folder?)")
                self.tensors[name] = t

    @classmethod
    def open(cls, src: str | os.PathLike[str], chunk_bytes: int = CHUNK_BYTES) -> SafetensorsSource:
        files, config = source_files(Path(src))
        return cls(files, config, chunk_bytes)

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[SourceTensor]:
        return iter(self.tensors.values())

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise ShardError(f"{path}: cannot open: {exc.strerror or one_line(exc)}") from None
        return fd

    def release(self, path: Path | None = None) -> None:
        """Close a file (or all of them) and drop its page cache."""
        for p in [path] if path is not None else list(self._fds):
            fd = self._fds.pop(p, None)
            if fd is not None:
                drop_page_cache(p, fd)
                os.close(fd)

    def close(self) -> None:
        self.release()
        self._tmp = None

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Read tensor ``name`` into ``out`` (a contiguous CPU tensor of its shape; any dtype)."""
        t = self.tensors[name]
        if list(out.shape) != t.shape:
            raise ShardError(f"{t.file}: tensor {name} has shape {t.shape}, the destination {list(out.shape)}")
        fd = self._fd(t.file)
        if out.dtype == t.dtype:
            pread_exact(fd, writable_buffer(out), t.start, t.file, f"tensor {name}")
        else:
            # Through one reused, bounded temporary, a whole number of elements at a time (a fresh
            # one per tensor would leave glibc holding several of them).
            step = max(1, self.chunk_bytes // t.dtype.itemsize)
            need = min(step, t.numel) * t.dtype.itemsize
            if self._tmp is None or self._tmp.numel() < need:
                self._tmp = torch.empty(max(need, min(self.chunk_bytes, 1 << 20)), dtype=torch.uint8)
            tmp = self._tmp[:need].view(t.dtype)
            flat = out.view(-1)
            for i in range(0, t.numel, step):
                n = min(step, t.numel - i)
                part = tmp[:n]
                pread_exact(fd, writable_buffer(part), t.start + i * t.dtype.itemsize, t.file, f"tensor {name}")
                flat[i: i + n].copy_(part)
        self.bytes_read += t.nbytes
        return out

    def read(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its file dtype, in a fresh buffer."""
        t = self.tensors[name]
        return self.read_into(name, torch.empty(t.shape, dtype=t.dtype))
