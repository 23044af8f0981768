"""POST /v1/jobs/{id}/signal: `offload-jobs signal JOB save|sample|stop` for a running train job."""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jobs.contract import JobState
from jobs.errors import InvalidTransition, RunDirError, SpecError
from jobs.rundir import RunDir
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

__all__ = ["router", "SIGNAL_ACTIONS"]

SIGNAL_ACTIONS = ("save", "sample", "stop")  # what jobs.runners.controls obeys


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, home, ident = ctx.store, ctx.home, ctx.ident

    # ---- runner controls (issue 15): `offload-jobs signal JOB save|sample|stop` ---------------------
    # The smallest seam: one JSON line appended to the run dir's control.jsonl, which the train
    # runner reads between steps. The worker only checks that the job is running and the action known.
    @router.post("/v1/jobs/{job_id}/signal")
    async def signal_job(job_id: str, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        action = body.get("action") if isinstance(body, dict) else None
        if action not in SIGNAL_ACTIONS:
            raise SpecError("action", f"must be one of {', '.join(SIGNAL_ACTIONS)}, got {action!r}")
        job = await asyncio.to_thread(store.get_job, job_id)
        if job["kind"] != "train":
            raise InvalidTransition(f"job {job['id']} is a {job['kind']} job; only train jobs take signals")
        if job["status"] != JobState.RUNNING:
            raise InvalidTransition(f"job {job['id']} is {job['status']}; signals reach running jobs only")
        record = {"ts": time.time(), "action": action, "attempt": job.get("attempt")}
        if store.shared and job.get("worker_id") != ident.id:  # runs elsewhere: its worker delivers it
            await asyncio.to_thread(store.add_event, job["id"], "job.control",
                                    {**record, "worker_id": job.get("worker_id")})
        else:
            rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
            if not await asyncio.to_thread(rd.append_control, record):  # a planted FIFO or link: refused
                raise RunDirError(f"refusing {rd.path / 'control.jsonl'}: not a plain file of the run dir")
        return _json({"id": job["id"], "action": action, "status": job["status"], "attempt": job.get("attempt")}, 202)
    # ---- end of runner controls ---------------------------------------------------------------------

    return router
