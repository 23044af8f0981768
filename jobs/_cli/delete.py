"""`offload-jobs delete JOB...`: remove finished jobs: their record, history and run dir."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import print_json


def delete(
    jobs: Annotated[list[str], typer.Argument(help="Job ids, or unique prefixes of them.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print {\"deleted\": [ids]}.")] = False,
) -> None:
    """Delete finished jobs for good: the job, its attempts and events, and its run dir with its outputs.

    A job that is still pending or running is refused; cancel it first.
    """
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    ids = [str(resolve_job(client, ref)["id"]) for ref in jobs]  # all found before any is deleted
    deleted = []
    for job_id in ids:
        deleted += client.delete(job_id)["deleted"]
    if json_out:
        print_json({"deleted": deleted})
    else:
        for job_id in deleted:
            typer.echo(f"{job_id} deleted")
