from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The files that take minutes (worker jobs, soak kills, bench runs) go first: `-n 4 --dist loadfile`
# hands files out in collection order, so a long file collected last would run alone at the end.
FIRST = ("tests/jobs/runners/test_single_file.py", "tests/jobs/runners/test_trainer_options.py",
         "tests/jobs/runners/test_resume_and_cache.py", "tests/jobs/test_exactly_once.py",
         "tests/jobs/test_submit_idempotent.py", "tests/jobs/runners/test_cosched.py",
         "tests/jobs/runners/test_offload_settings.py", "tests/jobs/runners/test_train_jobs.py",
         "tests/jobs/runners/test_ram_tier.py", "tests/jobs/runners/test_component_files.py",
         "tests/jobs/runners/test_hub_models.py", "tests/bench/test_bench_smoke.py",
         "tests/offload_core/test_optimizer_offload.py", "tests/jobs/runners/test_fp8_transformer_files.py",
         "tests/jobs/runners/test_fp8_shard_jobs.py", "tests/bench/test_bench_tiers.py")


def _heavy_first(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))  # stable: the rest keep their order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _heavy_first(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
