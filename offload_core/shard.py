"""Shard preprocessor: rewrite a checkpoint as one safetensors file per block, for the disk tier.

    offload-jobs shard /models/FLUX.1-dev/transformer /models/flux-shards --dtype bfloat16

DST then holds:
    index.json                        written last: unit -> file, tensors (dtype, shape, offset, sha256)
    transformer_blocks.0.safetensors  one file per block, holding every unit inside that block
    non_block.safetensors             the units outside the blocks (embedders, norms, projections)
    .progress.json                    the files already finished, so that a rerun resumes

Unit names are the engine's own: a diffusers folder's model is built on the meta device from its
config.json and handed to `discover_units`. A checkpoint without a config is grouped by tensor
name: `<list>.<N>.` blocks, other tensors by their module path (the engine's leaf-unit names).
Tensors stream one at a time from safe_open into the output, so RAM stays about one tensor; each file
goes through `<name>.tmp`, fsync and rename, and index.json exists only once everything is written.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .config import Granularity
from .errors import ShardError
from .quant import quantize

__all__ = ["FORMAT", "FORMAT_VERSION", "INDEX_NAME", "NON_BLOCK_FILE", "ShardSourceNotFound",
           "shard_checkpoint", "verify_shards"]

FORMAT = "offload-jobs-shards"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
PROGRESS_NAME = ".progress.json"
NON_BLOCK_FILE = "non_block.safetensors"
_CHUNK = 16 << 20

_ST_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
_FROM_ST = {code: dt for dt, code in _ST_CODES.items()}
_TARGETS = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
    "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn,
}


class ShardSourceNotFound(ShardError, FileNotFoundError):
    """SRC does not exist (a FileNotFoundError too, so callers that catch that see it)."""


@dataclass
class _Tensor:
    name: str
    file: Path
    dtype: torch.dtype
    shape: list[int]


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


# ------------------------------------------------------------------ reading the source


def _source_files(src: Path) -> tuple[list[Path], Path | None]:
    """The safetensors files of SRC, and its config.json when it has one."""
    if not src.exists():
        raise ShardSourceNotFound(f"{src}: no such file or directory")
    if src.is_file():
        if not src.name.endswith(".safetensors"):
            raise ShardError(f"{src}: not a .safetensors file (only safetensors checkpoints can be sharded)")
        return [src], None
    config = src / "config.json" if (src / "config.json").is_file() else None
    indexes = sorted(src.glob("*.safetensors.index.json"))
    if indexes:
        preferred = src / "diffusion_pytorch_model.safetensors.index.json"
        index = preferred if preferred in indexes else indexes[0]  # the others are variants (fp16, ...)
        weight_map = _read_json(index).get("weight_map")
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


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ShardError(f"{path}: cannot read JSON: {_line(exc)}") from None
    if not isinstance(data, dict):
        raise ShardError(f"{path}: expected a JSON object")
    return data


class _Reader:
    """safe_open handles, opened as needed; errors name the file.

    `close()` after each output file unmaps the sources and drops their page cache: safe_open
    reads through mmap, so a long run would otherwise show the whole checkpoint as resident memory.
    """

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self._handles: dict[Path, Any] = {}

    def close(self) -> None:
        self._stack.close()
        for path in self._handles:
            _drop_page_cache(path)
        self._handles.clear()

    def handle(self, path: Path) -> Any:
        if path not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[path] = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # SafetensorError, OSError: a corrupt or truncated file
                raise ShardError(f"{path}: not a readable safetensors file: {_line(exc)}") from None
        return self._handles[path]

    def scan(self, files: Iterable[Path]) -> dict[str, _Tensor]:
        out: dict[str, _Tensor] = {}
        for path in files:
            f = self.handle(path)
            for name in f.keys():
                if name in out:
                    raise ShardError(f"{path}: tensor {name} is also in {out[name].file} (two checkpoints in one folder?)")
                code = f.get_slice(name).get_dtype()
                if code not in _FROM_ST:
                    raise ShardError(f"{path}: tensor {name} has dtype {code}, which the shard format does not carry")
                out[name] = _Tensor(name, path, _FROM_ST[code], list(f.get_slice(name).get_shape()))
        self.close()
        return out

    def read(self, t: _Tensor) -> torch.Tensor:
        try:
            return self.handle(t.file).get_tensor(t.name)
        except ShardError:
            raise
        except Exception as exc:
            raise ShardError(f"{t.file}: cannot read tensor {t.name}: {_line(exc)}") from None


def _drop_page_cache(path: Path) -> None:
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ------------------------------------------------------------------ unit names


def _block_of(unit: str, block_lists: list[str]) -> str | None:
    for bl in block_lists:
        m = re.match(re.escape(bl) + r"\.(\d+)(?=$|[.:])", unit)
        if m:
            return m.group(0)
    return None


def _model_units(config_path: Path, tensors: dict[str, _Tensor], granularity: Granularity,
                 ) -> tuple[dict[str, str | None], list[str], list[str], str]:
    """Tensor name -> the engine's unit name (None: kept resident), unit order, block lists, class."""
    cfg = _read_json(config_path)
    cls_name = cfg.get("_class_name")
    try:
        import diffusers

        cls = getattr(diffusers, cls_name, None) if isinstance(cls_name, str) else None
    except Exception:  # a lazy diffusers import that fails is an unknown class here
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ShardError(f"{config_path}: unknown model class {cls_name!r} (not a diffusers model)")
    try:
        with torch.device("meta"):
            model = cls.from_config(cfg)
    except Exception as exc:
        raise ShardError(f"{config_path}: cannot build {cls_name} from this config: {_line(exc)}") from None
    model.requires_grad_(False)  # frozen, as the engine streams it; trainable tensors stay resident there
    from .units import discover_units

    plan = discover_units(model, granularity)
    slot_unit = {(id(s.module), s.attr): u.name for u in plan.units for s in u.tensors}
    unit_of: dict[str, str | None] = {}
    shape_of: dict[str, list[int]] = {}
    for mname, m in model.named_modules(remove_duplicate=False):
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                full = f"{mname}.{attr}" if mname else attr
                unit_of.setdefault(full, slot_unit.get((id(m), attr)))
                shape_of.setdefault(full, list(t.shape))
    matched = [n for n in tensors if n in unit_of]
    if tensors and not matched:
        raise ShardError(f"{config_path}: no tensor of the checkpoint belongs to {cls_name} (wrong config.json?)")
    for n in matched:
        if tensors[n].shape != shape_of[n]:
            raise ShardError(f"{tensors[n].file}: tensor {n} has shape {tensors[n].shape}, "
                             f"{config_path.name} makes it {shape_of[n]}")
    return {n: unit_of.get(n) for n in tensors}, [u.name for u in plan.units], plan.block_lists, cls_name


