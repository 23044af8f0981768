"""The model cache's shards: a transformer sharded once for the disk tier, reused by every later job.

    <model cache>/shards/                 ($OFFLOAD_JOBS_MODEL_CACHE, else the state dir's models/)
        <key>/            a complete entry: the shard directory (index.json, one file per block) and
                          cache.json, the completion marker, written last
        <key>.partial/    a sharding under way, or one a killed job left: the next job resumes it
                          (shard_checkpoint re-reads every file it would keep and checks its sha256)
        <key>.lock        held (flock) by the job sharding <key>; a second job waits, then takes the entry

An entry is taken only when its cache.json names its key. The entry is made by renaming the finished
`.partial` folder (after the marker is written and synced), so a crash never leaves a folder a later
job takes as complete; a `<key>` folder without its marker (a copy cut short, an older layout) is
removed and sharded again.

The key is content-addressed by the source's identity: the shard format version, the storage dtype
(and fp8's row or block scaling; tensor-scaled entries keep the key they had before scalings),
the granularity, and per source file (the transformer's safetensors and config.json, symlinks
resolved: a hub snapshot's blobs are named by their content hash) its path, size, mtime and every
tensor's name, dtype, shape and offsets. Reading 24 GB to hash it would cost more than it saves; a
file rewritten in place at the same size and mtime is the one change this does not see.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from jobs.runners.errors import SetupError

__all__ = ["ShardSource", "CachedShards", "MARKER", "read_source", "shard_key", "is_complete", "cached_shards",
           "shard_cache_root", "locked", "publish_entry", "check_space"]

MARKER = "cache.json"
GRANULARITY = "block"  # what the engine's default granularity binds to; also in the key


def shard_cache_root(model_cache: Path) -> Path:
    return model_cache / "shards"


@dataclass(frozen=True)
class ShardSource:
    """A transformer folder as the cache sees it: its files, its tensors, and the dtype to store them in."""

    folder: Path
    files: list[Path]
    config: Path | None
    tensors: list[tuple[str, str, tuple[int, ...], int, int]]  # name, dtype, shape, start, nbytes
    store_dtype: str | None  # None: as the files hold them (they are already in the job's dtype)
    weight_bytes: int  # every tensor at the job's dtype (integers and fp8 weights as stored)
    fp8_scaling: str | None = None  # with store_dtype float8_e4m3fn: tensor, row or block (quant.py)


FP8_SIDE = (".scale_weight", ".scale_input")  # ComfyUI's scaled fp8: beside each fp8 weight


def read_source(folder: Path, dtype: torch.dtype, weight_dtype: str | None = None,
                fp8_scaling: str | None = None) -> ShardSource:
    """The headers of `folder`'s safetensors files (nothing else is read), for a job computing in
    `dtype` and storing its weight matrices in `weight_dtype` (the engine's key; None: in `dtype`),
    fp8 scaled as `fp8_scaling` says (None: the engine's default)."""
    from offload_core.disk.source import SafetensorsSource, source_files

    files, config = source_files(folder)
    src = SafetensorsSource(files, config)
    store = getattr(torch, weight_dtype) if weight_dtype else dtype
    try:
        tensors = [(t.name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.start, t.nbytes)
                   for t in src.tensors.values()]
        floats = [t for t in src.tensors.values() if t.dtype.is_floating_point]
        # fp8 weights (ComfyUI's fp8 files) stay fp8 as stored in RAM and in the shards, unless weight_dtype
        # re-stores them: counted at their bytes, and computing in the file's other dtype (disk/grouping.py)
        native = not weight_dtype and any(t.dtype is torch.float8_e4m3fn for t in floats)
        # ... and their scales (fp32 scalars beside them: in the index, not in the shards) do not ask for widening
        rest = [t for t in floats if not (native and (t.dtype is torch.float8_e4m3fn or t.name.endswith(FP8_SIDE)))]
        kept = {id(t) for t in rest}
        weight_bytes = sum(t.numel * (store if len(t.shape) >= 2 else dtype).itemsize for t in rest) + sum(
            t.nbytes for t in src.tensors.values() if id(t) not in kept)
        # fp8 as stored computes in the others' dtype (bf16 when there are none): they must be the job's
        differs = any(t.dtype != dtype for t in rest) or (native and not rest and dtype != torch.bfloat16)
    finally:
        src.close()
    if weight_dtype:
        store_dtype: str | None = weight_dtype  # the shards hold what the engine would store (fp8 with its scales)
    else:
        store_dtype = str(dtype).removeprefix("torch.") if differs else None
    scaling = None
    if store_dtype == "float8_e4m3fn":
        from offload_core.quant import DEFAULT_SCALING

        scaling = fp8_scaling or DEFAULT_SCALING
    return ShardSource(folder, files, config, tensors, store_dtype, weight_bytes, scaling)


def shard_key(source: ShardSource) -> str:
    from offload_core.disk.format import FORMAT_VERSION

    h = hashlib.sha256()
    ident: dict[str, Any] = {"format_version": FORMAT_VERSION, "dtype": source.store_dtype, "granularity": GRANULARITY}
    if source.fp8_scaling not in (None, "tensor"):  # row/block slabs differ from tensor-scaled ones
        ident["fp8_scaling"] = source.fp8_scaling
    h.update(json.dumps(ident).encode())
    for p in [*source.files, *([source.config] if source.config else [])]:
        real = p.resolve()
        st = real.stat()
        h.update(json.dumps([str(real), st.st_size, st.st_mtime_ns]).encode())
    h.update(json.dumps(source.tensors).encode())
    return h.hexdigest()[:32]


def is_complete(entry: Path, key: str, required: str = "index.json") -> bool:
    try:
        marker = json.loads((entry / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("key") == key and (entry / required).is_file()


@dataclass
class CachedShards:
    path: Path
    key: str
    hit: bool
    seconds: float = 0.0
    written_bytes: int = 0
    resumed_units: int = 0
    removed_incomplete: bool = False  # a <key> folder without its marker was there and was removed

    def event(self) -> dict[str, Any]:
        return {"result": "hit" if self.hit else "miss", "path": str(self.path), "key": self.key,
                "shard_seconds": round(self.seconds, 3), "written_bytes": self.written_bytes,
                "resumed_units": self.resumed_units, "removed_incomplete": self.removed_incomplete}


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a job sharding the same model: wait for it, then take its entry
        yield
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_entry(partial: Path, entry: Path, marker: dict[str, Any]) -> None:
    """Make the finished `partial` folder the entry `entry`: its marker written and synced, then one rename."""
    tmp = partial / f"{MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, partial / MARKER)
    _fsync_dir(partial)
    os.rename(partial, entry)
    _fsync_dir(entry.parent)


def check_space(root: Path, need: int) -> None:
    free = shutil.disk_usage(root).free
    if free < need:
        raise SetupError(f"{root}: {free / 2**30:.1f} GiB free, and streaming this model from disk needs its shards "
                         f"there once ({need / 2**30:.1f} GiB); free space, set OFFLOAD_JOBS_MODEL_CACHE to a larger "
                         "disk, or set offload.lazy_load: false to hold the weights in RAM")


def cached_shards(source: ShardSource, root: Path, say: Callable[[str], None] = print) -> CachedShards:
    """The complete cache entry for `source` under `root`, sharded now (once) if there is none."""
    from offload_core.shard import shard_checkpoint

    key = shard_key(source)
    entry = root / key
    if is_complete(entry, key):
        return CachedShards(entry, key, hit=True)
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f"{key}.lock"):
        if is_complete(entry, key):  # another job finished it while this one waited
            return CachedShards(entry, key, hit=True)
        out = CachedShards(entry, key, hit=False, removed_incomplete=entry.exists())
        if out.removed_incomplete:
            shutil.rmtree(entry)  # never trusted without its marker
        partial = root / f"{key}.partial"
        check_space(root, source.weight_bytes)
        say(f"sharding {source.folder} into the model cache ({source.weight_bytes / 1e9:.2f} GB, once): {entry}")
        t0 = time.monotonic()

        def report(p: dict[str, Any]) -> None:  # a line per tenth of the files: minutes for a 24 GB model
            done, total = p["files_done"], p["files_total"]
            if done == total or done % max(1, total // 10) == 0:
                say(f"  sharded {done}/{total} files ({p['written']} units written, {p['resumed']} resumed)")

        result = shard_checkpoint(source.folder, partial, dtype=source.store_dtype, granularity=GRANULARITY,
                                  progress=False, callback=report, overwrite=True, fp8_scaling=source.fp8_scaling)
        publish_entry(partial, entry, {"key": key, "source": str(source.folder), "dtype": source.store_dtype,
                                       "fp8_scaling": source.fp8_scaling,
                                       "bytes": result["bytes"], "created": time.time()})
        out.seconds = time.monotonic() - t0
        out.written_bytes, out.resumed_units = result["written_bytes"], result["resumed"]
    return out
