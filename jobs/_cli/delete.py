"""`offload-jobs delete JOB...`: remove finished jobs: their record, history and run dir."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import print_json


def delete(
    jobs: Annotated[list[str], typer.Argument(help="Job ids, or unique prefixes of them.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print {\"deleted\": [ids]}.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete jobs with outputs without asking.")] = False,
) -> None:
    """Delete finished jobs for good: the job, its attempts and events, and its run dir with its outputs.

    A job that is still pending or running is refused; cancel it first. A job with files under
    outputs/ (a LoRA, samples) is deleted only after a yes on the terminal, or with --yes.
    """
    from jobs._cli.confirm import confirm_deletion, jobs_with_outputs
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    found = [resolve_job(client, ref) for ref in jobs]  # all found before any is deleted
    ids = list(dict.fromkeys(str(j["id"]) for j in found))
    confirm_deletion(found, jobs_with_outputs(client, found), yes)
    deleted = []
    for job_id in ids:
        deleted += client.delete(job_id)["deleted"]
    if json_out:
        print_json({"deleted": deleted})
    else:
        for job_id in deleted:
            typer.echo(f"{job_id} deleted")