def _find_block_lists(names: Iterable[str]) -> list[str]:
    """The outermost name prefixes whose children are all indices, at least two (as the engine finds lists)."""
    tree: dict[str, Any] = {}
    for name in names:
        node = tree
        *path, leaf = name.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node.setdefault(leaf, None)
    found: list[str] = []

    def visit(prefix: str, node: dict[str, Any]) -> None:
        for key, child in node.items():
            if child is None:
                continue
            path = f"{prefix}{key}"
            items = [k for k, c in child.items() if c is not None]
            if len(items) >= 2 and all(k.isdigit() for k in child):
                found.append(path)
            else:
                visit(path + ".", child)

    visit("", tree)
    return found


def _natural(name: str) -> list[Any]:
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"[.:]", name)]


def _name_units(tensors: dict[str, _Tensor], granularity: Granularity,
                ) -> tuple[dict[str, str | None], list[str], list[str]]:
    block_lists = _find_block_lists(tensors)
    g = granularity
    if g is Granularity.AUTO:
        g = Granularity.BLOCK if block_lists else Granularity.LEAF
    unit_of: dict[str, str | None] = {}
    for name in tensors:
        module = name.rpartition(".")[0] or "<root>"
        block = _block_of(name, block_lists)
        if block is None or g is Granularity.LEAF:
            unit_of[name] = module
        elif g is Granularity.BLOCK:
            unit_of[name] = block
        else:  # phase: the block's direct children, and its own tensors
            rest = name[len(block) + 1:]
            unit_of[name] = f"{block}.{rest.split('.')[0]}" if "." in rest else f"{block}:own"
    # Blocks in list order, then the rest, as discover_units lists them.
    order = sorted({u for u in unit_of.values() if u is not None},
                   key=lambda u: (_block_of(u, block_lists) is None, _natural(u)))
    return unit_of, order, block_lists


