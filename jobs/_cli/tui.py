"""`offload-jobs tui`: the Textual dashboard, once the `tui` package ships one."""

from __future__ import annotations

from typing import Annotated, Any, Callable

import typer

from jobs._cli.output import CliError


def tui(
    read_only: Annotated[bool, typer.Option("--read-only", help="Watch only: no cancel or retry keys.")] = False,
) -> None:
    """Open the terminal dashboard: jobs, VRAM, pinned pool, cache hits, GB/s, loss and logs."""
    launch = _find_tui()
    if launch is None:
        raise CliError("the TUI is not built yet; meanwhile use `offload-jobs ps` and `offload-jobs logs -f JOB`")
    launch(read_only=read_only)


def _find_tui() -> Callable[..., Any] | None:
    import importlib
    import inspect

    try:
        mod = importlib.import_module("tui.app")
    except ModuleNotFoundError as exc:
        if exc.name in ("tui", "tui.app"):
            return None
        raise
    main = getattr(mod, "main", None) or getattr(mod, "run", None)
    if callable(main):
        takes_read_only = "read_only" in inspect.signature(main).parameters
        return (lambda read_only: main(read_only=read_only)) if takes_read_only else (lambda read_only: main())
    app = getattr(mod, "app", None)
    if app is not None and hasattr(app, "run"):
        return lambda read_only: app.run()
    # Else the first Textual-style App class the module defines.
    for value in vars(mod).values():
        if inspect.isclass(value) and value.__module__ == mod.__name__ and value.__name__.endswith("App") \
                and hasattr(value, "run"):
            takes_read_only = "read_only" in inspect.signature(value).parameters
            return lambda read_only, cls=value: (cls(read_only=read_only) if takes_read_only else cls()).run()
    return None
