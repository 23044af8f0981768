"""`offload-jobs tui`: the Textual dashboard (the `tui` package), on the worker's client API."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def tui(
    url: Annotated[Optional[str], typer.Option(
        "--url", help="Worker URL (default $OFFLOAD_JOBS_URL, else the state dir's worker.json).",
        show_default=False)] = None,
    token: Annotated[Optional[str], typer.Option(
        "--token", help="Bearer token (default $OFFLOAD_JOBS_TOKEN, else the state dir's token file).",
        show_default=False)] = None,
    home: Annotated[Optional[Path], typer.Option(
        "--home", help="State dir (default $OFFLOAD_JOBS_HOME or ~/.offload-jobs).", show_default=False)] = None,
    read_only: Annotated[bool, typer.Option("--read-only", help="Watch only: no cancel, retry, signal or submit.")] = False,
    job: Annotated[Optional[str], typer.Option("--job", "-j", help="Open this job's detail screen.",
                                               show_default=False)] = None,
    logs: Annotated[bool, typer.Option("--logs", help="With --job: open its logs screen.")] = False,
    tail: Annotated[Optional[int], typer.Option("--tail", "-n", min=0, show_default=False,
                                                help="Logs screen: keep only the last N lines.")] = None,
) -> None:
    """Open the terminal dashboard: jobs, VRAM, pinned pool, cache hits, GB/s, loss and logs.

    Keys: / filter, Enter detail, l logs, c cancel, r retry, s save/sample, d delete, o sort, O reverse sort,
    n new job, ? help (every key of the screen), Esc back.
    """
    from tui.app import main

    main(url=url, token=token, home=str(home) if home else None, read_only=read_only, job=job, logs=logs, tail=tail)
