"""`offload-jobs prune --older-than 7d`: delete every job that finished before then."""

from __future__ import annotations

from typing import Annotated

import typer

from jobs._cli.output import CliError, print_json


def prune(
    older_than: Annotated[str, typer.Option(
        "--older-than", help="Delete jobs that finished more than this long ago: e.g. 7d, 12h, 90m.",
        show_default=False)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would go; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete jobs with outputs without asking.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print {\"deleted\": [ids], \"dry_run\": ...}.")] = False,
) -> None:
    """Delete finished jobs (SUCCEEDED, FAILED, CANCELLED) older than --older-than, with their run dirs.

    Pending and running jobs are never touched. Jobs with files under outputs/ (a LoRA, samples)
    are deleted only after a yes on the terminal, or with --yes.
    """
    import time

    from jobs._cli.connect import connect
    from jobs.spec import parse_duration

    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        raise CliError(f"--older-than: {exc}") from None
    if not isinstance(seconds, float):
        raise CliError(f"--older-than: not a duration: {older_than!r}")
    from jobs._cli.confirm import confirm_deletion, jobs_with_outputs

    client = connect()
    if dry_run:
        result = client.prune(seconds, dry_run=True)
    else:
        # What would go, asked about, then pruned at the same cutoff (however long the answer took):
        # a job that finished meanwhile is not deleted unasked.
        asked_at = time.monotonic()
        would = client.prune(seconds, dry_run=True)
        if not would["deleted"]:
            result = would
        else:
            confirm_deletion(would["jobs"], jobs_with_outputs(client, would["jobs"]), yes)
            result = client.prune(seconds + (time.monotonic() - asked_at), dry_run=False)
    if json_out:
        print_json({"deleted": result["deleted"], "dry_run": result["dry_run"]})
        return
    verb = "would delete" if dry_run else "deleted"
    for job in result.get("jobs", []):
        typer.echo(f"{job['id']} {verb} ({job.get('name') or job.get('kind')}, {job.get('status')})")
    typer.echo(f"{len(result['deleted'])} jobs {verb.split()[-1]}" + (" (dry run)" if dry_run else ""), err=True)
