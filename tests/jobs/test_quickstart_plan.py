"""`scripts/quickstart.sh --plan`: a CUDA torch is kept, a GPU gets the CUDA build, only a CPU box the CPU pin.

Stand-ins: a `python` that answers as an installed torch would, and an `nvidia-smi` on PATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _exe(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _plan(tmp: Path, torch_line: str | None, smi: str | None) -> subprocess.CompletedProcess[str]:
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in ("awk", "sed", "grep", "head", "dirname"):  # the script's tools, without the host's nvidia-smi
        target = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (bindir / tool).unlink(missing_ok=True)
        (bindir / tool).symlink_to(target)
    if smi is not None:
        _exe(bindir / "nvidia-smi", smi)
    py = _exe(tmp / "venv-python", f"echo '{torch_line}'\n" if torch_line else "exit 1\n")
    env = {"PATH": str(bindir), "HOME": str(tmp), "OFFLOAD_QUICKSTART_PYTHON": str(py)}
    return subprocess.run(["/bin/bash", "scripts/quickstart.sh", "--plan"], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=30)


SMI = ('[ "$1" = "-L" ] && { echo "GPU 0: NVIDIA H200 (UUID: GPU-1)"; exit 0; }\n'
       'echo "| NVIDIA-SMI 570.86   Driver Version: 570.86   CUDA Version: 12.8 |"\n')


def test_a_cuda_torch_already_installed_is_kept(tmp_path: Path) -> None:
    res = _plan(tmp_path, "2.7.0+cu128 12.8", SMI)
    assert res.returncode == 0, res.stderr
    assert "keep torch 2.7.0+cu128 (CUDA 12.8)" in res.stderr and "without the CPU pin" in res.stderr
    assert "2.13.0" not in res.stderr


def test_a_gpu_without_torch_gets_the_cuda_build(tmp_path: Path) -> None:
    res = _plan(tmp_path, None, SMI)
    assert res.returncode == 0, res.stderr
    assert "driver CUDA 12.8" in res.stderr and "download.pytorch.org/whl/cu128" in res.stderr
    assert "2.13.0" not in res.stderr
    # a CPU torch on a GPU box is replaced by the CUDA build too
    res = _plan(tmp_path, "2.13.0 ", SMI)
    assert "install the CUDA build of torch" in res.stderr


def test_only_a_box_without_a_gpu_gets_the_cpu_pin(tmp_path: Path) -> None:
    res = _plan(tmp_path, None, None)
    assert res.returncode == 0, res.stderr
    assert "no GPU" in res.stderr and "torch==2.13.0 on the CPU" in res.stderr
    # an nvidia-smi that lists no GPU (a driver without a card) is no GPU either
    res = _plan(tmp_path, None, 'exit 9\n')
    assert "no GPU" in res.stderr
