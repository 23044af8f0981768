"""The worker's FastAPI app: the /v1 JSON API, server-sent events, /metrics and /healthz.

`create_app` wires the store, scheduler, auth and metrics; the lifespan recovers lost attempts
and runs the scheduler. Handlers are sync (run in the thread pool) except the event stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse

import jobs
from jobs.errors import InvalidTransition, JobNotFound, SpecError
from jobs.home import ensure_token
from jobs.rundir import RunDir, utf8_safe_end
from jobs.spec import parse_spec
from jobs.store import TERMINAL, JobStore
from jobs.worker.auth import AuthMiddleware, allowed_hosts
from jobs.worker.metrics import TimingMiddleware, WorkerMetrics
from jobs.worker.scheduler import Scheduler

__all__ = ["create_app", "EventBus"]

LOG_CHUNK = 1 << 20
SIGNAL_ACTIONS = ("save", "sample", "stop")  # what jobs.runners.controls obeys
KEEPALIVE_S = 15.0


def _json(obj: Any, status: int = 200) -> Response:
    # json.dumps directly: jsonable_encoder costs ~10x on a 1,000-job list.
    return Response(json.dumps(obj, separators=(",", ":")), status_code=status, media_type="application/json")


class EventBus:
    """Wakes event-stream handlers (on the event loop) when any thread writes an event."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.stopping = threading.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._event = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        assert self._event is not None
        return self._event

    def notify(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if self._event is not None:
            ev, self._event = self._event, asyncio.Event()
            ev.set()


def create_app(home: str | os.PathLike[str], *, host: str = "127.0.0.1", token: str | None = None,
               max_cpu_jobs: int = 4, gpu_count: int | None = None, extra_hosts: Iterable[str] = (),
               tick: float = 0.1) -> FastAPI:
    home = Path(home).expanduser()
    home.mkdir(parents=True, exist_ok=True)
    token = token or ensure_token(home)
    bus = EventBus()
    store = JobStore(home / "jobs.db")
    if gpu_count is None:
        gpu_count = _detect_gpus()

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("job_id"):
            rd = RunDir.for_job(home, ev["job_id"])
            if rd.path.exists():
                rd.append_event({k: v for k, v in ev.items() if k != "job_id"})
        bus.notify()

    store.on_event = on_event
    sched = Scheduler(store, home, gpu_count=gpu_count, max_cpu_jobs=max_cpu_jobs, tick=tick)
    metrics = WorkerMetrics(store.counts, lambda: len(sched.running))
    sched.on_finish = metrics.on_finish
    sched.on_start = lambda job: metrics.queue_wait.observe(max(0.0, time.time() - job["created_at"]))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bus.bind(asyncio.get_running_loop())
        sched.recover()
        sched.start()
        try:
            yield
        finally:
            bus.stopping.set()
            bus.notify()
            await asyncio.to_thread(sched.stop)
            store.close()

    app = FastAPI(title="offload-jobs worker", version=jobs.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.store, app.state.scheduler, app.state.bus, app.state.home = store, sched, bus, home

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound) -> Response:
        return _json({"error": str(exc), "job_id": exc.job_id}, 404)

    @app.exception_handler(InvalidTransition)
    async def _conflict(_: Request, exc: InvalidTransition) -> Response:
        return _json({"error": str(exc)}, 409)

    @app.exception_handler(SpecError)
    async def _bad_spec(_: Request, exc: SpecError) -> Response:
        return _json({"error": str(exc), "message": exc.message, "field": exc.field, "line": exc.line}, 400)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())[1:])
        return _json({"error": f"{field}: {err.get('msg')}", "param": field}, 400)

    @app.get("/healthz")
    def healthz() -> Response:
        return _json({"ok": True, "version": jobs.__version__, "pid": os.getpid()})

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/jobs")
    async def submit(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise SpecError(None, "request body must be JSON: {\"spec\": {...}}") from None
        raw = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(raw, dict):
            raise SpecError(None, "request body must be {\"spec\": {...}}")
        spec = parse_spec(raw)
        if spec.gpus > sched.gpu_slots:
            raise SpecError("resources.gpus", f"asks for {spec.gpus} GPUs; this worker has {sched.gpu_slots}")
        data = spec.model_dump(mode="json", exclude_unset=True)

        def create() -> dict[str, Any]:
            job_id = store.new_id()
            rd = RunDir.for_job(home, job_id).create(data)  # first, so events.jsonl sees job.created
            return store.create_job(
                data, kind=spec.kind, name=spec.display_name(), priority=spec.priority, gpus=spec.gpus,
                max_attempts=spec.retry.max_attempts, run_dir_for=lambda _: str(rd.path), job_id=job_id)

        job = await asyncio.to_thread(create)
        sched.wake()
        metrics.submitted.labels(spec.kind).inc()
        return _json(job, 201)

    @app.get("/v1/jobs")
    def list_jobs(status: str | None = None, limit: int | None = None) -> Response:
        statuses = [s for s in status.split(",") if s] if status else None
        return Response(store.list_jobs_json(statuses, limit), media_type="application/json")

    @app.get("/v1/jobs/{job_id}")
    def show(job_id: str) -> Response:
        job = store.get_job(job_id)
        job["attempts"] = store.attempts(job["id"])
        return _json(job)

    @app.post("/v1/jobs/{job_id}/cancel")
    def cancel(job_id: str) -> Response:
        return _json(sched.cancel(job_id))

    @app.post("/v1/jobs/{job_id}/retry")
    def retry(job_id: str) -> Response:
        job = store.get_job(job_id)
        extra = parse_spec(job["spec"]).retry.max_attempts
        job = store.retry_job(job["id"], extra)
        sched.wake()
        return _json(job)

    # ---- runner controls (issue 15): `offload-jobs signal JOB save|sample|stop` ---------------------
    # The smallest seam: one JSON line appended to the run dir's control.jsonl, which the train
    # runner reads between steps. The worker only checks that the job is running and the action known.
    @app.post("/v1/jobs/{job_id}/signal")
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
        if job["status"] != "RUNNING":
            raise InvalidTransition(f"job {job['id']} is {job['status']}; signals reach running jobs only")
        rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
        record = {"ts": time.time(), "action": action, "attempt": job.get("attempt")}
        with open(rd.path / "control.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return _json({"id": job["id"], "action": action, "status": job["status"], "attempt": job.get("attempt")}, 202)
    # ---- end of runner controls ---------------------------------------------------------------------

    @app.get("/v1/jobs/{job_id}/logs")
    def logs(job_id: str, offset: int = 0, limit: int | None = None) -> Response:
        job = store.get_job(job_id)  # the status first: if terminal now, the file is final
        rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
        limit = LOG_CHUNK if limit is None else max(0, min(limit, LOG_CHUNK))
        start, data, size = rd.read_log(offset, limit)
        terminal = job["status"] in TERMINAL
        if not (terminal and start + len(data) == size):
            data = data[: utf8_safe_end(data)]
        nxt = start + len(data)
        return _json({"offset": start, "next_offset": nxt, "data": data.decode("utf-8", "replace"),
                      "eof": terminal and nxt >= size, "size": size, "status": job["status"]})

    @app.get("/v1/jobs/{job_id}/metrics")
    def job_metrics(job_id: str, offset: int = 0) -> Response:
        job = store.get_job(job_id)
        rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
        records, nxt = rd.read_metrics(max(0, offset))
        return _json({"offset": offset, "next_offset": nxt, "records": records})

    @app.get("/v1/events")
    async def events(request: Request, last_event_id: int | None = None) -> StreamingResponse:
        header = request.headers.get("last-event-id")
        start = int(header) if header and header.isdigit() else last_event_id
        if start is None:
            start = await asyncio.to_thread(store.last_event_id)  # only what happens from now on
        return StreamingResponse(_stream(store, bus, request, start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    app.add_middleware(TimingMiddleware, metrics=metrics)
    app.add_middleware(AuthMiddleware, token=token, hosts=allowed_hosts(host, extra_hosts))  # outermost
    return app


async def _stream(store: JobStore, bus: EventBus, request: Request, last_id: int) -> AsyncIterator[str]:
    yield "retry: 1000\n\n"
    last_beat = time.monotonic()
    while not bus.stopping.is_set():
        waiter = bus.waiter()  # taken before reading, so no event slips between read and wait
        batch = await asyncio.to_thread(store.events_since, last_id)
        for ev in batch:
            last_id = ev["id"]
            yield f"id: {ev['id']}\nevent: {ev['type']}\ndata: {json.dumps(ev, separators=(',', ':'))}\n\n"
        if batch:
            continue
        if await request.is_disconnected():
            return
        if time.monotonic() - last_beat > KEEPALIVE_S:
            last_beat = time.monotonic()
            yield ": keep-alive\n\n"
        try:
            await asyncio.wait_for(waiter.wait(), timeout=1.0)
        except asyncio.TimeoutError:
            pass


def _detect_gpus() -> int:
    env = os.environ.get("OFFLOAD_JOBS_GPUS")
    if env is not None and env.strip().isdigit():
        return int(env)
    try:
        import pynvml  # nvidia-ml-py; absent or failing means no GPU

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
