"""`offload-jobs shard SRC DST`: pre-shard a checkpoint into per-unit files, here and now.

Runs `offload_core.shard` in this process (no worker needed). To run it as a queued job
instead, submit a `kind: shard` spec.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from jobs._cli.output import CliError


def shard(
    src: Annotated[Path, typer.Argument(
        help="Diffusers folder (sharded safetensors + index) or single-file checkpoint.", show_default=False)],
    dst: Annotated[Path, typer.Argument(help="Output shard directory: new, empty, or one this tool wrote "
                                             "(written atomically; a rerun resumes).",
                                        show_default=False)],
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Convert to this dtype (bfloat16, float16, float8_e4m3fn).", show_default=False)] = None,
    fp8_scaling: Annotated[Optional[str], typer.Option(
        "--fp8-scaling", help="With --dtype float8_e4m3fn: tensor, row (default) or block (128x128 tiles) scales.",
        show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Write into a non-empty DST this tool did not write (its other files stay).")] = False,
    base: Annotated[Optional[Path], typer.Option(
        "--base", help="For a BFL/ComfyUI transformer file: a diffusers folder whose transformer/config.json "
                       "completes its config (needed only where the file cannot say, e.g. rotary axes of "
                       "non-128 heads).", show_default=False)] = None,
) -> None:
    """Convert a checkpoint into per-unit shards the engine streams from disk (lazy_load).

    A Flux transformer file in the BFL or ComfyUI layout is first converted to diffusers' names, a
    block at a time, into the model cache (reused by jobs), then sharded."""
    if fp8_scaling is not None and fp8_scaling not in ("tensor", "row", "block"):
        raise CliError(f"--fp8-scaling: {fp8_scaling!r} is not one of tensor, row, block")
    if fp8_scaling is not None and str(dtype).lower() not in ("float8_e4m3fn", "fp8"):
        raise CliError("--fp8-scaling: applies to --dtype float8_e4m3fn only")
    if not src.exists():
        raise CliError(f"{src}: no such file or directory")
    try:
        from offload_core.errors import OffloadError  # torch + safetensors: only for this verb
        from offload_core.shard import shard_checkpoint
    except ModuleNotFoundError as exc:  # a jobs-only install without the engine
        raise CliError(f"shard: needs the offload engine ({exc.name} is missing)") from None
    try:
        from jobs.home import model_cache, state_home
        from jobs.runners.convert import shard_source
        from jobs.runners.errors import RunnerInputError

        source = shard_source(src, base, model_cache(state_home()), say=lambda line: typer.echo(line, err=True))
        result = shard_checkpoint(str(source), str(dst), dtype=dtype, overwrite=overwrite, fp8_scaling=fp8_scaling)
    except RunnerInputError as exc:
        raise CliError(f"shard: {str(exc).replace('model.transformer: ', '', 1)}") from None
    except (OffloadError, PermissionError) as exc:
        raise CliError(f"shard: {exc}") from None
    typer.echo(f"sharded {src} -> {dst}: {result['units']} units in {result['files']} files, "
               f"{result['written']} written, {result['resumed']} resumed, {result['seconds']:.1f}s", err=True)
    typer.echo(result["index"])
