"""Writing shard directories: from a checkpoint on disk, or from a model already in RAM.

    offload-jobs shard /models/FLUX.1-dev/transformer /models/flux-shards --dtype bfloat16

``shard_checkpoint`` reads the source tensor by tensor (``SafetensorsSource``: pread, page cache
dropped), converts each to its storage dtype (fp8 with its scales: one per tensor in the index, or row/block
fp32 scales in the slab after the unit's tensors, as ``fp8_scaling`` asks) and writes it at its
place in its unit's slab, so RAM stays about one tensor. ``shard_model`` does the same from a live
model's units (``offload_to_disk``), after which the model's RAM copy can be freed.

Every file goes through ``<name>.tmp``, fsync and rename; ``.progress.json`` records each finished
file (its layout and slab hashes), so a rerun after an interruption or a full disk skips the
files that are already right; index.json is written last, so its presence means complete.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator

import torch
from torch import nn

from ..config import Granularity
from ..quant import SCALINGS, quantize, widen
from ..units import Unit
from . import checksum
from .errors import ShardError, ShardWriteError, one_line
from .format import (FILE_ALIGN, FORMAT, FORMAT_VERSION, INDEX_NAME, NON_BLOCK_FILE, PROGRESS_NAME, SCALES_VERSION,
                     SLAB_ALIGN, ShardIndex, SlabEntry, TensorEntry, align, block_of, dtype_name, file_name, read_json,
                     safetensors_header)
from ..weights import base_name
from .grouping import group_checkpoint, group_model, native_fp8_compute, storage_for
from .source import SafetensorsSource, drop_page_cache, source_files, writable_buffer

__all__ = ["shard_checkpoint", "shard_model", "parse_dtype", "free_host_copies"]

_TARGETS = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
    "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn,
}
_ZEROS = bytes(1 << 20)

# Fills the destination (the tensor's typed, shaped place in the slab) and, for fp8 row/block, its fp32
# scales (the third argument, else None); returns the per-tensor fp8 scale, if any.
Producer = Callable[[TensorEntry, torch.Tensor, "torch.Tensor | None"], "float | None"]


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    store = _TARGETS.get(str(dtype).lower()) if isinstance(dtype, str) else dtype
    if dtype is not None and store not in _TARGETS.values():
        raise ShardError(f"dtype: {dtype!r} is not one of bfloat16, float16, float32, float8_e4m3fn")
    return store


# ------------------------------------------------------------------ layout of the files


@dataclass
class _FilePlan:
    name: str
    slabs: list[SlabEntry]  # placed: offsets set, sha256 and scales filled while writing
    data_start: int = 0
    nbytes: int = 0
    header: bytes = b""

    def place(self) -> None:
        """Put the header first, padded so the data starts at a FILE_ALIGN multiple, then the slabs."""
        estimate = 256 + sum(len(t.name) + 96 for s in self.slabs for t in s.tensors) * 2
        self.data_start = align(8 + estimate)
        while True:
            pos = self.data_start
            for s in self.slabs:
                s.offset = pos
                pos = align(pos + max(s.nbytes, 1))
            self.nbytes = pos
            head = safetensors_header(self.slabs, self.data_start, self.nbytes)
            if 8 + len(head) <= self.data_start:
                self.header = head + b" " * (self.data_start - 8 - len(head))
                return
            self.data_start = align(8 + len(head) + 1024)

    def layout_json(self) -> list[dict[str, Any]]:
        """What must agree for a finished file to be reused (everything but hashes and scales)."""
        return [{"name": s.name, "offset": s.offset, "nbytes": s.nbytes,
                 "tensors": [{k: v for k, v in t.to_json().items() if k != "scale"} | {"name": t.name}
                             for t in s.tensors]} for s in self.slabs]


def _unit_entry(name: str, file: str, u: Unit, tnames: list[str]) -> SlabEntry:
    tensors = [TensorEntry(n, ts.store_dtype or ts.dtype, list(ts.shape), ts.store_offset, ts.store_nbytes,
                           ts.dtype if ts.store_dtype is not None else None,
                           scale_shape=list(ts.scale_shape) if ts.scale_nbytes else None,
                           scale_offset=ts.scale_offset if ts.scale_nbytes else 0)
               for ts, n in zip(u.tensors, tnames)]
    return SlabEntry(name, file, nbytes=u.store_nbytes, tensors=tensors)


def _packed_entry(name: str, file: str, items: list[tuple[str, torch.dtype, list[int], torch.dtype | None]]) -> SlabEntry:
    """Tensors packed one after another at SLAB_ALIGN (the resident tensors)."""
    tensors, off = [], 0
    for n, dt, shape, store in items:
        sd = store or dt
        nbytes = sd.itemsize
        for s in shape:
            nbytes *= s
        tensors.append(TensorEntry(n, sd, list(shape), off, nbytes, dt if store is not None else None))
        off = align(off + nbytes, SLAB_ALIGN)
    return SlabEntry(name, file, nbytes=off, tensors=tensors)


def _plan_files(entries: list[SlabEntry], resident: SlabEntry | None) -> list[_FilePlan]:
    files: dict[str, _FilePlan] = {}
    for e in entries:
        files.setdefault(e.file, _FilePlan(e.file, [])).slabs.append(e)
    if resident is not None and resident.tensors:
        files.setdefault(resident.file, _FilePlan(resident.file, [])).slabs.append(resident)
    plans = sorted(files.values(), key=lambda f: f.name == NON_BLOCK_FILE)  # blocks in order, the rest last
    for p in plans:
        p.place()
    return plans


# ------------------------------------------------------------------ writing one file


def _write_error(path: Path, exc: OSError) -> ShardWriteError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ShardWriteError(f"{path}: no space left on device (the partial file was removed; "
                               "free space and rerun to resume)")
    return ShardWriteError(f"{path}: cannot write: {exc.strerror or one_line(exc)}")


def _write_zeros(f: Any, n: int, *digests: Any) -> None:
    while n > 0:
        k = min(n, len(_ZEROS))
        f.write(_ZEROS[:k])
        for d in digests:
            d.update(_ZEROS[:k])
        n -= k


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[BinaryIO]:
    """Write ``path`` through ``<path>.tmp``, fsync and rename. On any failure the temp file goes, and
    an OSError (a full disk) becomes a ShardWriteError naming ``path``."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            drop_page_cache(tmp, f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, ShardError):
            raise _write_error(path, exc) from None
        raise


