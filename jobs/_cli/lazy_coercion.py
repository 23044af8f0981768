"""Keep typer's pydantic-backed option coercion off the fast path.

typer (0.2x) builds a pydantic TypeAdapter for every non-bool parameter the first time it
processes one, even when the option was not given and its value is None. Importing pydantic
for that costs ~80 ms, a third of the budget of `offload-jobs ps` (< 0.3 s). Here each
parameter's coercion is deferred until a value is actually given; then typer's own coercion
runs unchanged. If typer's internals change, this quietly does nothing (just slower).
"""

from __future__ import annotations

from typing import Any

__all__ = ["defer_coercion"]


class _DeferredCoercion:
    """Stands in for typer's RuntimeParam until a value needs coercing."""

    __slots__ = ()

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        if value is None:
            return () if (param.multiple or param.nargs == -1) else None
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
