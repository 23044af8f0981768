"""Asking before `delete` and `prune` remove a job that has outputs (a trained LoRA, samples).

A job with nothing under outputs/ goes without a question. One with outputs is deleted only after
a "y" on a terminal, or with `--yes`; where stdin is not a terminal (a script, a pipe, CI) there is
no one to ask, so the command refuses in one line rather than deleting or hanging.
"""

from __future__ import annotations

import sys
from typing import Any

import typer

from jobs._cli.output import CliError
from jobs.errors import JobsError

__all__ = ["jobs_with_outputs", "confirm_deletion"]

LISTED = 5  # jobs named in the question; the rest are counted


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover - the loop returns


def jobs_with_outputs(client: Any, jobs: list[dict[str, Any]]) -> dict[str, str]:
    """{job id: "3 files, 12.1 MB"} for the jobs whose outputs/ holds files (or cannot be listed)."""
    found: dict[str, str] = {}
    for job in jobs:
        job_id = str(job["id"])
        try:
            files = client.outputs(job_id)
        except JobsError:
            found[job_id] = "outputs not listed"  # unknown: ask as if it had some
            continue
        if files:
            found[job_id] = f"{len(files)} files, {_size(sum(int(f.get('size') or 0) for f in files))}"
    return found


def confirm_deletion(jobs: list[dict[str, Any]], with_outputs: dict[str, str], yes: bool) -> None:
    """Return when the jobs may be deleted; else refuse (no terminal) or stop (the answer was no)."""
    if yes or not with_outputs:
        return
    names = {str(j["id"]): j.get("name") or j.get("kind") or "?" for j in jobs}
    shown = list(with_outputs.items())[:LISTED]
    listing = "; ".join(f"{jid} ({names.get(jid, '?')}: {what})" for jid, what in shown)
    if len(with_outputs) > LISTED:
        listing += f"; and {len(with_outputs) - LISTED} more"
    if not sys.stdin.isatty():
        noun = "a job" if len(with_outputs) == 1 else f"{len(with_outputs)} jobs"
        raise CliError(f"not deleting {noun} with outputs without --yes (stdin is not a terminal to ask): {listing}")
    typer.echo(f"with outputs: {listing}", err=True)
    others = len(jobs) - len(with_outputs)
    question = f"Delete {len(jobs)} job(s)" + (f" ({others} without outputs)" if others else "") + \
        ", outputs and all?"
    if not typer.confirm(question, default=False, err=True):
        typer.echo("nothing deleted", err=True)
        raise typer.Exit(1)
