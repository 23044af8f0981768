"""`offload-jobs show JOB`: one job in detail."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import console, job_detail, job_summary, print_json


def show(
    job: Annotated[str, typer.Argument(help="Job id, or a unique prefix of one.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the job as a JSON object.")] = False,
) -> None:
    """Show one job: status and reason, attempt, times, exit code, run dir and latest metrics."""
    from jobs._cli.connect import connect, resolve_job

    data = resolve_job(connect(), job)
    if json_out:
        print_json(job_summary(data))
        return
    console().print(job_detail(data))
