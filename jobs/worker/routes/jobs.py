"""The job list and one job: show, delete, cancel, retry, prune (env values never leave: jobs.redact)."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jobs import strict_json
from jobs.errors import SpecError
from jobs.redact import redact_job
from jobs.spec import parse_spec
from jobs.store_rebuild import deleting
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json
from jobs.worker.routes.common import parse_body as _parse_body

__all__ = ["router", "LIST_LIMIT_MAX"]

log = logging.getLogger("offload_jobs.app")

LIST_LIMIT_MAX = 100_000


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, sched, home, ident = ctx.store, ctx.sched, ctx.home, ctx.ident

    @router.get("/v1/jobs")
    def list_jobs(status: str | None = None, limit: int | None = None, view: str = "full") -> Response:
        statuses = [s for s in status.split(",") if s] if status else None
        if limit is not None:
            limit = max(0, min(limit, LIST_LIMIT_MAX))
        text = store.list_jobs_json(statuses, limit, summary=view == "summary")
        if '"env"' in text:  # env values never leave the worker (the fast path stays for the rest)
            page = json.loads(text)
            page["jobs"] = [redact_job(j) for j in page.get("jobs") or []]
            text = strict_json.dumps(page)
        return Response(text, media_type="application/json")

    @router.get("/v1/jobs/{job_id}")
    def show(job_id: str) -> Response:
        job = store.get_job(job_id)
        job["attempts"] = store.attempts(job["id"])
        return _json(redact_job(job))

    @router.delete("/v1/jobs/{job_id}")
    def delete(job_id: str) -> Response:
        job_id = store.get_job(job_id)["id"]  # a prefix resolved first: the marker names the job
        with deleting(home, [job_id]):
            job = store.delete_job(job_id)
            _remove_run_dir(home, job, ident.id if store.shared else None)
        return _json({"deleted": [job["id"]]})
    @router.post("/v1/prune")
    async def prune(request: Request) -> Response:
        body = _parse_body(await request.body() or b"{}")
        older = body.get("older_than") if isinstance(body, dict) else None
        if not isinstance(older, (int, float)) or isinstance(older, bool) or older < 0:
            raise SpecError("older_than", "must be a number of seconds >= 0")
        dry = bool(body.get("dry_run"))
        cutoff = time.time() - float(older)
        if dry:
            gone = await asyncio.to_thread(store.prune, cutoff, dry_run=True)
        else:
            gone = await asyncio.to_thread(_prune, cutoff)
        return _json({"deleted": [j["id"] for j in gone], "dry_run": dry, "jobs": [redact_job(j) for j in gone]})

    @router.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str) -> Response:
        return _json(redact_job(sched.cancel(job_id)))

    @router.post("/v1/jobs/{job_id}/retry")
    def retry(job_id: str) -> Response:
        job = store.get_job(job_id)
        extra = parse_spec(job["spec"]).retry.max_attempts
        job = store.retry_job(job["id"], extra)
        sched.wake()
        return _json(redact_job(job))

    def _prune(cutoff: float) -> list[dict[str, Any]]:
        candidates = [j["id"] for j in store.prune(cutoff, dry_run=True)]
        with deleting(home, candidates):
            gone = store.prune(cutoff)
            for job in gone:
                _remove_run_dir(home, job, ident.id if store.shared else None)
        return gone

    return router


def _remove_run_dir(home: Path, job: dict[str, Any], me: str | None = None) -> None:
    """Remove a deleted job's run dir, and only if it is where the worker puts run dirs.

    On a shared store (`me` set) only this worker's: another host's run dir stays where it is.
    """
    if me is not None and job.get("worker_id") not in (me, None):
        return
    runs = (home / "runs").resolve()
    path = Path(job.get("run_dir") or runs / job["id"])
    if me is not None and not path.exists():
        return
    if path.parent.resolve() != runs or path.name != job["id"] or path.is_symlink():
        log.warning("not removing %s: not a run dir of %s", path, home)
        return
    shutil.rmtree(path, ignore_errors=True)  # rmtree never follows symlinks planted inside
