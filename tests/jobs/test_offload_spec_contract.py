"""`offload:` in a job spec mirrors the engine's OffloadConfig: a key added to one and not the other
fails here instead of being silently unreachable from YAML."""

from __future__ import annotations

import dataclasses

from offload_core import OffloadConfig

from jobs.spec import OffloadSpec

# Engine keys a job spec does not take under `offload:`, and why.
NOT_IN_SPEC = {
    "debug_host_delay_ms": "test-only race shaker",
    "record_timings": "bench-only switch",
    "use_streams": "bench-only serial baseline",
    "gradient_accumulation_steps": "set by train.gradient_accumulation_steps",
}


def test_offload_spec_names_every_engine_key() -> None:
    config = {f.name for f in dataclasses.fields(OffloadConfig)}
    spec = set(OffloadSpec.model_fields)
    assert spec <= config, f"spec keys the engine does not know: {sorted(spec - config)}"
    assert config - spec == set(NOT_IN_SPEC), f"engine keys missing from the spec: {sorted(config - spec - set(NOT_IN_SPEC))}"


def test_every_spec_key_reaches_the_engine() -> None:
    values = {"target_device": "cpu", "vram_margin": "1GiB", "overlap_optimizer_step": False,
              "fused_cpu_optimizer": False, "split_threshold_mb": 8.0, "treat_as_inference": True, "prefetch": 3}
    cfg = OffloadConfig.from_overrides(**OffloadSpec(**values).engine_kwargs())
    assert cfg.vram_margin == 1 << 30 and cfg.prefetch == 3 and cfg.fused_cpu_optimizer is False
