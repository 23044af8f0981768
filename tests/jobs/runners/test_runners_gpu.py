"""The tiny train and infer jobs on CUDA, through a real worker, under a VRAM cap (`pytest -m gpu`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runner_helpers import events, infer_spec, log, run_dir, run_job, step_records, train_spec

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_worker(tmp_path_factory: pytest.TempPathFactory):
    from jobs_helpers import WorkerProcess

    import os

    os.environ["OFFLOAD_JOBS_GPUS"] = "1"  # the worker may lack nvidia-ml-py to count them
    try:
        w = WorkerProcess(tmp_path_factory.mktemp("gpu-worker") / "home").start()
    finally:
        os.environ.pop("OFFLOAD_JOBS_GPUS", None)
    yield w
    w.stop()


@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan"])
def test_train_and_infer_on_cuda(gpu_worker, tiny: dict[str, Path], family: str) -> None:
    client = gpu_worker.client()
    spec = train_spec(tiny, family, steps=10, sample_every=10, sample_prompts=["a red square --steps 2"])
    spec["offload"]["target_device"] = "cuda"
    spec["model"]["dtype"] = "bfloat16"
    spec["resources"] = {"gpus": 1}
    spec["env"]["OFFLOAD_JOBS_VRAM_CAP"] = "2GiB"
    job = run_job(client, spec)
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert events(job, "runner.cudnn_sdp_disabled") and events(job, "runner.vram_cap")[0]["bytes"] == 2 * 2**30
    steps = step_records(job)
    assert len(steps) == 10 and all(r["loss"] is not None for r in steps)
    assert 0 < steps[-1]["vram_peak_bytes"] <= 2 * 2**30 and steps[-1]["h2d_gbps"] > 0
    inf_spec = infer_spec(tiny, family, lora=job["id"])
    inf_spec["offload"]["target_device"] = "cuda"
    inf_spec["model"]["dtype"] = "bfloat16"
    inf_spec["resources"] = {"gpus": 1}
    inf_spec["env"]["OFFLOAD_JOBS_VRAM_CAP"] = "2GiB"
    inf = run_job(client, inf_spec)
    assert inf["status"] == "SUCCEEDED", log(inf)[-3000:]
    assert (run_dir(inf) / "outputs" / "contact_sheet.png").is_file()
    # forked from the warm process (which started no CUDA driver: a fork would not get a usable CUDA);
    # the first job may start cold if the warm process's imports take longer than an attempt waits
    assert inf["attempts"][-1]["handle"]["warm"] is True, gpu_worker.log.read_text()[-3000:]
