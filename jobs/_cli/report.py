"""`offload-jobs report JOB`: write one self-contained HTML file about a job (and --open it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from jobs._cli.connect import JobRef
from jobs._cli.output import CliError


def report(
    job: JobRef,
    output: Annotated[Optional[Path], typer.Option(
        "--output", "-o", help="Write here (default: report.html in the job's run dir).", show_default=False)] = None,
    open_it: Annotated[bool, typer.Option("--open", help="Open the file in a browser when written.")] = False,
) -> None:
    """Write a job's report: spec, timeline, loss/VRAM/GB/s/cache-hit charts, engine plan, samples.

    The file needs no network to view: the charts are inline SVG and the images data URIs.
    """
    import os

    from jobs._cli.connect import connect, resolve_job
    from tui.report import build_report

    client = connect()
    found = resolve_job(client, job)
    job_id = str(found["id"])
    text = build_report(client, job_id)
    path = output or default_path(found)
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


def default_path(job: dict[str, Any]) -> Path:
    """report.html in the job's run dir, beside its outputs; where that dir is not on this machine
    (a worker elsewhere) or not writable by this user (a worker of another uid), report-JOB.html
    here, and a line on stderr saying so."""
    import os

    run_dir = job.get("run_dir")
    if run_dir and Path(run_dir).is_dir() and os.access(run_dir, os.W_OK):
        return Path(run_dir) / "report.html"
    why = "is not writable by this user" if run_dir and Path(run_dir).is_dir() else "is not on this machine"
    here = Path(f"report-{job['id']}.html")
    typer.echo(f"job {job['id']}: its run dir {run_dir or '(none yet)'} {why}; writing ./{here} "
               "(-o PATH to choose)", err=True)
    return here