def _write_file(dst: Path, plan: _FilePlan, produce: Producer) -> None:
    """Write one shard file, tensor by tensor, in file order; fills each slab's sha256 and scales.
    Row/block scales (a few bytes a row) are held until the slab's scale area, after its tensors."""
    with _atomic(dst / plan.name) as f:
        f.write(struct.pack("<Q", len(plan.header)))
        f.write(plan.header)
        pos = plan.data_start
        for s in plan.slabs:
            _write_zeros(f, s.offset - pos)
            digests = [hashlib.sha256(), *filter(None, [checksum.fast_hasher()])]
            at = 0
            scales: list[tuple[int, torch.Tensor]] = []
            for t in sorted(s.tensors, key=lambda t: t.offset):
                buf = torch.empty(t.shape, dtype=t.dtype)
                sbuf = torch.empty(t.scale_shape, dtype=torch.float32) if t.scale_shape is not None else None
                t.scale = produce(t, buf, sbuf)
                at = _put(f, digests, at, t.offset, buf)
                del buf
                if sbuf is not None:
                    scales.append((t.scale_offset, sbuf))
            for off, sbuf in sorted(scales, key=lambda x: x[0]):
                at = _put(f, digests, at, off, sbuf)
            _write_zeros(f, s.nbytes - at, *digests)
            s.sha256 = digests[0].hexdigest()
            s.xxh3 = digests[1].hexdigest() if len(digests) > 1 else ""
            pos = s.offset + s.nbytes
        _write_zeros(f, plan.nbytes - pos)


def _put(f: Any, digests: list[Any], at: int, offset: int, value: torch.Tensor) -> int:
    """Write ``value``'s bytes at ``offset`` into the slab being written (at ``at`` now), zeros before."""
    if offset < at:  # the layout puts scales after every tensor: anything else is a bug, never a silent overlap
        raise RuntimeError(f"shard writer: bytes at {offset} in a slab already written up to {at}")
    _write_zeros(f, offset - at, *digests)
    data = writable_buffer(value)
    for d in digests:
        d.update(data)
    f.write(data)
    return offset + value.numel() * value.element_size()


def _slab_digests(path: Path, s: SlabEntry) -> tuple[str, str]:
    """(sha256, xxh3) of a slab as it is on disk ("" for xxh3 without the xxhash package)."""
    digest, fast = hashlib.sha256(), checksum.fast_hasher()
    with open(path, "rb") as f:
        f.seek(s.offset)
        left = s.nbytes
        while left and (chunk := f.read(min(left, 16 << 20))):
            digest.update(chunk)
            if fast is not None:
                fast.update(chunk)
            left -= len(chunk)
    return digest.hexdigest(), fast.hexdigest() if fast is not None else ""


