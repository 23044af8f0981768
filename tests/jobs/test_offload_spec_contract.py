"""`offload:` in a job spec mirrors the engine's OffloadConfig: a key added to one and not the other
fails here instead of being silently unreachable from YAML."""

from __future__ import annotations

import dataclasses

from offload_core import OffloadConfig

from jobs.spec import OffloadSpec

# Engine keys a job spec does not take under `offload:`, and why.
NOT_IN_SPEC = {
    "debug_host_delay_ms": "test-only race shaker",
    "debug_link_gbps": "bench-only: an emulated slower link (offload_core/link.py)",
    "record_timings": "bench-only switch",
    "timing_every": "bench-only switch (how often a settled engine times a step)",
    "use_streams": "bench-only serial baseline",
    "keep_narrow": "bench-only A/B: kept fp8 units held widened, as before (offload_core/engine.py keep_unit)",
    "gradient_accumulation_steps": "set by train.gradient_accumulation_steps",
    "accumulation_order": "set by train.accumulation_order",
    "weights": "set by the runners: model.path's transformer is read into the engine",
}
# Spec keys that are no engine key: the runner reads them (jobs.runners.load.offload_config).
RUNNER_ONLY = {"enabled": "false: no engine at all, the transformer stays resident"}


def test_offload_spec_names_every_engine_key() -> None:
    config = {f.name for f in dataclasses.fields(OffloadConfig)}
    spec = set(OffloadSpec.model_fields) - set(RUNNER_ONLY)
    assert spec <= config, f"spec keys the engine does not know: {sorted(spec - config)}"
    assert config - spec == set(NOT_IN_SPEC), f"engine keys missing from the spec: {sorted(config - spec - set(NOT_IN_SPEC))}"


def test_every_spec_key_reaches_the_engine() -> None:
    values = {"target_device": "cpu", "vram_margin": "1GiB", "overlap_optimizer_step": False,
              "fused_cpu_optimizer": False, "split_threshold_mb": 8.0, "treat_as_inference": True, "prefetch": 3,
              "lazy_load": True, "shard_dir": "/shards", "max_memory": "6GiB", "num_disk_workers": 4,
              "disk_cache_policy": "lru", "disk_verify": True, "disk_direct": False, "disk_stream_slots": 3,
              "weight_dtype": "float8_e4m3fn", "fp8_scaling": "tensor"}
    cfg = OffloadConfig.from_overrides(**OffloadSpec(**values).engine_kwargs())
    assert cfg.vram_margin == 1 << 30 and cfg.prefetch == 3 and cfg.fused_cpu_optimizer is False
    assert (cfg.lazy_load, cfg.max_memory, cfg.disk_cache_policy, cfg.disk_verify, cfg.disk_direct,
            cfg.disk_stream_slots) == (True, 6 << 30, "lru", True, False, 3)
    assert (cfg.weight_dtype, cfg.fp8_scaling, cfg.resolved_fp8_scaling) == ("float8_e4m3fn", "tensor", "tensor")
    ram = OffloadConfig.from_overrides(**OffloadSpec(weight_dtype="float8_e4m3fn", fp8_scaling="block").engine_kwargs())
    assert ram.resolved_fp8_scaling == "block"
    assert OffloadConfig(weight_dtype="float8_e4m3fn").resolved_fp8_scaling == "row"  # the default
    # from shards too (lazy_load then takes the scaling the shards hold)
    assert OffloadConfig(weight_dtype="float8_e4m3fn", lazy_load=True, shard_dir="/s").resolved_fp8_scaling == "row"
    # compile refuses split_threshold_mb (above), so it goes alone
    assert OffloadConfig.from_overrides(**OffloadSpec(compile=True).engine_kwargs()).compile is True
