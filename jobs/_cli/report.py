"""`offload-jobs report JOB`: write one self-contained HTML file about a job (and --open it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from jobs._cli.output import CliError


def report(
    job: Annotated[str, typer.Argument(help="Job id, or a unique prefix of one.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write here (default: report-JOB.html in this directory).", show_default=False)] = None,
    open_it: Annotated[bool, typer.Option("--open", help="Open the file in a browser when written.")] = False,
) -> None:
    """Write a job's report: spec, timeline, loss/VRAM/GB/s/cache-hit charts, engine plan, samples.

    The file needs no network to view: the charts are inline SVG and the images data URIs.
    """
    import os

    from jobs._cli.connect import connect, resolve_job
    from tui.report import build_report

    client = connect()
    job_id = str(resolve_job(client, job)["id"])
    text = build_report(client, job_id)
    path = output or Path(f"report-{job_id}.html")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CliError(f"{path}: cannot write: {exc.strerror or exc}") from None
    typer.echo(str(path))
    if open_it:
        import webbrowser

        if not webbrowser.open(path.resolve().as_uri()):
            typer.echo(f"no browser found; open {path} yourself", err=True)
