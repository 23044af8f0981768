"""The shard directory format, version 2 (3 with fp8 row/block scales): on disk, a unit is its host slab.

    DST/
        index.json                        written last: unit -> file, byte range, sha256, tensors
        transformer_blocks.0.safetensors  one file per block, holding every unit inside that block
        non_block.safetensors             the units outside the blocks, then the resident tensors
        .progress.json                    the files already finished, so that a rerun resumes

A unit's bytes in its file are exactly the slab the engine copies to the device: the unit's tensors
in its storage dtype at the offsets ``Unit.layout()`` gives (64-byte aligned), zeros between. Each
slab starts at a multiple of 4096 in its file and the file ends at one, so a unit is one contiguous
read, and O_DIRECT can read it straight into a page-aligned pinned buffer.

Each file is still a valid safetensors file: the header is padded so the data starts at 4096, and
the gaps are ``__pad__.N`` uint8 tensors (safetensors wants every byte indexed), so ``safe_open``
reads the real tensors by name.

index.json (``format_version`` 2)::

    {"format": "offload-jobs-shards", "format_version": 2, "dtype": "bfloat16" | null,
     "granularity": "block", "grouping": "model" | "names", "model_class": ..., "block_lists": [...],
     "file_align": 4096, "slab_align": 64,
     "units": {"transformer_blocks.0": {"file": ..., "offset": 4096, "nbytes": ..., "sha256": ...,
               "xxh3"? (xxh3-64 of the slab: the check on a unit's first read in a process; absent in older indexes),
               "tensors": {name: {"dtype", "shape", "offset" (in the slab), "nbytes",
                                  "source_dtype"? (the compute dtype the slab was laid out for),
                                  "scale"? (fp8, one scale a tensor: a float),
                                  "scale_shape"?, "scale_offset"? (fp8 row/block scales: fp32, in the slab)}}}},
     "resident": {same shape as a unit: tensors no streamed unit holds (tied, or in a unit the
                  checkpoint holds only part of)},
     "files": {name: {"nbytes": ...}}}

fp8 with ``fp8_scaling`` row or block (quant.py) keeps its fp32 scales where the engine's host slab
keeps them: in the unit's slab after its tensors (``Unit.layout``), at ``scale_offset``, shaped
``scale_shape`` ((rows,) for row, (row tiles, column tiles) for block). So the disk tier reads them
in the unit's one read and the device widens them from the same raw copy as the arena's slabs; the
safetensors header names them ``__scale__.<tensor>`` (F32), so ``safe_open`` reads them too. An index
holding such scales says ``format_version`` 3 and ``fp8_scaling`` (a reader of version 2 only would
lay the slab out without them: it refuses the index by its version instead); every other index is
written as version 2, as before, and both are read.

Version 1 (one safetensors file per block, tensors packed by the safetensors writer) is refused
with a message that says to re-shard: its layout is not the slab layout.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from ..units import ALIGN
from .errors import ShardFormatError, one_line

__all__ = ["FORMAT", "FORMAT_VERSION", "SCALES_VERSION", "READ_VERSIONS", "INDEX_NAME", "PROGRESS_NAME", "NON_BLOCK_FILE",
           "FILE_ALIGN", "SLAB_ALIGN",
           "ST_CODES", "FROM_ST", "dtype_name", "dtype_from_name", "align", "file_name", "block_of",
           "TensorEntry", "SlabEntry", "ShardIndex", "load_index", "read_json", "safetensors_header"]

FORMAT = "offload-jobs-shards"
FORMAT_VERSION = 2
SCALES_VERSION = 3  # version 2 plus fp8 row/block scales in the slabs; written only when a slab holds some
READ_VERSIONS = (FORMAT_VERSION, SCALES_VERSION)
INDEX_NAME = "index.json"
PROGRESS_NAME = ".progress.json"
NON_BLOCK_FILE = "non_block.safetensors"
FILE_ALIGN = 4096  # slab starts and file ends: O_DIRECT's offset, length and buffer alignment
SLAB_ALIGN = ALIGN  # tensors inside a slab, as units.py lays them out
PAD_PREFIX = "__pad__."
SCALE_PREFIX = "__scale__."

ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
FROM_ST = {code: dt for dt, code in ST_CODES.items()}
_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in ST_CODES}


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    if name not in _BY_NAME:
        raise ShardFormatError(f"{where}: unknown dtype {name!r}")
    return _BY_NAME[name]


def align(n: int, to: int = FILE_ALIGN) -> int:
    return (n + to - 1) // to * to


def file_name(block: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", block) + ".safetensors"


def block_of(unit: str, block_lists: Iterable[str]) -> str | None:
    """The block (``<list>.<N>``) a unit name lies in, if any."""
    for bl in block_lists:
        m = re.match(re.escape(bl) + r"\.(\d+)(?=$|[.:])", unit)
        if m:
            return m.group(0)
    return None


@dataclass
class TensorEntry:
    name: str
    dtype: torch.dtype  # as stored
    shape: list[int]
    offset: int  # bytes into the slab
    nbytes: int
    source_dtype: torch.dtype | None = None  # the compute dtype when it differs from the stored one
    scale: float | None = None  # fp8's per-tensor scale
    scale_shape: list[int] | None = None  # fp8 row/block scales (fp32) in the slab, at scale_offset
    scale_offset: int = 0

    @property
    def scale_nbytes(self) -> int:
        return 0 if self.scale_shape is None else 4 * math.prod(self.scale_shape)

    @property
    def scaling(self) -> str | None:
        """fp8 scaling as quant.py names it (None: not fp8)."""
        if self.dtype is not torch.float8_e4m3fn:
            return None
        return "tensor" if self.scale_shape is None else ("row" if len(self.scale_shape) == 1 else "block")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": dtype_name(self.dtype), "shape": list(self.shape), "offset": self.offset,
                               "nbytes": self.nbytes}
        if self.source_dtype is not None:
            out["source_dtype"] = dtype_name(self.source_dtype)
        if self.scale is not None:
            out["scale"] = self.scale
        if self.scale_shape is not None:
            out["scale_shape"], out["scale_offset"] = list(self.scale_shape), self.scale_offset
        return out


@dataclass
class SlabEntry:
    """One unit's byte range in its file (or the resident tensors' range)."""

    name: str
    file: str
    offset: int = 0  # in the file, a multiple of FILE_ALIGN
    nbytes: int = 0  # the slab's length (the unit's store_nbytes)
    sha256: str = ""
    tensors: list[TensorEntry] = field(default_factory=list)
    xxh3: str = ""  # the fast checksum of the first read in a process ("" in an index written before it)

    @property
    def read_nbytes(self) -> int:
        """What an aligned read of the slab covers (its padding to FILE_ALIGN included)."""
        return align(self.nbytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "offset": self.offset, "nbytes": self.nbytes, "sha256": self.sha256}
        if self.xxh3:
            out["xxh3"] = self.xxh3
        out["tensors"] = {t.name: t.to_json() for t in self.tensors}
        return out


@dataclass
class ShardIndex:
    path: Path  # index.json
    meta: dict[str, Any]  # the top-level keys other than units, resident and files
    units: dict[str, SlabEntry]
    resident: SlabEntry | None
    files: dict[str, int]  # file name -> bytes

    @property
    def root(self) -> Path:
        return self.path.parent

    def tensor(self, name: str) -> tuple[SlabEntry, TensorEntry] | None:
        for entry in self.slabs():
            for t in entry.tensors:
                if t.name == name:
                    return entry, t
        return None

    def slabs(self) -> list[SlabEntry]:
        return [*self.units.values(), *([self.resident] if self.resident else [])]

    def to_json(self) -> dict[str, Any]:
        out = dict(self.meta)
        out["units"] = {n: e.to_json() for n, e in self.units.items()}
        if self.resident is not None:
            out["resident"] = self.resident.to_json()
        out["files"] = {f: {"nbytes": n} for f, n in self.files.items()}
        return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ShardFormatError(f"{path}: cannot read JSON: {one_line(exc)}") from None
    if not isinstance(data, dict):
        raise ShardFormatError(f"{path}: expected a JSON object")
    return data


def load_index(shard_dir: str | Path) -> ShardIndex:
    """index.json of a shard directory, checked for shape; a version this code does not read is refused."""
    root = Path(shard_dir)
    path = root / INDEX_NAME
    if not path.is_file():
        why = "its shard run did not finish" if (root / PROGRESS_NAME).exists() else "not a shard directory"
        raise ShardFormatError(f"{path}: missing ({why})")
    data = read_json(path)
    if data.get("format") != FORMAT:
        raise ShardFormatError(f"{path}: not an {FORMAT} index (format {data.get('format')!r})")
    version = data.get("format_version")
    if version not in READ_VERSIONS:
        if isinstance(version, int) and version < FORMAT_VERSION:
            raise ShardFormatError(
                f"{path}: shard format version {version}, written before the disk tier; its files are not laid out "
                f"as slabs. Re-shard the checkpoint (offload-jobs shard SRC DST) to get version {FORMAT_VERSION}")
        raise ShardFormatError(f"{path}: shard format version {version!r} is not one this offload-jobs reads "
                               f"(it reads {' and '.join(map(str, READ_VERSIONS))}); upgrade offload-jobs or re-shard")
    try:
        units = {name: _slab(name, e, path) for name, e in data["units"].items()}
        resident = _slab("<resident>", data["resident"], path) if data.get("resident") else None
        files = {f: int(v["nbytes"]) for f, v in data["files"].items()}
        for e in [*units.values(), *([resident] if resident else [])]:
            if e.file not in files:
                raise ShardFormatError(f"{path}: unit {e.name} names {e.file}, which the index does not list")
            # the header takes the file's first bytes, so no slab starts at 0
            if e.offset < FILE_ALIGN or e.nbytes < 0 or e.offset % FILE_ALIGN or e.offset + e.read_nbytes > files[e.file]:
                raise ShardFormatError(f"{path}: unit {e.name} has a bad byte range in {e.file}")
        by_file: dict[str, list[SlabEntry]] = {}
        for e in [*units.values(), *([resident] if resident else [])]:
            by_file.setdefault(e.file, []).append(e)
        for fname, slabs in by_file.items():
            slabs.sort(key=lambda e: e.offset)
            for a, b in zip(slabs, slabs[1:]):
                if a.offset + a.nbytes > b.offset:
                    raise ShardFormatError(f"{path}: units {a.name} and {b.name} overlap in {fname}")
    except ShardFormatError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ShardFormatError(f"{path}: malformed ({type(exc).__name__}: {one_line(exc)})") from None
    meta = {k: v for k, v in data.items() if k not in ("units", "resident", "files")}
    return ShardIndex(path, meta, units, resident, files)


def _slab(name: str, e: dict[str, Any], path: Path) -> SlabEntry:
    where = f"{path}: unit {name}"
    tensors = []
    for tname, t in e["tensors"].items():
        tensors.append(TensorEntry(
            tname, dtype_from_name(t["dtype"], where), [int(s) for s in t["shape"]], int(t["offset"]), int(t["nbytes"]),
            dtype_from_name(t["source_dtype"], where) if t.get("source_dtype") else None,
            float(t["scale"]) if t.get("scale") is not None else None,
            [int(n) for n in t["scale_shape"]] if t.get("scale_shape") is not None else None,
            int(t.get("scale_offset", 0))))
    entry = SlabEntry(name, str(e["file"]), int(e["offset"]), int(e["nbytes"]), str(e["sha256"]), tensors,
                      str(e.get("xxh3") or ""))
    for t in tensors:
        if t.offset < 0 or t.nbytes < 0 or t.offset + t.nbytes > entry.nbytes:
            raise ShardFormatError(f"{where}: tensor {t.name} lies outside its slab")
        if t.nbytes != math.prod(t.shape) * t.dtype.itemsize or any(d < 0 for d in t.shape):
            raise ShardFormatError(f"{where}: tensor {t.name}: {t.nbytes} bytes do not fit its shape {t.shape}")
        if t.scale_shape is not None:
            _check_scales(t, entry, where)
    return entry


def _check_scales(t: TensorEntry, entry: SlabEntry, where: str) -> None:
    """Row/block scales: of an fp8 tensor, shaped as quant.scale_shape makes them, inside the slab and
    after the tensor bytes (the widening would read anything else as scales)."""
    from ..quant import scale_shape

    scaling = "row" if len(t.scale_shape or ()) == 1 else "block"
    if t.dtype is not torch.float8_e4m3fn or not t.shape or list(scale_shape(t.shape, scaling) or ()) != t.scale_shape:
        raise ShardFormatError(f"{where}: tensor {t.name}: scale_shape {t.scale_shape} is not the row or block scales "
                               f"of a float8_e4m3fn tensor of shape {t.shape}")
    end_of_tensors = max(x.offset + x.nbytes for x in entry.tensors)
    if t.scale_offset < end_of_tensors or t.scale_offset % 4 or t.scale_offset + t.scale_nbytes > entry.nbytes:
        raise ShardFormatError(f"{where}: tensor {t.name}: its scales lie outside the slab's scale area")


def safetensors_header(slabs: list[SlabEntry], data_start: int, file_nbytes: int) -> bytes:
    """The safetensors header of a shard file whose data begins at ``data_start`` (header included).

    Real tensors carry their names, fp8 row/block scales ``__scale__.<name>``; every gap (alignment
    padding) becomes a ``__pad__.N`` uint8
    tensor, so the data is fully indexed as safetensors requires.
    """
    spans: list[tuple[int, int, str, dict[str, Any]]] = []
    for s in slabs:
        for t in s.tensors:
            start = s.offset + t.offset - data_start
            spans.append((start, start + t.nbytes, t.name, {"dtype": ST_CODES[t.dtype], "shape": list(t.shape)}))
            if t.scale_shape is not None:
                start = s.offset + t.scale_offset - data_start
                spans.append((start, start + t.scale_nbytes, SCALE_PREFIX + t.name,
                              {"dtype": "F32", "shape": list(t.scale_shape)}))
    spans.sort(key=lambda x: x[0])
    version = SCALES_VERSION if any(t.scale_shape is not None for s in slabs for t in s.tensors) else FORMAT_VERSION
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "offload_jobs_shards": str(version)}}
    pos, pads = 0, 0
    end = file_nbytes - data_start
    for start, stop, name, info in [*spans, (end, end, "", {})]:
        if start > pos:
            header[f"{PAD_PREFIX}{pads}"] = {"dtype": "U8", "shape": [start - pos], "data_offsets": [pos, start]}
            pads += 1
        if name:
            header[name] = {**info, "data_offsets": [start, stop]}
        pos = stop
    return json.dumps(header, separators=(",", ":")).encode()
