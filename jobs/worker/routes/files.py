"""A job's run-dir files, read-only, for `logs`, the dashboard and `report`: output.log,
metrics.jsonl, events.jsonl and outputs/. Every read goes through RunDir's safe reader: a symlink,
FIFO, device or hard link planted by the job is a named 409 (RunDirError), never followed or
waited on. On a shared store logs and metrics come from what the running worker shipped."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from jobs.errors import RunDirError
from jobs.rundir import RunDir, utf8_safe_end
from jobs.store import TERMINAL
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

__all__ = ["router", "LOG_CHUNK", "MAX_OUTPUT_FILE"]

LOG_CHUNK = 1 << 20
MAX_OUTPUT_FILE = 64 << 20


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, home = ctx.store, ctx.home

    @router.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: str, offset: int = 0, limit: int | None = None) -> Response:
        job = store.get_job(job_id)  # the status first: if terminal now, the file is final
        limit = LOG_CHUNK if limit is None else max(0, min(limit, LOG_CHUNK))
        if store.shared:  # whichever host runs it shipped it here (its completion ships the last bytes)
            start, data, size = store.read_log(job["id"], offset, limit)
        else:
            rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
            start, data, size = rd.read_log(offset, limit)
        terminal = job["status"] in TERMINAL
        if not (terminal and start + len(data) == size):
            data = data[: utf8_safe_end(data)]
        nxt = start + len(data)
        return _json({"offset": start, "next_offset": nxt, "data": data.decode("utf-8", "replace"),
                      "eof": terminal and nxt >= size, "size": size, "status": job["status"]})

    @router.get("/v1/jobs/{job_id}/metrics")
    def job_metrics(job_id: str, offset: int = 0) -> Response:
        job = store.get_job(job_id)
        if store.shared:  # record numbers, not bytes: the store holds records
            records, nxt = store.metric_records(job["id"], max(0, offset))
        else:
            rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
            records, nxt = rd.read_metrics(max(0, offset), strict=True)
        return _json({"offset": offset, "next_offset": nxt, "records": records})

    @router.get("/v1/jobs/{job_id}/events")
    def job_events(job_id: str) -> Response:
        run_path, _ = _outputs_dir(ctx, job_id)
        return _json({"events": RunDir(run_path).read_events()})  # RunDirError: a named 409

    @router.get("/v1/jobs/{job_id}/outputs")
    def job_outputs(job_id: str) -> Response:
        _, outputs = _outputs_dir(ctx, job_id)
        return _json({"files": _list_outputs(outputs)})

    @router.get("/v1/jobs/{job_id}/outputs/{path:path}")
    def job_output_file(job_id: str, path: str) -> Response:
        run_path, _ = _outputs_dir(ctx, job_id)
        try:  # the safe reader: no link, FIFO, device or hard link, no file over the limit
            data = RunDir(run_path).read_file(f"outputs/{path.strip('/')}", MAX_OUTPUT_FILE)
        except FileNotFoundError:
            return _json({"error": f"no output file {path!r} in job {job_id}"}, 404)
        except IsADirectoryError:
            return _json({"error": f"{path} is a directory in job {job_id}'s outputs"}, 404)
        except RunDirError as exc:
            if "-byte limit" in str(exc):
                return _json({"error": str(exc), "too_large": True}, 413)
            raise
        return Response(data, media_type="application/octet-stream")

    return router


def _outputs_dir(ctx: WorkerContext, job_id: str) -> tuple[Path, Path]:
    job = ctx.store.get_job(job_id)
    rd = RunDir(job["run_dir"] or RunDir.for_job(ctx.home, job["id"]).path)
    return rd.path, rd.outputs_dir


def _list_outputs(outputs: Path, limit: int = 2000) -> list[dict[str, Any]]:
    files: list[dict[str, Any]] = []
    if outputs.is_symlink() or not outputs.is_dir():
        return files
    for root, dirs, names in os.walk(outputs, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for name in sorted(names):
            p = os.path.join(root, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:  # what the safe reader would refuse
                continue
            files.append({"path": os.path.relpath(p, outputs), "size": st.st_size, "mtime": st.st_mtime})
            if len(files) >= limit:
                return files
    return files
