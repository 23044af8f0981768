"""`offload-jobs shard SRC DST`: pre-shard a checkpoint into per-unit files, here and now.

Runs `offload_core.shard` in this process (no worker needed). To run it as a queued job
instead, submit a `kind: shard` spec.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from jobs._cli.output import CliError

# The entry point, as the shard runner (jobs/runners/shard_main.py) also looks it up.
_ENTRY_NAMES = ("shard_checkpoint", "shard")


def shard(
    src: Annotated[Path, typer.Argument(
        help="Diffusers folder (sharded safetensors + index) or single-file checkpoint.", show_default=False)],
    dst: Annotated[Path, typer.Argument(help="Output shard directory (written atomically; a rerun resumes).",
                                        show_default=False)],
    dtype: Annotated[Optional[str], typer.Option(
        "--dtype", help="Convert to this dtype (bfloat16, float16, float8_e4m3fn).", show_default=False)] = None,
) -> None:
    """Convert a checkpoint into per-unit shards the engine streams from disk (lazy_load)."""
    if not src.exists():
        raise CliError(f"{src}: no such file or directory")
    entry = _shard_entry()
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        params = inspect.signature(entry).parameters
        if "dtype" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise CliError("--dtype: this build of offload_core.shard cannot convert dtypes")
        kwargs["dtype"] = dtype
    try:
        result = entry(str(src), str(dst), **kwargs)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        raise CliError(f"shard: {exc}") from None
    typer.echo(f"sharded {src} -> {dst}", err=True)
    if isinstance(result, (str, Path)):
        typer.echo(str(result))


def _shard_entry() -> Callable[..., Any]:
    try:
        import offload_core.shard as mod  # torch + safetensors: only for this verb
    except ModuleNotFoundError as exc:
        if exc.name not in ("offload_core.shard", "offload_core"):
            raise
        raise CliError("offload_core.shard is not available in this install yet; "
                       "the shard preprocessor ships with the offload engine") from None
    for name in _ENTRY_NAMES:
        fn = getattr(mod, name, None)
        if callable(fn) and not inspect.isclass(fn):
            return fn
    raise CliError("offload_core.shard has no shard_checkpoint(src, dst, dtype=...) function")
