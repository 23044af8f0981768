from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The files that take longest go first, longest first: `-n 4 --dist loadfile` hands files out in this
# order (pytest_configure turns off xdist's own reorder, which sends the files with the most tests
# first and left files of three minute-long tests for the end). Their summed durations in a
# `--durations=0` run of the README's command with Docker, Postgres and Slurm up and a cold inductor
# cache, 40 s and more; the rest keep their collection order. The serial part (three workers) takes the
# two longest files first, then those of one test, then test_store_rebuild: 149 s against 160 s in
# the same replay, where the longest file (test_two_workers, 133 s) bounds it.
FIRST = ("tests/jobs/cluster/test_two_workers.py", "tests/jobs/cluster/test_exactly_once_pg.py",
         "tests/jobs/cluster/test_network_cut.py",
         "tests/offload_core/test_compiled_blocks.py", "tests/containers/test_container_e2e.py",
         "tests/jobs/runners/test_cosched.py", "tests/jobs/runners/test_single_file.py",
         "tests/bench/test_bench_smoke.py", "tests/jobs/runners/test_trainer_options.py",
         "tests/tui/test_tui_live.py", "tests/jobs/test_submit_idempotent.py",
         "tests/jobs/runners/test_entry.py", "tests/offload_core/test_optimizer_offload.py",
         "tests/jobs/runners/test_resume_and_cache.py", "tests/tui/test_tui_robust.py",
         "tests/jobs/test_cli_e2e.py", "tests/jobs/test_no_silent_cpu.py",
         "tests/jobs/runners/test_offload_settings.py", "tests/jobs/runners/test_train_jobs.py",
         "tests/jobs/runners/test_hub_models.py", "tests/jobs/test_exactly_once.py",
         "tests/bench/test_bench_tiers.py", "tests/jobs/runners/test_ram_tier.py",
         "tests/jobs/cluster/test_slurm.py", "tests/jobs/runners/test_fp8_transformer_files.py",
         "tests/jobs/runners/test_bad_input_and_controls.py", "tests/jobs/test_contract_jobs.py",
         "tests/jobs/runners/test_fp8_shard_jobs.py", "tests/jobs/runners/test_lora_formats.py",
         "tests/jobs/test_recovery.py", "tests/jobs/runners/test_runtime_errors.py",
         "tests/jobs/runners/test_qwen_image_file.py", "tests/bench/test_bench_flux_dev.py",
         "tests/jobs/runners/test_loading.py", "tests/jobs/test_cli_papercuts.py",
         "tests/jobs/test_run_dir_attacks.py", "tests/jobs/runners/test_data_limits.py",
         "tests/jobs/test_cli_imports.py", "tests/jobs/test_bad_specs.py",
         "tests/jobs/cluster/test_secrets.py", "tests/jobs/test_pull.py", "tests/jobs/test_security.py",
         "tests/test_docs.py")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --loadscope-reorder (on by default)
        config.option.loadscopereorder = False


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
