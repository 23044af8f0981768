"""`offload-jobs retry JOB`: run a finished job again as a new attempt."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import job_summary, print_json
from jobs.contract import JobState


def retry(
    job: Annotated[str, typer.Argument(help="Job id, or a unique prefix of one.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the job as a JSON object.")] = False,
) -> None:
    """Retry a FAILED or CANCELLED job: it is queued again as a new attempt."""
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    job_id = str(resolve_job(client, job)["id"])
    data = client.retry(job_id)
    if json_out:
        print_json(job_summary(data))
    else:
        typer.echo(f"{data.get('id', job_id)} {data.get('status', JobState.PENDING)} (queued for a new attempt)")
