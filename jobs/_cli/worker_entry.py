"""Running the core worker (`python -m jobs.worker`) inside this process, for `offload-jobs worker`."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

__all__ = ["run_worker_foreground"]


def run_worker_foreground(host: str, port: int, home: Path | None) -> None:
    """Hand this process to the worker's own entry point, with its documented flags."""
    argv = ["python -m jobs.worker", "--host", host, "--port", str(port)]
    if home is not None:
        argv += ["--home", str(home)]
    saved = sys.argv
    sys.argv = argv
    try:
        # The worker's `__main__` owns its flags, logging and signal handling; we only forward.
        runpy.run_module("jobs.worker", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved
