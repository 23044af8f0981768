"""`offload-jobs signal JOB save|sample|stop`: steer a running train job between steps."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from jobs._cli.connect import JobRef
from jobs._cli.output import print_json


class Action(str, enum.Enum):
    save = "save"
    sample = "sample"
    stop = "stop"


def signal(
    job: JobRef,
    action: Annotated[Action, typer.Argument(help="save: a checkpoint now; sample: render the sample prompts now; "
                                                   "stop: a checkpoint, the LoRA file, then exit.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print the worker's answer as JSON.")] = False,
) -> None:
    """Ask a running train job to save a checkpoint, render samples, or stop after a checkpoint.

    The job acts at the end of its current step; `offload-jobs logs -f JOB` shows when.
    """
    from jobs._cli.connect import connect, resolve_job

    client = connect()
    job_id = str(resolve_job(client, job)["id"])
    answer = client.signal(job_id, action.value)
    if json_out:
        print_json(answer)
    else:
        typer.echo(f"{job_id} {action.value}: sent; the job acts at the end of its current step")
