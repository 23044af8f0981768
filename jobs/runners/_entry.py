"""Shared start-up of the `python -m jobs.runners.<kind>_main RUN_DIR` entry points."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from jobs.spec import JobSpec, load_spec

__all__ = ["load_job", "fail", "write_metrics"]


def load_job(argv: list[str] | None = None) -> tuple[JobSpec, Path]:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0] if args else os.environ["OFFLOAD_JOBS_RUN_DIR"])
    spec = load_spec(run_dir / "spec.yaml")
    hide_unused_packages(spec)
    return spec, run_dir


def hide_unused_packages(spec: JobSpec) -> None:
    """Keep bitsandbytes out of a job that does not train with adamw8bit.

    peft and diffusers import bitsandbytes as soon as it is installed, and its import pulls in
    torch._dynamo and asks the model hub for a CPU kernel (the "kernels-community ... trust" line in
    job logs): about 2 s of CPU and a network lookup at every job start, for a package only the
    adamw8bit optimizer uses. A None entry in sys.modules makes `importlib.util.find_spec` answer
    None, so the libraries take it as not installed.
    """
    train = getattr(spec, "train", None)
    if getattr(train, "optimizer", None) != "adamw8bit" and "bitsandbytes" not in sys.modules:
        sys.modules["bitsandbytes"] = None  # type: ignore[assignment]


def fail(reason: str, message: str, code: int = 2) -> NoReturn:
    """Write the report the worker reads (reason setup_failed, cuda_oom, ...) and exit."""
    path = os.environ.get("OFFLOAD_JOBS_EXIT_REPORT")
    if path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps({"reason": reason, "message": message[:2000]}, allow_nan=False))
        os.replace(tmp, path)
    print(f"[offload-jobs] {reason}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def write_metrics(record: dict[str, Any]) -> None:
    """Append one metrics line; NaN and Infinity are written as null (strict JSON)."""
    from jobs.strict_json import dumps

    path = os.environ.get("OFFLOAD_JOBS_METRICS")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(dumps(record) + "\n")
