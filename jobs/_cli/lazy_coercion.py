"""Keep typer's pydantic-backed option coercion off the fast path.

typer (0.2x) builds a pydantic TypeAdapter for every non-bool parameter the first time it
processes one, even when the option was not given and its value is None. Importing pydantic
for that costs ~80 ms, a third of the budget of `offload-jobs ps` (< 0.3 s). Here each
parameter's coercion is deferred until a value is actually given; then typer's own coercion
runs unchanged. If typer's internals change, this quietly does nothing (just slower).

A given value of a plain `str` or `Path` (or a list of them) with no constraints is taken as
click parsed it: pydantic would return the same value, after 180 ms of import (`submit FILE`,
`logs JOB` and `show JOB` stay fast).
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

__all__ = ["defer_coercion"]

_PATH_DEFAULTS = {"exists": False, "file_okay": True, "dir_okay": True, "writable": False, "readable": True,
                  "resolve_path": False, "allow_dash": False}


def _plain(annotation: Any) -> tuple[type, bool] | None:
    """(str or Path, is_list) for `str`, `Path`, `Optional[...]` and `list[...]` of them, else None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _plain(args[0]) if len(args) == 1 else None
    if origin is list:
        (inner,) = typing.get_args(annotation) or (None,)
        return (inner, True) if inner in (str, Path) else None
    return (annotation, False) if annotation in (str, Path) else None


def _fast(value: Any, param: Any) -> tuple[bool, Any]:
    """(True, coerced) when `value` needs no pydantic, else (False, None)."""
    desc = getattr(param, "type_descriptor", None)
    info = getattr(desc, "parameter_info", None)
    if desc is None or info is None or getattr(desc, "file_annotation", None) is not None:
        return False, None
    kind = _plain(desc.annotation)
    if kind is None or getattr(info, "parser", None) is not None or getattr(info, "click_type", None) is not None:
        return False, None
    cls, is_list = kind
    if cls is Path and any(getattr(info, k, d) != d for k, d in _PATH_DEFAULTS.items()):
        return False, None
    if is_list:
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            return False, None
        return True, [cls(v) for v in value]
    if not isinstance(value, str):
        return False, None
    return True, cls(value)


class _DeferredCoercion:
    """Stands in for typer's RuntimeParam until a value needs coercing."""

    __slots__ = ()

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return () if (param.multiple or param.nargs == -1) else None
        done, coerced = _fast(value, param)
        if done:
            return coerced
        param._runtime_param = None  # let typer build (and cache) the real one
        return param.get_runtime_param().coerce(value, param=param, ctx=ctx)


_DEFERRED = _DeferredCoercion()


def defer_coercion(command: Any, ctx: Any = None) -> Any:
    """Install deferred coercion on the typer parameters of `command` (and, given the context
    that parses it, on its help option, made lazily by click); returns `command`."""
    params = list(getattr(command, "params", ()))
    if ctx is not None and hasattr(command, "get_help_option"):
        params.append(command.get_help_option(ctx))
    for param in params:
        if getattr(param, "_runtime_param", False) is None and hasattr(param, "get_runtime_param"):
            param._runtime_param = _DEFERRED
    return command
