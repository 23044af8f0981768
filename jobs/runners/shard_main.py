"""`python -m jobs.runners.shard_main RUN_DIR`: shard a checkpoint with offload_core.shard."""

from __future__ import annotations

import time
from pathlib import Path

from jobs.contract import Metric, Reason, StepMetrics
from jobs.runners._entry import fail, imports_without_gc, load_job, write_metrics


def main() -> None:
    spec, run_dir = load_job()
    with imports_without_gc():
        from offload_core.errors import OffloadError
        from offload_core.shard import shard_checkpoint

        from jobs.home import model_cache
        from jobs.runners.convert import shard_source
        from jobs.runners.errors import RunnerInputError

    print(f"sharding {spec.shard.src} -> {spec.shard.dst}" + (f" as {spec.shard.dtype}" if spec.shard.dtype else ""), flush=True)
    t0 = time.monotonic()

    def report(p: dict) -> None:
        # One metrics line and one log line per file written: progress the TUI and `logs` can show.
        write_metrics({**StepMetrics(step=p["files_done"], total_steps=p["files_total"]), **p})
        print(f"  {p['files_done']}/{p['files_total']} files", flush=True)

    try:  # a BFL/ComfyUI transformer file: converted into the model cache first (a block at a time)
        source = shard_source(Path(spec.shard.src), None, model_cache(run_dir.parent.parent))
        result = shard_checkpoint(str(source), spec.shard.dst, dtype=spec.shard.dtype, progress=False, callback=report,
                                  overwrite=spec.shard.overwrite, fp8_scaling=spec.shard.fp8_scaling)
    except RunnerInputError as exc:
        fail(Reason.SETUP_FAILED, str(exc).replace("model.transformer: ", "shard.src: ", 1))
    except MemoryError as exc:
        fail(Reason.HOST_OOM, f"out of host memory while sharding: {exc}", code=1)
    except OffloadError as exc:  # a missing or corrupt checkpoint, a full disk: the user's to fix
        fail(Reason.SETUP_FAILED, str(exc))
    write_metrics({"done": True, Metric.seconds: round(time.monotonic() - t0, 3)})
    print(f"done in {time.monotonic() - t0:.1f}s: {result['units']} units in {result['files']} files, "
          f"{result['written']} written, {result['resumed']} resumed; index {result['index']}", flush=True)


if __name__ == "__main__":
    main()