def _reusable(dst: Path, plan: _FilePlan, done: dict[str, Any]) -> bool:
    """A file an earlier run finished: same layout, size, header, and every slab's bytes."""
    path = dst / plan.name
    prev = done.get(plan.name)
    if not prev or prev.get("layout") != plan.layout_json() or not path.is_file():
        return False
    if path.stat().st_size != plan.nbytes:
        return False
    with open(path, "rb") as f:
        if f.read(8 + len(plan.header)) != struct.pack("<Q", len(plan.header)) + plan.header:
            return False
    hashes, scales = prev.get("sha256", {}), prev.get("scales", {})
    digests: dict[str, tuple[str, str]] = {}
    for s in plan.slabs:
        digests[s.name] = _slab_digests(path, s)
        if digests[s.name][0] != hashes.get(s.name):
            break
    else:
        for s in plan.slabs:
            s.sha256, s.xxh3 = digests[s.name]
            for t in s.tensors:
                t.scale = scales.get(t.name)
        drop_page_cache(path)
        return True
    drop_page_cache(path)
    return False


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # makes the renames durable; not every filesystem allows it
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    with _atomic(path) as f:
        f.write(data)


def _ours(dst: Path) -> bool:
    """Whether DST holds what a shard run writes: our index.json, or a killed run's .progress.json."""
    for name, key in ((INDEX_NAME, "format"), (PROGRESS_NAME, "fingerprint")):
        try:
            data = read_json(dst / name)
        except ShardError:
            continue
        if (data.get(key) == FORMAT) if key == "format" else isinstance(data.get(key), dict):
            return True
    return False


def _prepare_dst(dst: Path, src: Path | None, names: Iterable[str], overwrite: bool = False) -> None:
    """Make DST ready to write ``names`` into: refuse a folder of someone else's files (unless
    ``overwrite``); remove only the ``.tmp`` files this writer itself would have left."""
    if dst.exists() and not dst.is_dir():
        raise ShardWriteError(f"{dst}: exists and is not a directory")
    if src is not None and src.is_dir() and dst.resolve() == src.resolve():
        raise ShardWriteError(f"{dst}: the output directory must differ from SRC")
    if dst.is_dir() and not overwrite:
        try:
            entries = sorted(p.name for p in dst.iterdir())
        except OSError as exc:
            raise ShardWriteError(f"{dst}: cannot list the output directory: {exc.strerror or one_line(exc)}") from None
        if entries and not _ours(dst):
            raise ShardWriteError(
                f"{dst}: not empty ({len(entries)} entries, e.g. {entries[0]}) and not a shard directory this tool "
                "wrote; choose an empty or new folder, or pass --overwrite (overwrite=True) to write into it")
    try:
        dst.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".offload-jobs-write-test-", dir=dst)  # a name no user file has
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ShardWriteError(f"{dst}: output directory not writable: {exc.strerror or one_line(exc)}") from None
    for name in {*names, INDEX_NAME, PROGRESS_NAME}:  # a killed run's partial files: only names we write
        with contextlib.suppress(OSError):
            (dst / (name + ".tmp")).unlink()
    with contextlib.suppress(FileNotFoundError):
        (dst / INDEX_NAME).unlink()  # rewritten last: its absence marks an unfinished run


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="shard", unit="unit", file=sys.stderr, leave=True)


