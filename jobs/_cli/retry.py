"""`offload-jobs retry JOB`: run a finished job again as a new attempt."""

from __future__ import annotations

from jobs._cli.connect import JobAsJson, JobRef, act_on_job
from jobs.contract import JobState


def retry(job: JobRef, json_out: JobAsJson = False) -> None:
    """Retry a FAILED or CANCELLED job: it is queued again as a new attempt."""
    act_on_job(job, lambda client, job_id: client.retry(job_id), json_out,
               lambda job_id, data: f"{data.get('id', job_id)} {data.get('status', JobState.PENDING)} (queued for a new attempt)")
