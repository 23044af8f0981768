"""Finding the worker and the job a user means: the client, and job ids given as a unique prefix."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from jobs._cli.output import CliError

if TYPE_CHECKING:
    from jobs.client import JobsClient

__all__ = ["connect", "resolve_job"]

_ID_CHARS = re.compile(r"[A-Za-z0-9_.:-]+")


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
