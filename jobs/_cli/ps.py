"""`offload-jobs ps`: list jobs (active ones by default)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from jobs._cli.output import ACTIVE, TERMINAL, CliError, console, job_summary, jobs_table, print_json

STATUSES = sorted(ACTIVE | TERMINAL)


def ps(
    all_jobs: Annotated[bool, typer.Option("--all", "-a", help="Include finished jobs.")] = False,
    status: Annotated[Optional[str], typer.Option(
        "--status", "-s", help=f"Only jobs in this status ({', '.join(STATUSES)}).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", min=1, help="At most this many jobs.",
                                                 show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List jobs: pending and running ones, or every job with --all."""
    from jobs._cli.connect import connect

    wanted = status.strip().upper() if status else None
    if wanted is not None and wanted not in STATUSES:
        raise CliError(f"--status: unknown status {status!r}; choose one of {', '.join(STATUSES)}")
    jobs = connect().list(status=wanted)
    if wanted is None and not all_jobs:
        jobs = [j for j in jobs if j.get("status") in ACTIVE]
    elif wanted is not None:
        jobs = [j for j in jobs if j.get("status") == wanted]
    if limit is not None:
        jobs = jobs[:limit]
    if json_out:
        print_json([job_summary(j) for j in jobs])
        return
    if not jobs:
        hint = "" if all_jobs or wanted else " (finished jobs: offload-jobs ps --all)"
        typer.echo(f"no jobs{hint}")
        return
    console().print(jobs_table(jobs))
