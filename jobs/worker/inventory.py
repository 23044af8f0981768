"""Who this worker is and what it has: its id, host, GPUs (and their memory), executors.

The worker id names the worker in `ps`, in the store's attempts and in /v1/workers. It is kept in
the state dir (`worker_id`, made on the first start as `<hostname>-<6 hex>`), so a worker that
restarts on the same state dir is the same worker and adopts its own attempts; `--worker-id` or
$OFFLOAD_JOBS_WORKER_ID sets it.

GPUs come from NVML when it answers (name, memory), else from `--gpus N` / $OFFLOAD_JOBS_GPUS with
memory unknown, or as declared by `--gpu-vram 24GiB,8GiB` ($OFFLOAD_JOBS_GPU_VRAM), which also
says how many there are.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import secrets
import shutil
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jobs.errors import JobsError
from jobs.home import write_private

__all__ = ["Gpu", "WorkerIdentity", "worker_id_for", "detect_gpus", "gpu_usage", "parse_vram_list", "boot_id",
           "slurm_available", "docker_available", "torch_installed", "torch_cuda_build", "nvidia_smi_gpus", "torch_gpu_mismatch"]

ID_FILE = "worker_id"
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass
class Gpu:
    index: int
    name: str = "GPU"
    memory_total: int = 0  # bytes; 0 when unknown
    uuid: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "memory_total": self.memory_total, "uuid": self.uuid}


@dataclass
class WorkerIdentity:
    id: str
    host: str
    boot_id: str | None
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    pid: int = field(default_factory=os.getpid)


def worker_id_for(home: Path, explicit: str | None = None) -> str:
    """The worker id: `explicit`, $OFFLOAD_JOBS_WORKER_ID, the state dir's file, or a new one kept there."""
    wid = explicit or os.environ.get("OFFLOAD_JOBS_WORKER_ID")
    if wid:
        if not _ID.fullmatch(wid):
            raise JobsError(f"worker id {wid!r}: use up to 64 letters, digits, '.', '_' or '-'")
        return wid
    path = home / ID_FILE
    try:
        kept = path.read_text(encoding="utf-8").strip()
        if _ID.fullmatch(kept):
            return kept
    except OSError:
        pass
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0])[:50] or "worker"
    wid = f"{host}-{secrets.token_hex(3)}"
    write_private(path, wid + "\n")
    return wid


def boot_id() -> str | None:
    """This host's boot id: pids and monotonic clocks mean the same thing only within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def parse_vram_list(text: str) -> list[int]:
    """`24GiB,8GiB` -> bytes per GPU (the spec's size syntax)."""
    from jobs.spec import parse_bytes

    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            value = parse_bytes(item)
        except ValueError as exc:
            raise JobsError(f"--gpu-vram: {exc}") from None
        out.append(int(value))
    return out


def detect_gpus(count: int | None = None, vram: list[int] | None = None) -> list[Gpu]:
    """This worker's GPUs: declared (`vram`: one size each), counted (`count`), else NVML's.

    Says at start (a warning in the worker's log) when the driver sees GPUs that torch cannot use."""
    mismatch = torch_gpu_mismatch()
    if mismatch:
        logging.getLogger("offload_jobs.worker").warning(mismatch)
    if vram:
        return [Gpu(i, "GPU (declared)", v) for i, v in enumerate(vram)]
    nvml = _nvml_gpus()
    if count is None:
        env = os.environ.get("OFFLOAD_JOBS_GPUS")
        if env is not None and env.strip().isdigit():
            count = int(env)
    if count is None:
        return nvml
    if count <= len(nvml):
        return nvml[:count]
    return nvml + [Gpu(i) for i in range(len(nvml), count)]


def _nvml_gpus() -> list[Gpu]:
    if os.environ.get("OFFLOAD_JOBS_GPUS", "").strip() == "0":
        return []
    try:
        import pynvml  # nvidia-ml-py; absent or failing means no GPU

        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        gpus = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                uuid = pynvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            except Exception:
                uuid = None
            gpus.append(Gpu(i, name, int(mem.total), uuid))
        return gpus
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def gpu_usage(gpus: list[Gpu]) -> list[dict[str, Any]]:
    """Each GPU with its memory in use and utilization now (NVML), for /v1/workers.

    A GPU torch cannot use (a CPU build of torch) carries `torch: "no CUDA"` for `offload-jobs workers`."""
    out = [g.as_dict() for g in gpus]
    if gpus and torch_cuda_build() is None:
        for d in out:
            d["torch"] = "no CUDA"
    if not any(g.uuid for g in gpus):
        return out
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return out
    try:
        for d in out:
            try:
                h = pynvml.nvmlDeviceGetHandleByIndex(d["index"])
                d["memory_used"] = int(pynvml.nvmlDeviceGetMemoryInfo(h).used)
                d["utilization"] = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:
                continue
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


def slurm_available() -> bool:
    """Slurm's client commands are here (and not turned off with OFFLOAD_JOBS_SLURM=0)."""
    if os.environ.get("OFFLOAD_JOBS_SLURM", "").strip() == "0":
        return False
    return all(shutil.which(c) for c in ("sbatch", "squeue", "scancel", "scontrol"))


def docker_available() -> bool:
    """A Docker daemon's socket is here (or DOCKER_HOST names one) and the Docker SDK is installed.

    Checked without a round trip, at start: `workers` lists `docker` only where it could run."""
    if os.environ.get("OFFLOAD_JOBS_DOCKER", "").strip() == "0":
        return False
    if importlib.util.find_spec("docker") is None:
        return False
    if os.environ.get("DOCKER_HOST", "").strip():
        return True
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    sockets = ["/var/run/docker.sock", *([os.path.join(runtime, "docker.sock")] if runtime else [])]
    return any(os.path.exists(s) for s in sockets)


def torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def torch_cuda_build() -> str | None:
    """The CUDA version torch was built for ("12.8"), None for a CPU build or no torch.

    Read from torch/version.py without importing torch: the worker never imports it."""
    env = os.environ.get("OFFLOAD_JOBS_TORCH_CUDA")  # tests stand in for a build they do not have
    if env is not None:
        return env.strip() or None
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    version = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    try:
        text = version.read_text(encoding="utf-8")
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def nvidia_smi_gpus() -> int:
    """GPUs `nvidia-smi -L` lists (0 without the tool or a driver)."""
    exe = shutil.which(os.environ.get("OFFLOAD_JOBS_NVIDIA_SMI", "nvidia-smi"))
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def torch_gpu_mismatch() -> str | None:
    """A line when the driver sees GPUs but torch here is a CPU build (GPU jobs would fail or crawl)."""
    if torch_cuda_build() is not None or not torch_installed():
        return None
    seen = nvidia_smi_gpus()
    if not seen:
        return None
    return (f"nvidia-smi sees {seen} GPU(s) but this worker's torch is a CPU build: GPU jobs cannot use them; "
            "install the CUDA build of torch (scripts/quickstart.sh does) and restart the worker")
