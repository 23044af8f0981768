"""`offload-jobs cancel JOB`: stop a job (SIGTERM to its process tree, SIGKILL after stop_grace)."""

from __future__ import annotations

from jobs._cli.connect import JobAsJson, JobRef, act_on_job
from jobs.contract import JobState


def cancel(job: JobRef, json_out: JobAsJson = False) -> None:
    """Cancel a pending or running job. Its whole process tree is stopped."""
    act_on_job(job, lambda client, job_id: client.cancel(job_id), json_out,
               lambda job_id, data: f"{job_id} {data.get('status', JobState.CANCELLING)}")
