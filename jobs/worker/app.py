"""The worker's FastAPI app: the /v1 JSON API, server-sent events, /metrics and /healthz.

`create_app` wires the store, scheduler, heartbeat, auth and metrics, and includes the routes,
one APIRouter a resource (jobs/worker/routes/); the lifespan registers the worker, recovers its
lost attempts and runs the scheduler. Handlers are sync (run in the thread pool) except the event
stream. Every response body is strict JSON (`strict_json`): a NaN in a
job's metrics is null on the wire.

On a shared store (`OFFLOAD_JOBS_DB=postgresql+psycopg://...`) every worker's API serves every
job: the list and events from the store, logs and metrics from what the running worker shipped to
it, `signal` through the store to the worker that runs the job, and /v1/workers for who runs what.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

import jobs
from jobs.errors import InvalidTransition, JobNotFound, JobsError, RequestTooLarge, RunDirError, SpecError, StoreError
from jobs.home import ensure_token, secure_home
from jobs.rundir import RunDir
from jobs.spec import MAX_SPEC_BYTES
from jobs.store import JobStore
from jobs.worker.auth import AuthMiddleware, BodyLimitMiddleware, allowed_hosts
from jobs.worker.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT, Heartbeat
from jobs.worker.inventory import Gpu, WorkerIdentity, boot_id, detect_gpus, gpu_usage, slurm_available, worker_id_for
from jobs.worker.metrics import TimingMiddleware, WorkerMetrics, live_jobs
from jobs.worker.routes import controls, events, files, health, models, submit, workers
from jobs.worker.routes import jobs as jobs_routes
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json
from jobs.worker.routes.events import EventBus
from jobs.worker.routes.health import StoreHealth
from jobs.worker.scheduler import Scheduler

__all__ = ["create_app", "EventBus", "StoreHealth", "open_store"]

log = logging.getLogger("offload_jobs.app")

ROUTERS = (health, submit, jobs_routes, workers, models, controls, files, events)  # each module's router(ctx)


def open_store(home: Path, url: str | None = None) -> JobStore:
    """The store at `url` (a shared Postgres), else the state dir's, refusing to start over a store
    that lost the history beside it.

    A zero-byte or unreadable jobs.db next to a runs/ that holds jobs means the store was
    truncated or corrupted: starting an empty store there would silently drop every job.
    """
    if url:
        return JobStore(url)
    db = home / "jobs.db"
    runs = home / "runs"
    n_runs = sum(1 for _ in runs.iterdir()) if runs.is_dir() else 0
    advice = (f"restore {db} from a backup, or move it aside (mv {db} {db}.broken) to start an empty store; "
              f"the {n_runs} run dirs in {runs} are kept")
    if db.exists() and db.stat().st_size == 0 and n_runs:
        raise StoreError(f"{db} is empty (0 bytes) but {runs} holds {n_runs} jobs: the store was truncated; {advice}")
    store = JobStore(db)
    problem = store.integrity_problem()
    if problem is not None:
        store.close()
        raise StoreError(f"{db} is corrupt ({problem}); {advice}")
    from jobs.store_rebuild import check_history  # run dirs the store knows nothing of: it lost its history

    try:
        check_history(store, home)
    except StoreError:
        store.close()
        raise
    return store


def create_app(home: str | os.PathLike[str], *, host: str = "127.0.0.1", token: str | None = None,
               max_cpu_jobs: int = 4, gpu_count: int | None = None, extra_hosts: Iterable[str] = (),
               tick: float = 0.1, job_umask: int = 0o022, max_spec_bytes: int = MAX_SPEC_BYTES,
               db_url: str | None = None, worker_id: str | None = None, heartbeat_timeout: float | None = None,
               gpu_vram: list[int] | None = None, max_slurm_jobs: int | None = None,
               public_url: str | None = None) -> FastAPI:
    home = Path(home).expanduser()
    secure_home(home)
    token = token or ensure_token(home)
    bus = EventBus()
    db_url = db_url if db_url is not None else (os.environ.get("OFFLOAD_JOBS_DB") or None)
    store = open_store(home, db_url)
    secure_home(home)  # the store's files, now that they exist
    gpus: list[Gpu] = detect_gpus(gpu_count, gpu_vram)
    gpu_count = len(gpus)
    slurm = slurm_available()
    if max_slurm_jobs is None:
        max_slurm_jobs = int(os.environ.get("OFFLOAD_JOBS_MAX_SLURM_JOBS", "64")) if slurm else 0
    from jobs.worker.inventory import docker_available  # issue 28: docker listed only where it can run

    executors = (["process"] + (["docker"] if docker_available() else [])
                 + (["slurm"] if slurm and max_slurm_jobs > 0 else []))
    ident = WorkerIdentity(worker_id_for(home, worker_id), socket.gethostname(), boot_id())
    timeout = heartbeat_timeout or float(os.environ.get("OFFLOAD_JOBS_HEARTBEAT_TIMEOUT") or DEFAULT_HEARTBEAT_TIMEOUT)
    state: dict[str, Any] = {"url": public_url}

    def on_event(ev: dict[str, Any]) -> None:
        if ev.get("job_id"):
            rd = RunDir.for_job(home, ev["job_id"])
            if rd.path.exists():
                rd.append_event({k: v for k, v in ev.items() if k != "job_id"})
        bus.notify()

    store.on_event = on_event
    sched: Scheduler

    def worker_info() -> dict[str, Any]:
        return {"url": state["url"], "gpus": gpu_usage(gpus), "cpu_slots": max_cpu_jobs, "executors": executors,
                "max_slurm_jobs": max_slurm_jobs, "version": jobs.__version__}

    def grace_of(job_id: str, attempt: int) -> float:
        r = sched.running.get(job_id)
        return r.spec.limits.stop_grace if r is not None and r.spec is not None else 10.0

    heartbeat = Heartbeat(store, ident, timeout=timeout, home=home, info=worker_info, grace_of=grace_of,
                          url=public_url)
    sched = Scheduler(store, home, gpu_count=gpu_count, max_cpu_jobs=max_cpu_jobs, tick=tick, job_umask=job_umask,
                      gpu_vram=[g.memory_total for g in gpus], worker_id=ident.id, heartbeat=heartbeat,
                      max_slurm_jobs=max_slurm_jobs)
    heartbeat.on_reaped = lambda job: sched.wake()
    heartbeat.find_end = sched.find_end
    listener = None
    if store.is_postgres:
        from jobs.worker.listen import Listener

        listener = Listener(store.url, sched.wake, bus.notify)
    metrics = WorkerMetrics(store.counts, lambda: len(sched.running), lambda: live_jobs(store, list(sched.running)))
    sched.on_finish = metrics.on_finish
    sched.on_start = lambda job: metrics.queue_wait.observe(max(0.0, time.time() - job["created_at"]))

    app = FastAPI(title="offload-jobs worker", version=jobs.__version__,
                  lifespan=_lifespan(store, sched, heartbeat, bus, listener),
                  docs_url=None, redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.store, app.state.scheduler, app.state.bus, app.state.home = store, sched, bus, home
    app.state.heartbeat, app.state.listener, app.state.worker = heartbeat, listener, state
    store_health = app.state.store_health = StoreHealth(store)
    _add_error_handlers(app, store_health)
    ctx = WorkerContext(home=home, token=token, store=store, sched=sched, bus=bus, ident=ident, metrics=metrics,
                        store_health=store_health, gpus=gpus, executors=executors, max_spec_bytes=max_spec_bytes)
    for module in ROUTERS:
        app.include_router(module.router(ctx))
    app.add_middleware(TimingMiddleware, metrics=metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_spec_bytes + 64 * 1024)
    app.add_middleware(AuthMiddleware, token=token, hosts=allowed_hosts(host, extra_hosts))  # outermost
    return app


def _lifespan(store: JobStore, sched: Scheduler, heartbeat: Heartbeat, bus: EventBus,
              listener: Any) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Register the worker, recover its attempts, run the scheduler and heartbeat; stop them in order."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bus.bind(asyncio.get_running_loop())
        try:
            await asyncio.to_thread(heartbeat.register)
            await asyncio.to_thread(sched.recover)
        except JobsError as exc:  # one line the user (and `up --local`) can read, not uvicorn's traceback
            print("error: " + " ".join(str(exc).split()), file=sys.stderr, flush=True)
            raise
        if listener is not None:
            listener.start()
        sched.start()
        heartbeat.start()
        try:
            yield
        finally:
            bus.stopping.set()
            bus.notify()
            if listener is not None:
                listener.stop()
            await asyncio.to_thread(sched.stop)
            await asyncio.to_thread(heartbeat.stop)
            store.close()

    return lifespan


def _add_error_handlers(app: FastAPI, store_health: StoreHealth) -> None:
    """Every error a user can cause as one JSON line with its status (the client maps them back)."""

    @app.exception_handler(JobNotFound)
    async def _not_found(_: Request, exc: JobNotFound) -> Response:
        return _json({"error": str(exc), "job_id": exc.job_id}, 404)

    @app.exception_handler(InvalidTransition)
    async def _conflict(_: Request, exc: InvalidTransition) -> Response:
        return _json({"error": str(exc)}, 409)

    @app.exception_handler(RunDirError)
    async def _unsafe(_: Request, exc: RunDirError) -> Response:
        return _json({"error": str(exc)}, 409)

    @app.exception_handler(SpecError)
    async def _bad_spec(_: Request, exc: SpecError) -> Response:
        return _json({"error": str(exc), "message": exc.message, "field": exc.field, "line": exc.line}, 400)

    @app.exception_handler(RequestTooLarge)
    async def _too_large(_: Request, exc: RequestTooLarge) -> Response:
        return _json({"error": str(exc), "too_large": True}, 413)

    @app.exception_handler(StoreError)
    async def _store_down(_: Request, exc: StoreError) -> Response:
        store_health.answered_503(str(exc))
        return _json({"error": str(exc), "store": True}, 503)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())[1:])
        return _json({"error": f"{field}: {err.get('msg')}", "param": field}, 400)
