"""Runtime input errors through the real worker: each ends with one line and a named reason.

    offload.target_device: cuda with a CPU torch      -> no_cuda
    a model file the job's uid cannot read            -> permission_denied (the file and the uid named)
    a corrupt model file                              -> setup_failed
None of them leaves only a traceback.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from jobs_helpers import WorkerProcess
from runner_helpers import log, train_spec
from worker_variants import NOBODY, NoDacWorker


def _one_line_with(job: dict, reason: str, *words: str) -> None:
    msg = job.get("message") or ""
    assert (job["status"], job["reason"]) == ("FAILED", reason), (job["reason"], msg, log(job)[-2000:])
    assert msg and "\n" not in msg.strip() and "Traceback" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)
    assert "Traceback" not in log(job), log(job)[-2000:]
    assert f"[offload-jobs] {reason}: " in log(job)  # the same line, in the job's log


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(_cuda(), reason="torch here can use CUDA: there is no no_cuda to provoke")
def test_target_cuda_on_a_cpu_torch_is_no_cuda(tiny: dict[str, Path], tmp_path: Path) -> None:
    # a worker that has a GPU (declared) and believes its torch a CUDA build (a driver too old for it,
    # say) while torch cannot use CUDA: the job finds out, and says so in one line
    w = WorkerProcess(tmp_path / "home", "--gpus", "1", env={"OFFLOAD_JOBS_TORCH_CUDA": "12.8"}).start()
    spec = train_spec(tiny, "flux", steps=2)
    spec["offload"]["target_device"] = "cuda"
    spec["resources"] = {"gpus": 1}
    try:
        with w.client() as c:
            job = c.wait(c.submit(spec)["id"], timeout=180)
    finally:
        w.stop()
    _one_line_with(job, "no_cuda", "offload.target_device: cuda", "install a CUDA build of torch")


def test_a_corrupt_model_file_is_setup_failed(client, tiny: dict[str, Path], tmp_path: Path) -> None:
    model = tmp_path / "flux"
    shutil.copytree(tiny["flux"], model)
    weights = model / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated mid-header
    spec = train_spec(tiny, "flux", steps=2)
    spec["model"]["path"] = str(model)
    job = client.wait(client.submit(spec)["id"], timeout=180)
    _one_line_with(job, "setup_failed")


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX permissions")
def test_a_model_file_the_uid_cannot_read_is_permission_denied(worker_factory, tiny: dict[str, Path],
                                                                tmp_path: Path) -> None:
    model = tmp_path / "flux"
    shutil.copytree(tiny["flux"], model)
    for p in [model, *model.rglob("*")]:  # the builder makes every file readable by all (issue 28)
        assert stat.S_IMODE(p.stat().st_mode) & 0o004, f"{p} is not world-readable"
    locked = model / "transformer" / "diffusion_pytorch_model.safetensors"
    os.chmod(locked, 0o600)  # what make_tiny_pipelines wrote before issue 28, owned by another uid
    spec = train_spec(tiny, "flux", steps=2)
    spec["model"]["path"] = str(model)
    if os.getuid() == 0:  # root reads anything: take that power away from the worker
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv")
        os.chown(locked, NOBODY, NOBODY)
        w = NoDacWorker(tmp_path / "home").start()
    else:
        w = worker_factory()
    try:
        with w.client() as c:
            job = c.wait(c.submit(spec)["id"], timeout=180)
    finally:
        w.stop()
    _one_line_with(job, "permission_denied", str(locked), f"uid {os.getuid()}")
