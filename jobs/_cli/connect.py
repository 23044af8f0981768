"""Finding the worker and the job a user means: the client, job ids given as a unique prefix, and
the verbs that act on one job (`cancel`, `retry`) and print what the worker answered."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from jobs._cli.output import CliError, job_summary, print_json

if TYPE_CHECKING:
    from jobs.client import JobsClient

__all__ = ["JobRef", "JobAsJson", "connect", "resolve_job", "act_on_job"]

_ID_CHARS = re.compile(r"[A-Za-z0-9_.:-]+")

# The JOB argument of every verb that takes one, and the --json flag of those that print the job.
JobRef = Annotated[str, typer.Argument(help="Job id, or a unique prefix of one.", show_default=False)]
JobAsJson = Annotated[bool, typer.Option("--json", help="Print the job as a JSON object.")]


def connect() -> JobsClient:
    """A client for the worker named by OFFLOAD_JOBS_URL/TOKEN or the state dir."""
    from jobs.client import JobsClient  # httpx: loaded only by verbs that talk to the worker

    return JobsClient.from_env()


def resolve_job(client: JobsClient, ref: str) -> dict[str, Any]:
    """The job whose id is `ref`, or the only one whose id starts with `ref`."""
    from jobs.errors import JobNotFound

    ref = ref.strip()
    if not ref:
        raise CliError("a job id (or a unique prefix of one) is required")
    if not _ID_CHARS.fullmatch(ref):
        raise JobNotFound(ref)  # not an id at all; don't build a URL path out of it
    try:
        return client.get(ref)
    except JobNotFound:
        pass
    matches = [j for j in client.list() if str(j.get("id", "")).startswith(ref)]
    if not matches:
        raise JobNotFound(ref)
    if len(matches) > 1:
        shown = ", ".join(str(j["id"]) for j in matches[:5])
        more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
        raise CliError(f"job id prefix {ref!r} is ambiguous: it matches {shown}{more}")
    return client.get(str(matches[0]["id"]))


def act_on_job(ref: str, act: Callable[[JobsClient, str], dict[str, Any]], json_out: bool,
               line: Callable[[str, dict[str, Any]], str]) -> None:
    """Resolve `ref`, have the worker act on that job, then print the job it answered with: as JSON,
    or as the one `line(job_id, job)`."""
    client = connect()
    job_id = str(resolve_job(client, ref)["id"])
    data = act(client, job_id)
    if json_out:
        print_json(job_summary(data))
    else:
        typer.echo(line(job_id, data))
