"""RAM smaller than the model: the runners stream the transformer from shards in the model cache.

The decision (jobs/runners/ram.py) is a pure function, tested on its numbers. Through a real worker,
with the job's RAM ($OFFLOAD_JOBS_RAM_BUDGET) set below the tiny Flux transformer's weights: a train
job shards it once into the cache and streams it (its rows say host_store disk), an infer job takes
the same entry (a hit: no shard written, the entry's files untouched) and renders the same image,
byte for byte, as the same job holding the weights in RAM; an entry without its completion marker
(a killed shard write) is removed and sharded again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from runner_helpers import events, infer_spec, log, run_dir, run_job, step_records, strict_lines, train_spec

from jobs.runners.errors import SetupError
from jobs.runners.ram import (RAM_BUDGET_ENV, TIER_DISK, TIER_RAM, decide_tier, disk_max_memory, env_ram_budget,
                              job_ram, ram_margin)
from jobs.runners.shard_cache import MARKER

GiB = 2**30
BUDGET = "64KiB"  # below the tiny Flux transformer's ~540 KB of weights


# ---------------------------------------------------------------------------------- the decision


def test_weights_that_fit_stay_in_ram_and_those_that_do_not_go_to_disk() -> None:
    fits = decide_tier(weight_bytes=20 * GiB, held_bytes=3 * GiB, ram_bytes=32 * GiB, margin_bytes=2 * GiB)
    assert fits.tier == TIER_RAM and "fit" in fits.reason
    short = decide_tier(weight_bytes=24 * GiB, held_bytes=3 * GiB, ram_bytes=28 * GiB, margin_bytes=2 * GiB)
    assert short.tier == TIER_DISK and "do not fit" in short.reason
    assert short.available_bytes == 25 * GiB and short.headroom_bytes == 23 * GiB


def test_the_margin_tips_the_decision() -> None:
    # 3 + 24 = 27 GiB of 28: fits with a 1 GiB margin, not with a 1 GiB + 1 byte one
    assert decide_tier(24 * GiB, 3 * GiB, 28 * GiB, 1 * GiB).tier == TIER_RAM
    assert decide_tier(24 * GiB, 3 * GiB, 28 * GiB, 1 * GiB + 1).tier == TIER_DISK
    assert ram_margin(0) == 512 << 20 and ram_margin(10 * GiB) == GiB


def test_an_explicit_lazy_load_is_obeyed_whatever_the_numbers() -> None:
    kept = decide_tier(24 * GiB, 3 * GiB, 16 * GiB, GiB, lazy_load=False)
    assert kept.tier == TIER_RAM and "offload.lazy_load: false" in kept.reason and "may not fit" in kept.reason
    assert decide_tier(1, 0, 64 * GiB, GiB, lazy_load=True).tier == TIER_DISK


def test_the_disk_tiers_memory_is_what_ram_leaves_within_its_floor_and_ceiling() -> None:
    mb = 2**20
    # room for 3 GiB: the staging slots and part of the model cached
    assert disk_max_memory(3 * GiB, streamed_bytes=24 * GiB, largest_unit_bytes=500 * mb, min_slots=2, want_slots=4) == 3 * GiB
    # no room at all: the two staging slots the engine needs
    assert disk_max_memory(-5 * GiB, 24 * GiB, 500 * mb, 2, 4) == 1000 * mb
    # more room than the model: every unit cached and every slot
    assert disk_max_memory(100 * GiB, 24 * GiB, 500 * mb, 2, 4) == 24 * GiB + 2000 * mb


def test_the_job_ram_is_the_smallest_set() -> None:
    held = 10**9
    box = job_ram(None, held, environ={})
    assert box.source in ("MemAvailable", "the cgroup's memory.max") and box.bytes > held
    got = job_ram(None, held, environ={RAM_BUDGET_ENV: "2GiB"})
    assert (got.bytes, got.source) == (2 * GiB, f"${RAM_BUDGET_ENV}")
    got = job_ram(GiB, held, environ={RAM_BUDGET_ENV: "2GiB"})
    assert (got.bytes, got.source) == (GiB, "resources.ram")
    assert env_ram_budget({}) is None and env_ram_budget({RAM_BUDGET_ENV: " 16GiB "}) == 16 * GiB


def test_a_bad_ram_budget_is_one_line_naming_the_variable() -> None:
    with pytest.raises(SetupError) as err:
        env_ram_budget({RAM_BUDGET_ENV: "lots"})
    text = str(err.value)
    assert text.startswith(f"{RAM_BUDGET_ENV}: ") and "lots" in text and "\n" not in text


def test_a_bad_ram_budget_in_a_specs_env_is_refused_at_submit() -> None:
    from jobs.spec import parse_spec

    base = {"kind": "infer", "model": {"path": "/m"}, "infer": {"prompt": "a"}}
    with pytest.raises(Exception) as err:
        parse_spec({**base, "env": {RAM_BUDGET_ENV: "lots"}})
    assert f"env.{RAM_BUDGET_ENV}" in str(err.value) and "not a size" in str(err.value)
    assert parse_spec({**base, "env": {RAM_BUDGET_ENV: "16GiB"}, "resources": {"ram": "8GiB"}}).resources.ram == 8 * GiB


@pytest.mark.parametrize("weight_dtype", [None, "float8_e4m3fn"])
def test_lazy_load_alone_takes_the_caches_shards_and_streams_bitwise(tiny: dict[str, Path], tmp_path: Path,
                                                                     weight_dtype: str | None) -> None:
    """`offload.lazy_load: true` without a shard_dir (an error before): the model cache's shards, in
    the engine's storage dtype, and the forward is bitwise the one from RAM."""
    import torch
    from test_loading import _out

    from jobs.runners.families import get_adapter
    from jobs.runners.host_tier import choose_host_tier
    from jobs.runners.load import load_transformer, offload_config
    from jobs.spec import parse_spec

    home = tmp_path / "home"
    run = home / "runs" / "job1"
    run.mkdir(parents=True)
    keys = {"target_device": "cpu", "offload_granularity": "block", "weight_dtype": weight_dtype}
    keys = {k: v for k, v in keys.items() if v is not None}
    spec = parse_spec({"kind": "infer", "model": {"path": str(tiny["flux"])}, "infer": {"prompt": "a"},
                       "offload": {**keys, "lazy_load": True}})
    cpu = torch.device("cpu")
    config = choose_host_tier(spec, offload_config(spec, cpu, training=False), tiny["flux"], torch.float32, run,
                              held_bytes=0)
    assert config.lazy_load and Path(config.shard_dir).parent == home / "models" / "shards"
    assert json.loads((Path(config.shard_dir) / "index.json").read_text())["dtype"] == weight_dtype
    tier = json.loads((run / "events.jsonl").read_text().splitlines()[-1])
    assert tier["host_store"] == TIER_DISK and tier["reason"] == "offload.lazy_load: true"
    adapter = get_adapter("flux")
    disk = load_transformer(tiny["flux"], adapter, torch.float32, cpu, offload=config)
    # the cache's fp8 shards hold the job's scaling (row, the default): the RAM engine's, bitwise
    if weight_dtype:
        assert json.loads((Path(config.shard_dir) / "index.json").read_text())["fp8_scaling"] == "row"
    ram = load_transformer(tiny["flux"], adapter, torch.float32, cpu, offload=keys)
    assert disk.stats()["host_store"] == "disk" and ram.stats()["host_store"] != "disk"
    assert torch.equal(_out("flux", disk.model, torch.float32), _out("flux", ram.model, torch.float32))
    assert disk.stats()["disk_reads"] > 0
    disk.handle.remove()
    ram.handle.remove()


