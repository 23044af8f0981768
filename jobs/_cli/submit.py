"""`offload-jobs submit FILE`: submit (the worker validates), then stream the job's log until it ends."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from jobs._cli.output import print_json
from jobs._cli.specfile import SETS_HELP
from jobs.contract import JobState

if TYPE_CHECKING:
    from jobs.client import JobsClient


def submit(
    file: Annotated[Path, typer.Argument(help="Job spec (YAML).", show_default=False)],
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Print the job id and return at once.")] = False,
    sets: Annotated[Optional[list[str]], typer.Option("--set", help=SETS_HELP, metavar="KEY=VALUE")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output (with -d: {\"id\": ...}).")] = False,
    key: Annotated[Optional[str], typer.Option("--key", help="Idempotency key: a submit repeated with the same key "
                                                "returns the job the first one made (default: a fresh key).")] = None,
) -> None:
    """Submit a job and stream its log until it ends.

    Exits 0 when the job SUCCEEDED and 1 otherwise. Ctrl-C detaches (the job keeps running);
    re-attach with `offload-jobs logs -f JOB`.
    """
    client, job = submit_file(file, sets, key=key)
    job_id = str(job["id"])

    if detach:
        if json_out:
            print_json({"id": job_id, "name": job.get("name"), "status": job.get("status")})
        else:
            typer.echo(job_id)
        return

    again = " (already submitted with this key)" if job.get("existing") else ""
    print(f"offload-jobs: submitted job {job_id} ({job.get('name') or job.get('kind')}){again}", file=sys.stderr,
          flush=True)
    final = attach(client, job_id, job.get("name"), logs_to_stderr=json_out)
    if json_out:
        from jobs._cli.output import job_summary

        print_json(job_summary(final))
    raise typer.Exit(0 if final.get("status") == JobState.SUCCEEDED else 1)


def submit_file(file: Path, sets: list[str] | None, key: str | None = None) -> tuple[JobsClient, dict[str, Any]]:
    """Submit the spec in `file`; the worker validates it and errors point back into the file.

    With no worker to ask, the spec is validated here, so a bad spec still gets its field named.
    """
    from jobs._cli.connect import connect
    from jobs._cli.specfile import read_spec, read_spec_data
    from jobs.errors import SpecError, WorkerUnreachable
    from jobs.spec_yaml import check_tree, with_origin

    data, node = read_spec_data(file, sets)
    if not isinstance(data, dict):
        read_spec(file, sets)  # names what is wrong with it
    try:
        check_tree(data)  # what JSON cannot carry (NaN, huge ints) or no field can hold
        client = connect()
        job = client.submit(data, key=key)
    except SpecError as exc:
        from jobs._cli.validate import add_container_hint  # a host path sent to a worker in a container
        from jobs.home import state_home

        add_container_hint(exc, data, state_home())
        raise with_origin(exc, str(file), node, sets) from None
    except WorkerUnreachable:
        read_spec(file, sets)  # a bad spec is the first thing to fix
        raise
    return client, job


def attach(client: JobsClient, job_id: str, name: str | None, logs_to_stderr: bool = False) -> dict[str, Any]:
    """Stream until the job ends; Ctrl-C detaches and says how to come back."""
    from jobs._cli.connect import connect
    from jobs._cli.follow import ProgressLine, follow_job

    try:
        # With --json the log goes to stderr, where a live line would garble it.
        with ProgressLine(job_id, name, live=False if logs_to_stderr else None) as progress:
            final = follow_job(client, job_id, on_status=progress.update,
                               out=sys.stderr if logs_to_stderr else None, reconnect=connect)
    except KeyboardInterrupt:
        print(f"\noffload-jobs: detached from job {job_id}; it keeps running. "
              f"Re-attach with: offload-jobs logs -f {job_id}", file=sys.stderr, flush=True)
        raise typer.Exit(130) from None
    _print_outcome(final)
    return final


def _print_outcome(job: dict[str, Any]) -> None:
    status = job.get("status")
    detail = []
    if job.get("reason") and status != JobState.SUCCEEDED:
        detail.append(str(job["reason"]))
    if job.get("exit_code") not in (None, 0):
        detail.append(f"exit code {job['exit_code']}")
    suffix = f" ({', '.join(detail)})" if detail else ""
    print(f"offload-jobs: job {job.get('id')} {status}{suffix}", file=sys.stderr, flush=True)