# ------------------------------------------------------------------ writing


def _target_dtype(t: _Tensor, store: torch.dtype | None) -> torch.dtype:
    if store is None or not t.dtype.is_floating_point:
        return t.dtype
    if store is torch.float8_e4m3fn:  # as quant.eligible: matrices only, norms and biases stay
        return store if len(t.shape) >= 2 else t.dtype
    return store


def _as_bytes(x: torch.Tensor) -> Any:
    return x.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, ShardError):
            raise _dst_error(path, exc) from None
        raise


def _dst_error(path: Path, exc: OSError) -> ShardError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ShardError(f"{path}: no space left on device (the partial file was removed; free space and rerun to resume)")
    return ShardError(f"{path}: cannot write: {exc.strerror or _line(exc)}")


def _write_file(path: Path, items: list[_Tensor], reader: _Reader, store: torch.dtype | None) -> dict[str, Any]:
    """Write one safetensors file, tensor by tensor; returns its sha256, size and per-tensor entries."""
    # Widest dtypes first keeps every tensor aligned to its element size (the header is padded to 8).
    order = sorted(items, key=lambda t: -_target_dtype(t, store).itemsize)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    entries: dict[str, dict[str, Any]] = {}
    pos = 0
    for t in order:
        dt = _target_dtype(t, store)
        n = int(torch.Size(t.shape).numel()) * dt.itemsize
        header[t.name] = {"dtype": _ST_CODES[dt], "shape": t.shape, "data_offsets": [pos, pos + n]}
        entries[t.name] = {"dtype": str(dt).removeprefix("torch."), "shape": t.shape, "nbytes": n}
        if dt != t.dtype:
            entries[t.name]["source_dtype"] = str(t.dtype).removeprefix("torch.")
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for buf in (struct.pack("<Q", len(head)), head):
                f.write(buf)
                digest.update(buf)
            for t in order:
                x = reader.read(t)
                dt = _target_dtype(t, store)
                scale = None
                if dt is torch.float8_e4m3fn and x.dtype != dt:
                    x, scale = quantize(x, dt)
                elif x.dtype != dt:
                    x = x.to(dt)
                buf = _as_bytes(x)
                e = entries[t.name]
                if buf.nbytes != e["nbytes"]:
                    raise ShardError(f"{t.file}: tensor {t.name} holds {buf.nbytes} bytes, its header says otherwise")
                e["offset"] = start + header[t.name]["data_offsets"][0]
                e["sha256"] = hashlib.sha256(buf).hexdigest()
                if scale is not None:
                    e["scale"] = scale
                f.write(buf)
                digest.update(buf)
                del x, buf
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, ShardError):
            raise _dst_error(path, exc) from None
        raise
    return {"sha256": digest.hexdigest(), "nbytes": start + pos, "tensors": entries}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _prepare_dst(dst: Path, src: Path) -> None:
    if dst.exists() and not dst.is_dir():
        raise ShardError(f"{dst}: exists and is not a directory")
    if src.is_dir() and dst.resolve() == src.resolve():
        raise ShardError(f"{dst}: the output directory must differ from SRC")
    try:
        dst.mkdir(parents=True, exist_ok=True)
        probe = dst / ".write-test.tmp"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ShardError(f"{dst}: output directory not writable: {exc.strerror or _line(exc)}") from None
    for leftover in dst.glob("*.tmp"):  # a killed run's partial files
        with contextlib.suppress(OSError):
            leftover.unlink()
    with contextlib.suppress(FileNotFoundError):
        (dst / INDEX_NAME).unlink()  # rewritten last: its absence marks an unfinished run


