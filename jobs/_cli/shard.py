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
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Write into a non-empty DST this tool did not write (its other files stay).")] = False,
) -> None:
    """Convert a checkpoint into per-unit shards the engine streams from disk (lazy_load)."""
    if not src.exists():
        raise CliError(f"{src}: no such file or directory")
    try:
        from offload_core.errors import OffloadError  # torch + safetensors: only for this verb
        from offload_core.shard import shard_checkpoint
    except ModuleNotFoundError as exc:  # a jobs-only install without the engine
        raise CliError(f"shard: needs the offload engine ({exc.name} is missing)") from None
    try:
        result = shard_checkpoint(str(src), str(dst), dtype=dtype, overwrite=overwrite)
    except (OffloadError, PermissionError) as exc:
        raise CliError(f"shard: {exc}") from None
    typer.echo(f"sharded {src} -> {dst}: {result['units']} units in {result['files']} files, "
               f"{result['written']} written, {result['resumed']} resumed, {result['seconds']:.1f}s", err=True)
    typer.echo(result["index"])
