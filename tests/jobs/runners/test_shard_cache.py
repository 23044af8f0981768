"""The model cache's shards (jobs/runners/shard_cache.py), without a worker: the key follows the
source and the dtype; a sharding killed in `.partial` is finished by the next job (each kept file
checked), never taken as it was; a complete entry is taken without a write."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from jobs.runners.shard_cache import MARKER, cached_shards, is_complete, read_source, shard_key


@pytest.fixture
def flux(tiny: dict[str, Path], tmp_path: Path) -> Path:
    """A copy of the tiny Flux transformer folder (its files are touched here)."""
    return Path(shutil.copytree(tiny["flux"] / "transformer", tmp_path / "transformer"))


def test_the_key_follows_the_source_files_and_the_dtype(flux: Path) -> None:
    fp32 = read_source(flux, torch.float32)
    assert fp32.store_dtype is None  # the tiny model is saved in float32: sharded as stored
    bf16 = read_source(flux, torch.bfloat16)
    assert bf16.store_dtype == "bfloat16" and bf16.weight_bytes * 2 == fp32.weight_bytes
    assert shard_key(fp32) != shard_key(bf16)
    fp8 = read_source(flux, torch.float32, "float8_e4m3fn")  # the engine's weight_dtype: matrices in one byte
    assert fp8.store_dtype == "float8_e4m3fn" and fp8.weight_bytes < fp32.weight_bytes / 3
    assert shard_key(fp8) not in (shard_key(fp32), shard_key(bf16))
    # fp8 slabs hold the job's scaling (row by default): each scaling its own entry
    assert fp8.fp8_scaling == "row" and fp32.fp8_scaling is None
    keys = {s: shard_key(read_source(flux, torch.float32, "float8_e4m3fn", s)) for s in ("tensor", "row", "block")}
    assert len(set(keys.values())) == 3 and keys["row"] == shard_key(fp8)
    before = shard_key(fp32)
    assert shard_key(read_source(flux, torch.float32)) == before
    weights = next(flux.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file rewritten
    assert shard_key(read_source(flux, torch.float32)) != before


def test_a_killed_sharding_is_finished_by_the_next_job_and_then_taken_as_is(flux: Path, tmp_path: Path) -> None:
    from offload_core.shard import shard_checkpoint

    source = read_source(flux, torch.float32)
    root = tmp_path / "shards"
    key = shard_key(source)
    partial = root / f"{key}.partial"
    # what a job killed while sharding leaves: some files finished, no index, no marker
    shard_checkpoint(flux, partial, progress=False)
    (partial / "index.json").unlink()
    block = sorted(partial.glob("transformer_blocks*.safetensors"))[-1]
    os.truncate(block, block.stat().st_size - 4096)  # the file it was writing when killed
    assert not is_complete(partial, key) and not (root / key).exists()
    got = cached_shards(source, root, say=lambda _: None)
    assert not got.hit and got.path == root / key and is_complete(got.path, key) and not partial.exists()
    assert got.resumed_units > 0 and got.written_bytes > 0  # the whole files kept (each checked), the cut one rewritten
    from offload_core.shard import verify_shards

    verify_shards(got.path)
    again = cached_shards(source, root, say=lambda _: None)
    assert again.hit and again.path == got.path and again.written_bytes == 0
    (got.path / MARKER).write_text('{"key": "another"}')  # a marker for some other source: not this entry
    assert not is_complete(got.path, key)
