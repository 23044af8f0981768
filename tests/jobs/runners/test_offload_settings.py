"""One place for offload settings: `offload:` in a spec, mapped once to the engine's OffloadConfig.

The old train.* keys still run, with a deprecation line naming the new key, and give the same
losses as the new keys; resources.vram_budget reaches the engine when offload sets no budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import torch
from offload_core_test_models import inductor_reason
from runner_helpers import log, run_job, step_records, strict_lines, train_spec, run_dir

from jobs.spec import json_schema, parse_spec


def test_old_train_keys_run_with_a_deprecation_line_and_the_same_losses(client, tiny: dict[str, Path]) -> None:
    old = train_spec(tiny, "flux", steps=4, save_every=None, enable_optimizer_cpu_offload=True,
                     cpu_offload_split_threshold=1000.0)
    new = train_spec(tiny, "flux", steps=4, save_every=None)
    new["offload"].update(enable_optimizer_cpu_offload=True, split_threshold_mb=1000.0)
    first, second = client.submit(old), client.submit(new)
    got, want = client.wait(first["id"], timeout=240), client.wait(second["id"], timeout=240)
    assert got["status"] == want["status"] == "SUCCEEDED", log(got)[-2000:]
    text = log(got)
    assert "train.enable_optimizer_cpu_offload is deprecated" in text and "use offload.enable_optimizer_cpu_offload" in text
    assert "use offload.split_threshold_mb" in text
    assert "deprecated" not in log(want)
    # the old key really switched optimizer offload on: both runs are bitwise the same
    assert [r["loss"] for r in step_records(got)] == [r["loss"] for r in step_records(want)]


def test_model_offload_off_keeps_the_transformer_resident(client, tiny: dict[str, Path]) -> None:
    spec = train_spec(tiny, "flux", steps=2, save_every=None, enable_model_cpu_offload=False)
    job = run_job(client, spec)
    assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    assert "use offload.enabled" in log(job) and "engine off" in log(job)
    assert "h2d_bytes" not in step_records(job)[-1]  # no engine, no engine stats


def test_resources_vram_budget_reaches_the_engine(client, tiny: dict[str, Path]) -> None:
    spec = train_spec(tiny, "flux", steps=2, save_every=None)
    spec["resources"]["vram_budget"] = "1e9"  # the one parser takes what jobs' took
    job = run_job(client, spec)
    assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    load = next(r for r in strict_lines(run_dir(job) / "metrics.jsonl") if r.get("phase") == "load")
    assert load["vram_budget_bytes"] == 10**9
    spec["offload"]["vram_budget"] = "2GB"  # the offload section wins
    job = run_job(client, spec)
    load = next(r for r in strict_lines(run_dir(job) / "metrics.jsonl") if r.get("phase") == "load")
    assert load["vram_budget_bytes"] == 2 * 10**9


def test_schema_has_one_offload_section() -> None:
    schema = json_schema()
    offload_keys = {"enable_model_cpu_offload", "enable_optimizer_cpu_offload", "cpu_offload_split_threshold"}
    assert not offload_keys & set(schema["$defs"]["TrainSpec"]["properties"])
    assert {"enabled", "enable_optimizer_cpu_offload", "split_threshold_mb"} <= set(schema["$defs"]["OffloadSpec"]["properties"])
    sections = [name for name, d in schema["$defs"].items() if "split_threshold_mb" in d.get("properties", {})
                or "enable_optimizer_cpu_offload" in d.get("properties", {})]
    assert sections == ["OffloadSpec"]


def test_an_old_key_that_contradicts_the_new_one_names_both() -> None:
    import pytest

    from jobs.errors import SpecError

    with pytest.raises(SpecError) as e:
        parse_spec({"kind": "train", "model": {"path": "m"}, "train": {"enable_model_cpu_offload": True},
                    "offload": {"enabled": False}})
    assert e.value.field == "train.enable_model_cpu_offload" and "offload.enabled" in str(e.value)
    spec = parse_spec({"kind": "train", "model": {"path": "m"}, "train": {"enable_model_cpu_offload": False}})
    assert spec.offload.enabled is False
    assert spec.deprecations() == ["train.enable_model_cpu_offload is deprecated (read for one more release): "
                                   "use offload.enabled"]


def test_one_size_parser_for_the_engine_and_the_spec() -> None:
    import pytest

    import offload_core
    from jobs.spec import parse_bytes
    from offload_core.errors import OffloadConfigError

    for text, want in (("1e9", 10**9), ("7.5GiB", int(7.5 * 2**30)), ("512MB", 512 * 10**6), (4096, 4096)):
        assert offload_core.parse_bytes(text) == parse_bytes(text) == want
    assert offload_core.OffloadConfig(vram_budget="1e9").vram_budget == 10**9
    with pytest.raises(OffloadConfigError, match="vram_budget: is larger than 1 EiB"):
        offload_core.OffloadConfig(vram_budget="2e18")


def test_validate_prints_the_deprecation_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    spec = tmp_path / "old.yaml"
    spec.write_text("kind: train\nmodel:\n  path: /models/x\ntrain:\n  dataset: /data/x\n"
                    "  enable_optimizer_cpu_offload: true\n")
    env = {**os.environ, "OFFLOAD_JOBS_HOME": str(tmp_path / "home")}
    res = subprocess.run([sys.executable, "-m", "jobs.cli", "validate", str(spec)], capture_output=True, text=True,
                         env=env, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
    assert ("train.enable_optimizer_cpu_offload is deprecated (read for one more release): "
            "use offload.enable_optimizer_cpu_offload") in res.stderr


def test_fp8_storage_trains_and_saves_the_lora_as_usual(client, tiny: dict[str, Path]) -> None:
    """offload.weight_dtype float8_e4m3fn (row scales) reaches the engine: a quarter of the fp32 bytes
    cross per step, and the LoRA file holds the same dtype as a run without fp8 (never fp8)."""
    from safetensors import safe_open

    plain = train_spec(tiny, "flux", steps=3, save_every=None)
    fp8 = train_spec(tiny, "flux", steps=3, save_every=None)
    fp8["offload"].update(weight_dtype="float8_e4m3fn", fp8_scaling="row")
    jobs = [run_job(client, spec) for spec in (plain, fp8)]
    assert all(j["status"] == "SUCCEEDED" for j in jobs), log(jobs[1])[-2000:]
    bytes_per_run = [step_records(j)[-1]["h2d_bytes"] for j in jobs]
    assert 0 < bytes_per_run[1] < 0.5 * bytes_per_run[0], bytes_per_run
    dtypes = []
    for j in jobs:
        with safe_open(str(run_dir(j) / "outputs" / "lora.safetensors"), framework="pt") as f:
            dtypes.append({f.get_tensor(k).dtype for k in f.keys()})
    assert dtypes[0] == dtypes[1] == {torch.float32}, dtypes  # the runner's LoRA dtype, whatever the storage


def test_fp8_scaling_without_fp8_is_one_line_naming_the_field() -> None:
    import pytest

    from jobs.spec import SpecError

    with pytest.raises(SpecError, match=r"^offload\.fp8_scaling: applies to offload\.weight_dtype: float8_e4m3fn"):
        parse_spec({"kind": "train", "model": {"path": "/m"}, "offload": {"fp8_scaling": "row"}})
    with pytest.raises(SpecError, match=r"^offload\.weight_dtype: Input should be 'float8_e4m3fn'"):
        parse_spec({"kind": "infer", "model": {"path": "/m"}, "offload": {"weight_dtype": "fp8"}})


@pytest.mark.slow  # a cold inductor compile: minutes of CPU (pytest -m slow)
def test_compile_runs_the_job_with_compiled_blocks_and_forwards_the_counts(client, tiny: dict[str, Path]) -> None:
    """offload.compile reaches the engine: its blocks compile in the job's first step, and the counts
    are in every step row (the contract's names); a second job finds the graphs in the state dir's
    inductor cache."""
    import pytest

    from jobs.contract import Metric

    reason = inductor_reason()
    if reason is not None:
        pytest.skip(reason)
    spec = train_spec(tiny, "flux", steps=3, save_every=None)
    spec["offload"]["compile"] = True
    spec["limits"]["max_duration"] = "15m"  # a cold inductor cache on a loaded 2-core box took over 5 minutes
    job = run_job(client, spec, timeout=900)
    assert job["status"] == "SUCCEEDED", log(job)[-2000:]
    rows = step_records(job)
    assert rows[0][Metric.compile_graphs] >= 2 and rows[0][Metric.compile_seconds] > 0, rows[0]
    assert rows[-1][Metric.compile_graphs] >= rows[0][Metric.compile_graphs] and Metric.recompiles in rows[-1]
    assert rows[0][Metric.compile_cache_misses] > 0, rows[0]  # a fresh state dir: inductor compiled the graphs
    # the cache lives in the state dir, where a second job (a fresh process) finds every graph compiled
    home = Path(job["run_dir"]).parent.parent
    assert any((home / "cache" / "torch-compile").iterdir())
    again = run_job(client, spec, timeout=900)
    assert again["status"] == "SUCCEEDED", log(again)[-2000:]
    first = step_records(again)[0]
    assert first[Metric.compile_cache_hits] > 0 and first[Metric.compile_cache_misses] == 0, first


def test_compile_needs_whole_blocks_one_line_naming_the_field() -> None:
    import pytest

    from jobs.spec import SpecError

    for offload in ({"compile": True, "offload_granularity": "leaf"}, {"compile": True, "split_threshold_mb": 8}):
        with pytest.raises(SpecError, match=r"^offload\.compile: compiles whole blocks"):
            parse_spec({"kind": "train", "model": {"path": "/m"}, "offload": offload})
    assert parse_spec({"kind": "infer", "model": {"path": "/m"}, "offload": {"compile": True}}).offload.compile is True


@pytest.mark.slow  # a cold inductor compile: minutes of CPU (pytest -m slow)
def test_compile_without_the_engine_compiles_the_resident_blocks(tiny: dict[str, Path]) -> None:
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    loaded = load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, torch.device("cpu"), offload=None,
                              compile=True)
    blocks = [*loaded.model.transformer_blocks, *loaded.model.single_transformer_blocks]
    assert all("forward" in b.__dict__ for b in blocks) and loaded.stats()["compiled_blocks"] == len(blocks)
    loaded.compiler.remove()
    assert not any("forward" in b.__dict__ for b in blocks)
