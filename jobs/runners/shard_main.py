"""`python -m jobs.runners.shard_main RUN_DIR`: shard a checkpoint with offload_core.shard."""

from __future__ import annotations

import importlib
import inspect
import time

from jobs.runners._entry import fail, load_job, write_metrics


def main() -> None:
    spec, run_dir = load_job()
    try:
        shard = importlib.import_module("offload_core.shard")
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == "offload_core.shard" or exc.name == "offload_core"):
            fail("setup_failed", "offload_core.shard is not available in this install yet; the shard runner needs it")
        raise
    fn = getattr(shard, "shard_checkpoint", None) or getattr(shard, "shard", None)
    if not callable(fn):
        fail("setup_failed", "offload_core.shard has no shard_checkpoint(src, dst, dtype=...) function")
    print(f"sharding {spec.shard.src} -> {spec.shard.dst}" + (f" as {spec.shard.dtype}" if spec.shard.dtype else ""), flush=True)
    t0 = time.monotonic()
    kwargs = {}
    if spec.shard.dtype and "dtype" in inspect.signature(fn).parameters:
        kwargs["dtype"] = spec.shard.dtype
    try:
        result = fn(spec.shard.src, spec.shard.dst, **kwargs)
    except MemoryError as exc:
        fail("host_oom", f"out of host memory while sharding: {exc}", code=1)
    except (FileNotFoundError, NotADirectoryError) as exc:
        fail("setup_failed", f"{exc}")
    write_metrics({"step": 1, "seconds": round(time.monotonic() - t0, 3), "done": True})
    print(f"done in {time.monotonic() - t0:.1f}s" + (f": {result}" if result is not None else ""), flush=True)


if __name__ == "__main__":
    main()