def _file_name(block: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", block) + ".safetensors"


# ------------------------------------------------------------------ the entry points


def shard_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    dtype: str | torch.dtype | None = None,
    granularity: str | Granularity = "block",
    progress: bool = True,
    verify: bool = False,
    config: str | os.PathLike[str] | None = None,
    callback: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Shard SRC (a diffusers folder or a .safetensors file) into DST; returns a summary dict.

    dtype converts floating tensors (float8_e4m3fn: matrices only, with a per-tensor scale in the
    index). config names a config.json for a single-file checkpoint. callback gets a progress dict
    after each file. A rerun with the same arguments skips the files already finished.
    """
    t0 = time.monotonic()
    src_p, dst_p = Path(src), Path(dst)
    store = _parse_dtype(dtype)
    try:
        g = Granularity(granularity)
    except ValueError:
        raise ShardError(f"granularity: {granularity!r} is not one of leaf, block, phase, auto") from None
    files, config_path = _source_files(src_p)
    if config is not None:
        config_path = Path(config) / "config.json" if Path(config).is_dir() else Path(config)
        if not config_path.is_file():
            raise ShardError(f"{config_path}: no such config file")

    reader = _Reader()
    try:
        tensors = reader.scan(files)
        if not tensors:
            raise ShardError(f"{files[0]}: holds no tensors")
        model_class = None
        if config_path is not None and "_class_name" in _read_json(config_path):
            unit_of, order, block_lists, model_class = _model_units(config_path, tensors, g)
        else:
            unit_of, order, block_lists = _name_units(tensors, g)
        layout = _Layout.build(tensors, unit_of, order, block_lists)
        resolved = g.value if g is not Granularity.AUTO else ("block" if block_lists else "leaf")
        _prepare_dst(dst_p, src_p)
        fingerprint = {
            "format_version": FORMAT_VERSION, "source": str(src_p.resolve()),
            "inputs": {str(p.resolve()): [p.stat().st_size, p.stat().st_mtime_ns]
                       for p in [*files, *([config_path] if config_path else [])]},
            "dtype": None if store is None else str(store).removeprefix("torch."), "granularity": resolved,
        }
        files_out, counts = _write_all(dst_p, layout, reader, store, fingerprint, progress, callback)
    finally:
        reader.close()

    def entry(fname: str, names: list[str]) -> dict[str, Any]:
        return {"file": fname, "tensors": {n: files_out[fname]["tensors"][n] for n in names}}

    index: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "source": fingerprint["source"],
        "dtype": fingerprint["dtype"], "granularity": resolved,
        "grouping": "model" if model_class else "names", "model_class": model_class, "block_lists": block_lists,
        "units": {u: entry(f, names) for u, (f, names) in layout.units.items()},
        "files": {f: {"sha256": v["sha256"], "nbytes": v["nbytes"]} for f, v in files_out.items()},
    }
    if layout.resident:  # tied/shared tensors (or ones the model lacks): the engine keeps them resident
        index["resident"] = entry(NON_BLOCK_FILE, layout.resident)
    _atomic_write_bytes(dst_p / INDEX_NAME, json.dumps(index, indent=1).encode())
    _fsync_dir(dst_p)
    if verify:
        verify_shards(dst_p)
    return {"index": str(dst_p / INDEX_NAME), "units": len(layout.units), "files": len(layout.files),
            "tensors": len(tensors), "bytes": sum(v["nbytes"] for v in files_out.values()), **counts,
            "seconds": round(time.monotonic() - t0, 3)}


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    store = _TARGETS.get(str(dtype).lower()) if isinstance(dtype, str) else dtype
    if dtype is not None and store not in _TARGETS.values():
        raise ShardError(f"dtype: {dtype!r} is not one of bfloat16, float16, float32, float8_e4m3fn")
    return store


@dataclass
class _Layout:
    files: dict[str, list[_Tensor]]  # output file -> its tensors; blocks in order, non_block last
    units: dict[str, tuple[str, list[str]]]  # unit -> (its file, its tensor names), in the engine's order
    resident: list[str]  # tensors no unit streams (tied, shared, or unknown to the model)

    @classmethod
    def build(cls, tensors: dict[str, _Tensor], unit_of: dict[str, str | None], order: list[str],
              block_lists: list[str]) -> _Layout:
        out = cls({}, {}, [])
        rank: dict[str | None, int] = {u: i for i, u in enumerate(order)}
        for name, t in sorted(tensors.items(), key=lambda kv: rank.get(unit_of[kv[0]], len(rank))):
            unit = unit_of[name]
            block = _block_of(unit, block_lists) if unit is not None else None
            fname = _file_name(block) if block else NON_BLOCK_FILE
            out.files.setdefault(fname, []).append(t)
            if unit is None:
                out.resident.append(name)
            else:
                out.units.setdefault(unit, (fname, []))[1].append(name)
        out.files = dict(sorted(out.files.items(), key=lambda kv: kv[0] == NON_BLOCK_FILE))
        return out


def _write_all(dst: Path, layout: _Layout, reader: _Reader, store: torch.dtype | None, fingerprint: dict[str, Any],
               progress: bool, callback: Callable[[dict[str, Any]], None] | None,
               ) -> tuple[dict[str, Any], dict[str, int]]:
    """Write every file not already finished by an earlier run with the same fingerprint."""
    done: dict[str, Any] = {}
    with contextlib.suppress(ShardError, OSError):
        old = _read_json(dst / PROGRESS_NAME)
        if old.get("fingerprint") == fingerprint and isinstance(old.get("files"), dict):
            done = old["files"]
    units_in = {f: sum(1 for fn, _ in layout.units.values() if fn == f) for f in layout.files}
    files_out: dict[str, Any] = {}
    counts = {"resumed": 0, "written": 0, "written_bytes": 0}
    bar = _progress_bar(len(layout.units), progress)
    try:
        for fname, items in layout.files.items():
            path = dst / fname
            prev = done.get(fname)
            if (prev and path.is_file() and path.stat().st_size == prev.get("nbytes")
                    and _file_sha256(path) == prev.get("sha256")):
                files_out[fname] = prev
                counts["resumed"] += units_in[fname]
            else:
                try:
                    files_out[fname] = _write_file(path, items, reader, store)
                finally:
                    reader.close()
                _drop_page_cache(path)
                counts["written"] += units_in[fname]
                counts["written_bytes"] += files_out[fname]["nbytes"]
                _atomic_write_bytes(dst / PROGRESS_NAME, json.dumps(
                    {"fingerprint": fingerprint, "files": {**done, **files_out}}).encode())
            if bar is not None:
                bar.update(units_in[fname])
            if callback is not None:
                callback({"files_done": len(files_out), "files_total": len(layout.files),
                          "units_done": counts["resumed"] + counts["written"], "units_total": len(layout.units),
                          **counts})
    finally:
        if bar is not None:
            bar.close()
    return files_out, counts


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # makes the renames durable; not every filesystem allows it
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="shard", unit="unit", file=sys.stderr, leave=True)


def verify_shards(dst: str | os.PathLike[str]) -> None:
    """Re-read every file in DST and check its size and sha256 (file and tensors) against index.json."""
    dst_p = Path(dst)
    index_path = dst_p / INDEX_NAME
    if not index_path.is_file():
        raise ShardError(f"{index_path}: missing (not a shard directory, or its shard run did not finish)")
    index = _read_json(index_path)
    if index.get("format") != FORMAT or index.get("format_version") != FORMAT_VERSION:
        raise ShardError(f"{index_path}: not an {FORMAT} index of version {FORMAT_VERSION}")
    try:
        by_file = _tensors_by_file(index)
        for fname, want in index["files"].items():
            _verify_file(dst_p / fname, want, by_file.get(fname, []))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ShardError(f"{index_path}: malformed ({type(exc).__name__}: {_line(exc)})") from None


def _tensors_by_file(index: dict[str, Any]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for entry in [*index["units"].values(), *([index["resident"]] if "resident" in index else [])]:
        for name, meta in entry["tensors"].items():
            by_file.setdefault(entry["file"], []).append((name, meta))
    return by_file


def _verify_file(path: Path, want: dict[str, Any], tensors: list[tuple[str, dict[str, Any]]]) -> None:
    """Size, then one sequential read that hashes the whole file and each tensor's bytes."""
    if not path.is_file():
        raise ShardError(f"{path}: missing")
    if path.stat().st_size != want["nbytes"]:
        raise ShardError(f"{path}: {path.stat().st_size} bytes, the index says {want['nbytes']}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        pos = 0
        for name, meta in sorted(tensors, key=lambda nm: nm[1]["offset"]):
            digest.update(f.read(meta["offset"] - pos))  # the header
            tensor_digest = hashlib.sha256()
            left = meta["nbytes"]
            while left and (chunk := f.read(min(left, _CHUNK))):
                left -= len(chunk)
                digest.update(chunk)
                tensor_digest.update(chunk)
            if tensor_digest.hexdigest() != meta["sha256"]:
                raise ShardError(f"{path}: tensor {name} does not match its sha256 in the index")
            pos = meta["offset"] + meta["nbytes"]
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    _drop_page_cache(path)
    if digest.hexdigest() != want["sha256"]:
        raise ShardError(f"{path}: sha256 does not match the index")