# ---------------------------------------------------------------------------------- through the worker


def _low_ram(spec: dict, budget: str = BUDGET) -> dict:
    spec["env"][RAM_BUDGET_ENV] = budget
    return spec


def _event(job: dict, type: str) -> dict:
    found = events(job, f"runner.{type}")
    assert len(found) == 1, (type, found, log(job)[-2000:])
    return found[0]


def _image(job: dict) -> bytes:
    return (run_dir(job) / "outputs" / "image_000.png").read_bytes()


def _entry_files(entry: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in entry.iterdir()}


@pytest.fixture(scope="module")
def low_ram_jobs(worker, tiny: dict[str, Path]) -> dict[str, dict]:
    """A train job, then an infer job, both with the job's RAM below the weights (one worker)."""
    with worker.client() as c:
        train = run_job(c, _low_ram(train_spec(tiny, "flux", steps=2, save_every=None)))
        assert train["status"] == "SUCCEEDED", log(train)[-3000:]
        entry = Path(_event(train, "shard_cache")["path"])
        before = _entry_files(entry)
        infer = run_job(c, _low_ram(infer_spec(tiny, "flux", prompt="a red square", steps=2)))
        assert infer["status"] == "SUCCEEDED", log(infer)[-3000:]
    return {"train": train, "infer": infer, "entry": entry, "files_before_infer": before}


