"""Running the core worker (`jobs.worker.main`) inside this process, for `offload-jobs worker`."""

from __future__ import annotations

from pathlib import Path

__all__ = ["run_worker_foreground"]


def run_worker_foreground(host: str, port: int, home: Path | None, *, max_cpu_jobs: int | None = None,
                          gpus: int | None = None, log_level: str | None = None, db: str | None = None,
                          worker_id: str | None = None, heartbeat_timeout: float | None = None,
                          gpu_vram: str | None = None, rebuild_store: bool = False) -> int:
    """Hand this process to the worker's own entry point with its documented flags; returns its exit code."""
    from jobs.worker.main import main  # fastapi + uvicorn + sqlalchemy: only for this verb

    argv = ["--host", host, "--port", str(port)]
    if home is not None:
        argv += ["--home", str(home)]
    if max_cpu_jobs is not None:
        argv += ["--max-cpu-jobs", str(max_cpu_jobs)]
    if gpus is not None:
        argv += ["--gpus", str(gpus)]
    if log_level is not None:
        argv += ["--log-level", log_level]
    for flag, value in (("--db", db), ("--worker-id", worker_id), ("--heartbeat-timeout", heartbeat_timeout),
                        ("--gpu-vram", gpu_vram)):
        if value is not None:
            argv += [flag, str(value)]
    if rebuild_store:
        argv.append("--rebuild-store")
    return main(argv) or 0
