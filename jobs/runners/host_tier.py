"""Where a job's transformer weights live on the host: in RAM, or streamed from disk when RAM is short.

`choose_host_tier` runs in the train and infer runners between `offload_config` and `load_transformer`.
With `offload.lazy_load` unset it measures (jobs/runners/ram.py): the weights at the job's dtype,
what the process holds now, the job's RAM. When they do not fit, the transformer is sharded once
into the model cache (jobs/runners/shard_cache.py; later jobs reuse it) and the engine gets
`lazy_load` with that shard directory and a `max_memory` sized from what the job's RAM leaves. The
user never writes `lazy_load` or `shard_dir`; `lazy_load: false` keeps the weights in RAM whatever
the numbers; `lazy_load: true` without a `shard_dir` takes the cache's shards.

It says so in events.jsonl: `runner.host_store` (ram or disk, the numbers, the reason) and, for the
disk, `runner.shard_cache` (hit or miss, the entry, what was written).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from jobs.contract import Metric
from jobs.home import model_cache
from jobs.runners.ram import TIER_DISK, decide_tier, disk_max_memory, job_ram, ram_margin
from jobs.runners.shard_cache import cached_shards, read_source, shard_cache_root
from jobs.runners.telemetry import emit_event
from jobs.spec import JobSpec

__all__ = ["choose_host_tier"]


def _say(line: str) -> None:
    print(f"[offload-jobs] {line}", flush=True)


def choose_host_tier(spec: JobSpec, offload: Any, model_dir: Path, dtype: torch.dtype, run_dir: Path,
                     held_bytes: int, transformer_dir: Path | None = None) -> Any:
    """`offload` (the engine's OffloadConfig, or None: no engine) with the disk tier on where the
    job's RAM cannot hold the weights; unchanged otherwise. `held_bytes`: this process's RSS now.
    `transformer_dir`: the transformer folder when not `model_dir`'s transformer/."""
    if offload is None or offload.offload_to_disk or (offload.lazy_load and offload.shard_dir):
        if offload is not None and offload.lazy_load:
            emit_event(run_dir, Metric.host_store, host_store=TIER_DISK, reason="offload.lazy_load with its shard_dir",
                       shard_dir=offload.shard_dir)
        return offload  # the user's own shards, or no engine: nothing to decide
    from offload_core.disk.errors import ShardError

    try:
        folder = Path(transformer_dir) if transformer_dir is not None else Path(model_dir) / "transformer"
        source = read_source(folder, dtype, offload.weight_dtype, offload.fp8_scaling)
    except ShardError as exc:  # no safetensors to size or shard: loading says what is wrong with the folder
        _say(f"host RAM: not checked ({exc})")
        return offload
    ram = job_ram(spec.resources.ram, held_bytes)
    d = decide_tier(source.weight_bytes, held_bytes, ram.bytes, ram_margin(ram.bytes), spec.offload.lazy_load)
    numbers = dict(weight_bytes=d.weight_bytes, held_bytes=d.held_bytes, ram_bytes=d.ram_bytes, ram_source=ram.source,
                   available_bytes=d.available_bytes, margin_bytes=d.margin_bytes)
    if d.tier != TIER_DISK:
        emit_event(run_dir, Metric.host_store, host_store=d.tier, reason=d.reason, **numbers)
        return offload
    _say(f"host RAM: {d.reason} ({ram.source}); streaming the weights from disk")
    got = cached_shards(source, shard_cache_root(model_cache(Path(run_dir).parent.parent)), say=_say)
    emit_event(run_dir, "shard_cache", **got.event())
    max_memory = offload.max_memory
    if spec.offload.max_memory is None:
        from offload_core.disk import load_index
        from offload_core.disk.integrate import MIN_STREAM_SLOTS

        sizes = [u.read_nbytes for u in load_index(got.path).units.values()]
        slots = offload.disk_stream_slots or offload.num_disk_workers + 2
        max_memory = disk_max_memory(d.headroom_bytes, sum(sizes), max(sizes, default=0),
                                     offload.disk_stream_slots or MIN_STREAM_SLOTS, slots)
    emit_event(run_dir, Metric.host_store, host_store=TIER_DISK, reason=d.reason, shard_dir=str(got.path),
               max_memory_bytes=max_memory, **numbers)
    # the shards hold the job's fp8 scaling (read_source), so the engine's key stays as the user set it
    return dataclasses.replace(offload, lazy_load=True, shard_dir=str(got.path), max_memory=max_memory)