def test_train_and_infer_stream_from_the_cached_shards_when_ram_is_short(low_ram_jobs: dict) -> None:
    train, infer = low_ram_jobs["train"], low_ram_jobs["infer"]
    for job in (train, infer):
        tier = _event(job, "host_store")
        assert tier["host_store"] == TIER_DISK and "do not fit" in tier["reason"]
        assert tier["ram_bytes"] == 64 * 1024 and tier["ram_source"] == f"${RAM_BUDGET_ENV}"
        assert tier["weight_bytes"] > tier["ram_bytes"] and tier["max_memory_bytes"] > 0
        assert tier["shard_dir"] == str(low_ram_jobs["entry"])
    rows = step_records(train)
    assert len(rows) == 2 and all(r["host_store"] == TIER_DISK for r in rows)
    infer_rows = [r for r in strict_lines(run_dir(infer) / "metrics.jsonl") if "step" in r and "phase" not in r]
    assert infer_rows and all(r["host_store"] == TIER_DISK and r["disk_gbps"] > 0 for r in infer_rows)
    # sharded once, by the first job; the second took the entry as it was
    first, second = _event(train, "shard_cache"), _event(infer, "shard_cache")
    assert first["result"] == "miss" and first["written_bytes"] > 0
    assert second["result"] == "hit" and second["written_bytes"] == 0 and second["path"] == first["path"]
    assert _entry_files(low_ram_jobs["entry"]) == low_ram_jobs["files_before_infer"]
    assert "sharding" in log(train) and "sharding" not in log(infer)
    marker = json.loads((low_ram_jobs["entry"] / MARKER).read_text())
    assert marker["key"] == low_ram_jobs["entry"].name


def test_the_disk_tier_renders_the_same_image_as_ram_and_lazy_load_false_keeps_ram(
        client, tiny: dict[str, Path], low_ram_jobs: dict) -> None:
    spec = _low_ram(infer_spec(tiny, "flux", prompt="a red square", steps=2))
    spec["offload"]["lazy_load"] = False  # what the user asked for, even on a small box
    arena = run_job(client, spec)
    assert arena["status"] == "SUCCEEDED", log(arena)[-3000:]
    tier = _event(arena, "host_store")
    assert tier["host_store"] == TIER_RAM and "offload.lazy_load: false" in tier["reason"]
    assert not events(arena, "runner.shard_cache")
    rows = [r for r in strict_lines(run_dir(arena) / "metrics.jsonl") if "step" in r and "phase" not in r]
    assert rows and rows[-1]["host_store"] in ("arena", "bounce")
    assert _image(arena) == _image(low_ram_jobs["infer"])


def test_an_entry_without_its_marker_is_sharded_again(client, tiny: dict[str, Path], low_ram_jobs: dict) -> None:
    entry = low_ram_jobs["entry"]
    # what a killed shard write could leave: the marker missing, a shard file cut short
    (entry / MARKER).unlink()
    block = next(p for p in entry.glob("*.safetensors") if p.name != "non_block.safetensors")
    os.truncate(block, block.stat().st_size // 2)
    job = run_job(client, _low_ram(infer_spec(tiny, "flux", prompt="a red square", steps=2)))
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    got = _event(job, "shard_cache")
    assert got["result"] == "miss" and got["removed_incomplete"] is True and got["written_bytes"] > 0
    assert (entry / MARKER).is_file() and block.stat().st_size > 0
    assert _image(job) == _image(low_ram_jobs["infer"])


def test_infer_with_the_trained_lora_on_the_disk_tier_runs_and_says_what_it_holds(
        client, tiny: dict[str, Path], low_ram_jobs: dict) -> None:
    job = run_job(client, _low_ram(infer_spec(tiny, "flux", prompt="a red square", steps=2,
                                              lora=low_ram_jobs["train"]["id"])))
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert _event(job, "host_store")["host_store"] == TIER_DISK and _event(job, "shard_cache")["result"] == "hit"
    assert "stay in RAM" in _event(job, "lora_on_disk_tier")["message"]
    assert _image(job) != _image(low_ram_jobs["infer"])  # the LoRA was applied