def _write_all(dst: Path, plans: list[_FilePlan], produce: Producer, fingerprint: dict[str, Any] | None,
               progress: bool, callback: Callable[[dict[str, Any]], None] | None,
               after_file: Callable[[_FilePlan], None] | None = None) -> dict[str, int]:
    """Write every file not already finished by an earlier run with the same fingerprint."""
    done: dict[str, Any] = {}
    if fingerprint is not None:
        with contextlib.suppress(ShardError, OSError):
            old = read_json(dst / PROGRESS_NAME)
            if old.get("fingerprint") == fingerprint and isinstance(old.get("files"), dict):
                done = old["files"]
    n_units = {p.name: sum(1 for s in p.slabs if s.name != "<resident>") for p in plans}
    counts = {"resumed": 0, "written": 0, "written_bytes": 0}
    bar = _progress_bar(sum(n_units.values()), progress)
    finished: dict[str, Any] = {}
    try:
        for i, plan in enumerate(plans):
            if _reusable(dst, plan, done):
                counts["resumed"] += n_units[plan.name]
            else:
                _write_file(dst, plan, produce)
                counts["written"] += n_units[plan.name]
                counts["written_bytes"] += plan.nbytes
            finished[plan.name] = {"layout": plan.layout_json(), "sha256": {s.name: s.sha256 for s in plan.slabs},
                                   "scales": {t.name: t.scale for s in plan.slabs for t in s.tensors
                                              if t.scale is not None}}
            if fingerprint is not None:
                _atomic_write_bytes(dst / PROGRESS_NAME, json.dumps(
                    {"fingerprint": fingerprint, "files": {**done, **finished}}).encode())
            if after_file is not None:
                after_file(plan)
            if bar is not None:
                bar.update(n_units[plan.name])
            if callback is not None:
                callback({"files_done": i + 1, "files_total": len(plans),
                          "units_done": counts["resumed"] + counts["written"], "units_total": sum(n_units.values()),
                          **counts})
    finally:
        if bar is not None:
            bar.close()
    return counts


def _finish(dst: Path, meta: dict[str, Any], plans: list[_FilePlan]) -> ShardIndex:
    units = {s.name: s for p in plans for s in p.slabs if s.name != "<resident>"}
    resident = next((s for p in plans for s in p.slabs if s.name == "<resident>"), None)
    # the scaling of the tensors this writer made fp8 (not those stored as they came); row/block
    # scales in the slabs make it version 3, so a reader of version 2 refuses the index by name
    scalings = {t.scaling for p in plans for s in p.slabs for t in s.tensors if t.scaling and t.source_dtype is not None}
    if scalings:
        meta = {**meta, "fp8_scaling": "/".join(sorted(scalings))}
    version = SCALES_VERSION if scalings - {"tensor"} else FORMAT_VERSION
    index = ShardIndex(dst / INDEX_NAME, {"format": FORMAT, "format_version": version, **meta,
                                          "file_align": FILE_ALIGN, "slab_align": SLAB_ALIGN},
                       units, resident, {p.name: p.nbytes for p in plans})
    data = index.to_json()
    for p in plans:
        data["files"][p.name]["header_sha256"] = hashlib.sha256(p.header).hexdigest()
    _atomic_write_bytes(dst / INDEX_NAME, json.dumps(data, indent=1).encode())
    _fsync_dir(dst)
    return index


# ------------------------------------------------------------------ from a checkpoint


