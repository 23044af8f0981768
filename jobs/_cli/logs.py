"""`offload-jobs logs JOB`: print (or follow) a job's output log."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from jobs._cli.connect import JobRef
from jobs.contract import JobState


def logs(
    job: JobRef,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    tail: Annotated[Optional[int], typer.Option("--tail", "-n", min=0, help="Start with only the last N lines.",
                                                show_default=False)] = None,
) -> None:
    """Print a job's log. With -f, follow it until the job ends (Ctrl-C stops following only).

    A follower rides through a worker restart: it reconnects and resumes where it was.
    """
    from jobs._cli.connect import connect, resolve_job
    from jobs._cli.follow import follow_job, read_log, tail_lines
    from jobs.contract import TERMINAL

    client = connect()
    data = resolve_job(client, job)
    job_id = str(data["id"])
    text, offset = read_log(client, job_id, 0)
    if tail is not None:
        text = tail_lines(text, tail)
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()
    if not follow:
        return
    final = data  # read before the log, so a job that had ended then has nothing more to print
    if data.get("status") not in TERMINAL:
        try:
            final = follow_job(client, job_id, offset=offset, reconnect=connect)
        except KeyboardInterrupt:
            print(f"\noffload-jobs: stopped following job {job_id}; it keeps running.", file=sys.stderr, flush=True)
            raise typer.Exit(130) from None
    reason = f" ({final['reason']})" if final.get("reason") and final.get("status") != JobState.SUCCEEDED else ""
    print(f"offload-jobs: job {job_id} {final.get('status')}{reason}", file=sys.stderr, flush=True)
