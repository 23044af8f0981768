"""Shared start-up of the `python -m jobs.runners.<kind>_main RUN_DIR` entry points."""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from jobs.spec import JobSpec, load_spec

__all__ = ["load_job", "fail", "write_metrics", "imports_without_gc", "import_family", "exit_without_collecting"]


def load_job(argv: list[str] | None = None) -> tuple[JobSpec, Path]:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0] if args else os.environ["OFFLOAD_JOBS_RUN_DIR"])
    spec = load_spec(run_dir / "spec.yaml")
    hide_unused_packages(spec)
    atexit.register(exit_without_collecting)
    return spec, run_dir


def exit_without_collecting() -> None:
    """What `load_job` registers to run at exit: `gc.freeze()`, so the interpreter's own collections
    while it shuts down skip every object the job made.

    A job's child is about to end: nothing is left worth collecting, but the interpreter's shutdown
    runs full collections over every tracked object (the train runner unfreezes the ~700k objects of
    its libraries when its loop ends): about 1.5 s of CPU after a train job's last line on a CPU box
    (measured: a 2-step tiny train job's child 5.3 -> 3.8 s of CPU). The job's files are written and
    closed before (metrics and events are appended line by line; the LoRA, checkpoints and the exit
    report are written whole).
    """
    gc.freeze()


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


@contextmanager
def imports_without_gc() -> Iterator[None]:
    """Import the heavy libraries with the cycle collector off, then freeze what they made.

    Importing torch, diffusers, transformers and peft makes about 450k objects, and the collector
    rescans all of them every time its counters fill: about 1 s of a job's 5 s start on a CPU box
    (measured). None of it is garbage worth collecting. Frozen afterwards, those objects are
    skipped by every later collection too (free_host_memory's, the train loop's).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def import_family(family: str) -> None:
    """Import what a job of this family runs on: the libraries, quieted, its diffusers classes, the engine."""
    import offload_core  # noqa: F401
    import offload_core.disk  # noqa: F401

    from jobs.runners.families import get_adapter
    from jobs.runners.telemetry import quiet_libraries

    quiet_libraries()
    get_adapter(family).classes()


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
    """Append one metrics line (the shard runner's), whole, as the train and infer runners do
    (telemetry.append_line); NaN and Infinity are written as null (strict JSON)."""
    from jobs.runners.telemetry import append_line
    from jobs.strict_json import dumps

    path = os.environ.get("OFFLOAD_JOBS_METRICS")
    if path:
        append_line(path, dumps(record))