def shard_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    granularity: str | Granularity = "block",
    progress: bool = True,
    verify: bool = False,
    config: str | os.PathLike[str] | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
    overwrite: bool = False,
    fp8_scaling: str | None = None,
) -> dict[str, Any]:
    """Shard SRC (a diffusers folder or a .safetensors file) into DST; returns a summary dict.

    dtype converts floating tensors (float8_e4m3fn: weight matrices only, scaled as ``fp8_scaling``
    says: tensor (one scale in the index), row or block (fp32 scales in the slab, as the engine's
    arena holds them); None: the engine's default, row). config names a config.json for a
    single-file checkpoint. callback gets a progress dict after each file. A rerun with the same
    arguments skips the files already finished. A DST that holds files this tool did not write is
    refused unless ``overwrite`` (which still removes nothing but the files it writes).
    """
    t0 = time.monotonic()
    src_p, dst_p = Path(src), Path(dst)
    target = parse_dtype(dtype)
    scaling = _fp8_scaling(fp8_scaling, target)
    try:
        g = Granularity(getattr(granularity, "value", granularity))
    except ValueError:
        raise ShardError(f"granularity: {granularity!r} is not one of leaf, block, phase, auto") from None
    files, config_path = source_files(src_p)
    if config is not None:
        config_path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
        if not config_path.is_file():
            raise ShardError(f"{config_path}: no such config file")
    source = SafetensorsSource(files, config_path)
    try:
        if not source.tensors:
            raise ShardError(f"{files[0]}: holds no tensors")
        native = _native_fp8_scales(source)  # ComfyUI's scaled fp8: into the index, as the tensors' scales
        grouping = group_checkpoint({n: t for n, t in source.tensors.items() if n not in native.aside},
                                    g, target, config_path, scaling or "tensor")
        entries = []
        for u in grouping.units:
            block = block_of(u.name, grouping.block_lists)
            entries.append(_unit_entry(u.name, file_name(block) if block else NON_BLOCK_FILE, u, grouping.names[u.uid]))
        # Resident tensors (tied, or outside any whole unit) never go fp8: the engine keeps them in their dtype.
        compute = native_fp8_compute(source.tensors)  # fp8 resident tensors are widened: nothing scales them later
        resident = _packed_entry("<resident>", NON_BLOCK_FILE, [
            (n, compute, source.tensors[n].shape, None) if source.tensors[n].dtype is torch.float8_e4m3fn and compute
            else (n, source.tensors[n].dtype, source.tensors[n].shape,
                  storage_for(source.tensors[n].dtype, source.tensors[n].shape, False, target))
            for n in grouping.resident])
        plans = _plan_files(entries, resident)
        _prepare_dst(dst_p, src_p, [p.name for p in plans], overwrite)
        fingerprint = {
            "format_version": FORMAT_VERSION, "source": str(src_p.resolve()),
            "inputs": {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns]
                       for p in [*files, *([config_path] if config_path else [])]},
            "dtype": None if target is None else dtype_name(target), "granularity": grouping.granularity,
            **({"fp8_scaling": scaling} if scaling not in (None, "tensor") else {}),
        }

        def produce(t: TensorEntry, out: torch.Tensor, scale_out: torch.Tensor | None) -> float | None:
            if source.tensors[t.name].dtype == t.dtype:
                source.read_into(t.name, out)
                return native.scales.get(t.name)  # an fp8 weight as stored: its file's scale, if any
            x = source.read(t.name)
            if t.name in native.scales:  # widened with its scale, as the engine widens it from RAM
                x = widen(x, native.scales[t.name], t.dtype)
            _, scale = quantize(x, t.dtype, out=out, scaling=t.scaling or "tensor", scale_out=scale_out)
            return scale if isinstance(scale, float) else None

        counts = _write_all(dst_p, plans, produce, fingerprint, progress, callback,
                            after_file=lambda _: source.release())
    finally:
        source.close()
    meta = {"source": fingerprint["source"], "dtype": fingerprint["dtype"], "granularity": grouping.granularity,
            "grouping": grouping.kind, "model_class": grouping.model_class, "block_lists": grouping.block_lists,
            # how many scaled fp8 weights had their scale_weight kept (as stored) or applied (widened): a loader
            # of a scaled fp8 folder refuses shards without it (written before the scales were read)
            **({"native_fp8_scales": len(native.scales)} if native.scales else {})}
    index = _finish(dst_p, meta, plans)
    if verify:
        from .verify import verify_shards

        verify_shards(dst_p)
    return {"index": str(index.path), "units": len(index.units), "files": len(plans), "tensors": len(source.tensors),
            "bytes": sum(p.nbytes for p in plans), **counts, "seconds": round(time.monotonic() - t0, 3)}


@dataclass
class _NativeScales:
    scales: dict[str, float]  # fp8 weight name -> its scale_weight
    aside: set[str]  # tensors that are not the model's: the scales, scale_input, the scaled_fp8 marker


def _native_fp8_scales(source: SafetensorsSource) -> _NativeScales:
    """ComfyUI's scaled fp8 checkpoints hold ``X.scale_weight`` (one fp32) beside each fp8 ``X.weight``
    (the value is their product), ``X.scale_input`` (for fp8 matmuls, which widening does not do) and
    a ``scaled_fp8`` marker. The scale goes into the index as the weight's per-tensor fp8 scale (what
    the engine widens with: quant.adopt_native_fp8 reads the same number off the module); without
    it the shards would stream the bare fp8 bytes, off by that factor."""
    out = _NativeScales({}, set())
    for name, t in source.tensors.items():
        if name.endswith(".scale_weight"):
            weight = source.tensors.get(name.removesuffix(".scale_weight") + ".weight")
            if weight is None or weight.dtype is not torch.float8_e4m3fn or t.numel != 1:
                continue  # not ComfyUI's per-tensor scale: the model's own tensor, sharded as such
            out.scales[weight.name] = float(source.read(name).float().reshape(()))
            out.aside.add(name)
    for name, t in source.tensors.items():
        if (name.endswith(".scale_input") and name.removesuffix(".scale_input") + ".weight" in out.scales) or (
                name == "scaled_fp8" and out.scales):
            out.aside.add(name)
    return out


# ------------------------------------------------------------------ from a model in RAM (offload_to_disk)


