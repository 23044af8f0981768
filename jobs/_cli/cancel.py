"""`offload-jobs cancel JOB`: stop a job (SIGTERM to its process tree, SIGKILL after stop_grace)."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import job_summary, print_json
from jobs.contract import JobState


def cancel(
    job: Annotated[str, typer.Argument(help="Job id, or a unique prefix of one.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the job as a JSON object.")] = False,
) -> None:
    """Cancel a pending or running job. Its whole process tree is stopped."""
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    job_id = str(resolve_job(client, job)["id"])
    data = client.cancel(job_id)
    if json_out:
        print_json(job_summary(data))
    else:
        typer.echo(f"{job_id} {data.get('status', JobState.CANCELLING)}")
