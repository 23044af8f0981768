"""`offload-jobs ps`: list jobs, the newest 50 active ones by default."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer

from jobs._cli.output import CliError, job_summary, jobs_text_table, print_json
from jobs.contract import ACTIVE, STATES

STATUSES = list(STATES)
PAGE = 50


def ps(
    all_jobs: Annotated[bool, typer.Option("--all", "-a", help="Every job, finished ones included, with no page limit.")] = False,
    status: Annotated[Optional[str], typer.Option(
        "--status", "-s", help=f"Only jobs in this status ({', '.join(STATUSES)}).", show_default=False)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", "-n", min=1, show_default=False,
                                                 help=f"At most this many jobs (default {PAGE}; none with --all).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List jobs, newest first: the active ones (pending, starting, running, cancelling), or every job with --all.

    The table shows the newest 50; --limit N shows more, --all shows every job. On a store several
    workers share, a WORKER column says which worker runs (or last ran) each job.
    """
    from jobs._cli.connect import connect

    wanted = status.strip().upper() if status else None
    if wanted is not None and wanted not in STATUSES:
        raise CliError(f"--status: unknown status {status!r}; choose one of {', '.join(STATUSES)}")
    if wanted is not None:
        statuses = [wanted]
    elif all_jobs:
        statuses = None
    else:
        statuses = [s for s in STATUSES if s in ACTIVE]
    page = limit if limit is not None else (None if all_jobs else PAGE)
    body = connect().jobs_page(",".join(statuses) if statuses else None, page, summary=True)
    jobs, total = body["jobs"], int(body.get("total", len(body["jobs"])))
    if statuses is not None:
        jobs = [j for j in jobs if j.get("status") in statuses]
    if json_out:
        print_json([job_summary(j) for j in jobs])
        return
    if not jobs:
        hint = "" if all_jobs or wanted else " (finished jobs: offload-jobs ps --all)"
        typer.echo(f"no jobs{hint}")
        return
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    typer.echo(jobs_text_table(jobs, color=color, worker=bool(body.get("shared"))))
    if total > len(jobs):
        what = "jobs" if all_jobs else (f"{wanted} jobs" if wanted else "active jobs")
        typer.echo(f"... the newest {len(jobs)} of {total} {what}; see more with --limit N"
                   + ("" if all_jobs else " or every job with --all"), err=True)
