"""A GPU job on a worker without a GPU is refused at submit; a GPU torch cannot use is said out loud."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.errors import SpecError

REPO = Path(__file__).resolve().parents[2]
CPU_ONLY = {"OFFLOAD_JOBS_GPUS": "0"}  # no GPU, whatever NVML says on the machine running the test


def _model(tmp: Path) -> Path:
    (tmp / "flux").mkdir(exist_ok=True)
    (tmp / "flux" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    (tmp / "data").mkdir(exist_ok=True)
    return tmp


def _cli(w, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_URL=w.url, OFFLOAD_JOBS_TOKEN=w.token, OFFLOAD_JOBS_HOME=str(w.home))
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=60)


def test_a_gpu_job_on_a_cpu_only_worker_is_refused_at_submit(tmp_path: Path) -> None:
    from jobs_helpers import WorkerProcess

    base = _model(tmp_path)
    w = WorkerProcess(tmp_path / "home", env=CPU_ONLY).start()
    try:
        spec = {"kind": "train", "model": {"path": str(base / "flux")}, "train": {"dataset": str(base / "data")}}
        with w.client() as c:
            with pytest.raises(SpecError) as e:
                c.submit({**spec, "resources": {"gpus": 1}})
            assert e.value.field == "resources.gpus" and "this worker has no GPU" in str(e.value)
            with pytest.raises(SpecError) as e:
                c.submit({**spec, "offload": {"target_device": "cuda"}, "resources": {"gpus": 0}})
            assert e.value.field == "offload.target_device" and "has no GPU" in str(e.value)
            assert c.list() == []  # nothing half-made
            # the CPU default still runs (resources.gpus unset, target_device unset): accepted
            ok = c.submit({**spec, "retry": {"max_attempts": 1}})
            assert ok["status"] == "PENDING"
        f = tmp_path / "gpu.yaml"
        f.write_text(f"kind: infer\nmodel: {{path: {base / 'flux'}}}\ninfer: {{prompt: a fox}}\n"
                     "resources: {gpus: 1}\n")
        for verb in (["submit", str(f)], ["validate", "--strict", str(f)]):
            res = _cli(w, *verb)
            assert res.returncode == 2, res
            assert "resources.gpus" in res.stderr and "no GPU" in res.stderr and "Traceback" not in res.stderr
            assert res.stderr.count("\n") == 1
    finally:
        w.stop()


def test_validate_strict_refuses_a_checkpoint_file_and_a_non_diffusers_folder(tmp_path: Path) -> None:
    from jobs_helpers import WorkerProcess

    ckpt = tmp_path / "flux1-dev.safetensors"
    ckpt.write_bytes(b"\0" * 64)
    other = tmp_path / "sdxl"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    w = WorkerProcess(tmp_path / "home", env=CPU_ONLY).start()
    try:
        for path, words in ((ckpt, "is a single-file checkpoint"), (other, "supported families"),
                            (tmp_path, "has no model_index.json")):
            f = tmp_path / "spec.yaml"
            f.write_text(f"kind: infer\nmodel: {{path: {path}}}\ninfer: {{prompt: a fox}}\nresources: {{gpus: 0}}\n")
            assert _cli(w, "validate", str(f)).returncode == 0  # the spec alone is fine
            res = _cli(w, "validate", "--strict", str(f))
            assert res.returncode == 2 and "model.path" in res.stderr and words in res.stderr, res.stderr
            assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    finally:
        w.stop()


def test_a_gpu_torch_cannot_use_is_said_at_start_and_in_workers(tmp_path: Path) -> None:
    from jobs_helpers import WorkerProcess

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0000)'\n")
    smi.chmod(0o755)
    env = {"OFFLOAD_JOBS_NVIDIA_SMI": str(smi), "OFFLOAD_JOBS_TORCH_CUDA": ""}  # a driver, and a CPU torch
    w = WorkerProcess(tmp_path / "home", "--gpus", "1", env=env).start()
    try:
        res = _cli(w, "workers")
        assert res.returncode == 0 and "torch sees none: a CPU build" in res.stdout, res.stdout
        listed = json.loads(_cli(w, "workers", "--json").stdout)
        assert listed[0]["gpus"][0]["torch"] == "no CUDA"
    finally:
        w.stop()
    assert "nvidia-smi sees 1 GPU(s) but this worker's torch is a CPU build" in w.log.read_text()


def test_workers_lists_docker_only_where_it_can_run(tmp_path: Path) -> None:
    from jobs_helpers import WorkerProcess

    seen = {}
    for name, env in (("none", {"OFFLOAD_JOBS_DOCKER": "0", "DOCKER_HOST": ""}),
                      ("daemon", {"DOCKER_HOST": "unix:///run/elsewhere/docker.sock"})):
        w = WorkerProcess(tmp_path / name, env={**CPU_ONLY, **env}).start()
        try:
            seen[name] = json.loads(_cli(w, "workers", "--json").stdout)[0]["executors"]
        finally:
            w.stop()
    assert "docker" not in seen["none"] and seen["none"][0] == "process"
    assert "docker" in seen["daemon"]


def test_a_gpu_job_on_gpus_a_cpu_torch_cannot_use_is_refused_at_submit(tmp_path: Path) -> None:
    from jobs_helpers import WorkerProcess

    base = _model(tmp_path)
    w = WorkerProcess(tmp_path / "home", "--gpus", "1", env={"OFFLOAD_JOBS_TORCH_CUDA": ""}).start()
    try:
        spec = {"kind": "train", "model": {"path": str(base / "flux")}, "train": {"dataset": str(base / "data")}}
        with w.client() as c:
            for extra, field in (({"resources": {"gpus": 1}}, "resources.gpus"),
                                 ({"offload": {"target_device": "cuda:0"}}, "offload.target_device")):
                with pytest.raises(SpecError) as e:
                    c.submit({**spec, **extra})
                assert e.value.field == field and "torch is a CPU build" in str(e.value)
            # on the CPU, on purpose: fine
            c.submit({**spec, "resources": {"gpus": 0}, "offload": {"target_device": "cpu"}})
    finally:
        w.stop()