def shard_model(
    model: nn.Module,
    units: list[Unit],
    dst: str | os.PathLike[str],
    block_lists: Iterable[str] = (),
    *,
    resident: bool = True,
    progress: bool = False,
    callback: Callable[[dict[str, Any]], None] | None = None,
    overwrite: bool = False,
) -> ShardIndex:
    """Write the shards of a model already in RAM, unit by unit, in the units' own layout.

    ``units`` are the engine's (``discover_units`` with any ``store_dtype`` the engine chose); each
    fp8 tensor's scale is written to the index and set on its TensorSlot. ``resident=True`` also
    writes every other tensor of the model (tied, trainable, kept resident) as the index's resident
    tensors, so the directory is a whole checkpoint that ``lazy_load`` can start from.
    After this the model's host copy of the units can be freed (``free_host_copies``).
    """
    dst_p = Path(dst)
    block_lists = list(block_lists)
    # The index holds the checkpoint's names: a peft-wrapped model's base_layer steps left out, as
    # bind_units and lazy_load look them up.
    names = {uid: [base_name(n) for n in ns] for uid, ns in group_model(model, units).items()}
    entries = []
    slot_of: dict[str, Any] = {}
    for u in units:
        block = block_of(u.name, block_lists)
        entries.append(_unit_entry(base_name(u.name), file_name(block) if block else NON_BLOCK_FILE, u, names[u.uid]))
        for ts, n in zip(u.tensors, names[u.uid]):
            slot_of[n] = ts
    others: list[tuple[str, torch.dtype, list[int], torch.dtype | None]] = []
    values: dict[str, torch.Tensor] = {}
    if resident:
        seen = {id(ts.tensor()) for ts in slot_of.values()}
        for mname, m in model.named_modules():
            for attr, t in [*m._parameters.items(), *m._buffers.items()]:
                if t is None or id(t) in seen or t.device.type == "meta" or not t.numel():
                    continue
                seen.add(id(t))  # a tied tensor once, under its first name
                n = base_name(f"{mname}.{attr}" if mname else attr)
                values[n] = t
                others.append((n, t.dtype, list(t.shape), None))
    plans = _plan_files(entries, _packed_entry("<resident>", NON_BLOCK_FILE, others) if others else None)
    _prepare_dst(dst_p, None, [p.name for p in plans], overwrite)

    def produce(t: TensorEntry, out: torch.Tensor, scale_out: torch.Tensor | None) -> float | None:
        ts = slot_of.get(t.name)
        x = (ts.tensor() if ts is not None else values[t.name]).detach()
        if x.device.type == "meta":
            raise ShardError(f"{dst_p}: tensor {t.name} is on the meta device; offload_to_disk needs the weights in RAM")
        _, scale = quantize(x.to("cpu"), t.dtype, out=out, scaling=t.scaling or "tensor", scale_out=scale_out)
        if not isinstance(scale, float):
            return None  # none, or row/block scales: written into the slab from scale_out
        if ts is not None:
            ts.scale = scale
        return scale

    _write_all(dst_p, plans, produce, None, progress, callback)
    meta = {"source": f"model:{type(model).__name__}", "dtype": None, "granularity": None, "grouping": "model",
            "model_class": type(model).__name__, "block_lists": block_lists}
    return _finish(dst_p, meta, plans)


def _fp8_scaling(fp8_scaling: str | None, target: torch.dtype | None) -> str | None:
    """The fp8 scaling a shard run writes: the one asked, else the engine's default (row); None without fp8."""
    from ..quant import DEFAULT_SCALING

    if fp8_scaling is not None and fp8_scaling not in SCALINGS:
        raise ShardError(f"fp8_scaling: {fp8_scaling!r} is not one of {', '.join(SCALINGS)}")
    if target is not torch.float8_e4m3fn:
        if fp8_scaling is not None:
            raise ShardError(f"fp8_scaling: applies to dtype float8_e4m3fn only (dtype is "
                             f"{'unset' if target is None else dtype_name(target)})")
        return None
    return fp8_scaling or DEFAULT_SCALING


def free_host_copies(units: list[Unit]) -> int:
    """Let go of the RAM copy of every unit tensor (after ``shard_model``); returns the bytes freed.

    Each tensor keeps its object and gets 0-element data (as the engine's placeholders), so
    references to the Parameters (an optimizer, peft) stay valid.
    """
    freed = 0
    for u in units:
        for ts in u.tensors:
            t = ts.tensor()
            if t is not None and t.device.type == "cpu" and t.numel():
                freed += t.numel() * t.element_size()
                t.data = torch.empty(0, dtype=t.dtype)
    from .pool import trim_host_heap

    trim_host_heap()
    return freed
