"""The worker's FastAPI app: the /v1 JSON API, server-sent events, /metrics and /healthz.

`create_app` wires the store, scheduler, heartbeat, auth and metrics; the lifespan registers the
worker, recovers its lost attempts and runs the scheduler. Handlers are sync (run in the thread
pool) except the event stream. Every response body is strict JSON (`strict_json`): a NaN in a
job's metrics is null on the wire.

On a shared store (`OFFLOAD_JOBS_DB=postgresql+psycopg://...`) every worker's API serves every
job: the list and events from the store, logs and metrics from what the running worker shipped to
it, `signal` through the store to the worker that runs the job, and /v1/workers for who runs what.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import shutil
import socket
import sys
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
from jobs import strict_json
from jobs.errors import (
    InvalidTransition, JobNotFound, JobsError, RequestTooLarge, RunDirError, SpecError, StoreError,
)
from jobs.home import ensure_token, secure_home
from jobs.preflight import preflight
from jobs.rundir import RunDir, utf8_safe_end
from jobs.spec import MAX_SPEC_BYTES, JobSpec, parse_spec
from jobs.store import TERMINAL, JobStore
from jobs.worker.auth import AuthMiddleware, BodyLimitMiddleware, allowed_hosts
from jobs.worker.heartbeat import DEFAULT_HEARTBEAT_TIMEOUT, Heartbeat
from jobs.worker.inventory import Gpu, WorkerIdentity, boot_id, detect_gpus, gpu_usage, slurm_available, worker_id_for
from jobs.worker.metrics import TimingMiddleware, WorkerMetrics
from jobs.worker.scheduler import Scheduler

__all__ = ["create_app", "EventBus", "open_store"]

log = logging.getLogger("offload_jobs.app")

LOG_CHUNK = 1 << 20
SIGNAL_ACTIONS = ("save", "sample", "stop")  # what jobs.runners.controls obeys
KEEPALIVE_S = 15.0
LIST_LIMIT_MAX = 100_000


def _json(obj: Any, status: int = 200) -> Response:
    # strict_json directly: jsonable_encoder costs ~10x on a 1,000-job list.
    return Response(strict_json.dumps(obj), status_code=status, media_type="application/json")


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


def _parse_body(raw: bytes) -> Any:
    """The request's JSON, strictly: no NaN/Infinity, no duplicate keys, bounded nesting."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in items:
            if k in out:
                raise SpecError(k, "duplicate key")
            out[k] = v
        return out

    def constant(name: str) -> Any:
        raise SpecError(None, f"{name} is not JSON (numbers must be finite)")

    try:
        return json.loads(raw, object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        raise SpecError(None, "the request nests too deeply") from None
    except UnicodeDecodeError:
        raise SpecError(None, "the request body is not UTF-8") from None
    except ValueError as exc:
        if isinstance(exc, SpecError):
            raise
        raise SpecError(None, "request body must be JSON: {\"spec\": {...}}") from None


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
    executors = ["process", "docker"] + (["slurm"] if slurm and max_slurm_jobs > 0 else [])
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
    metrics = WorkerMetrics(store.counts, lambda: len(sched.running))
    sched.on_finish = metrics.on_finish
    sched.on_start = lambda job: metrics.queue_wait.observe(max(0.0, time.time() - job["created_at"]))

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

    app = FastAPI(title="offload-jobs worker", version=jobs.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url="/v1/openapi.json")
    app.state.store, app.state.scheduler, app.state.bus, app.state.home = store, sched, bus, home
    app.state.heartbeat, app.state.listener, app.state.worker = heartbeat, listener, state

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
        return _json({"error": str(exc), "store": True}, 503)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())[1:])
        return _json({"error": f"{field}: {err.get('msg')}", "param": field}, 400)

    def _has_image(image: str) -> bool:
        return sched._executor("docker").has_image(image)  # type: ignore[attr-defined]

    async def _read_spec(request: Request) -> tuple[JobSpec, dict[str, Any]]:
        body = _parse_body(await request.body())
        raw = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(raw, dict):
            raise SpecError(None, "request body must be {\"spec\": {...}}")
        spec = parse_spec(raw)
        await asyncio.to_thread(_check_fits, spec)
        data = spec.model_dump(mode="json", exclude_unset=True)
        if len(strict_json.dumps(data)) > max_spec_bytes:
            raise RequestTooLarge(f"the spec is over {max_spec_bytes} bytes, the worker's limit")
        await asyncio.to_thread(preflight, spec, has_image=_has_image)
        return spec, data

    def _check_fits(spec: JobSpec) -> None:
        """Refuse at submit a job that no worker could ever claim (a typo'd GPU count, say)."""
        slurm_job = spec.executor == "slurm"
        if not store.shared:
            if slurm_job and "slurm" not in executors:
                raise SpecError("executor", "this worker cannot run executor: slurm (Slurm's sbatch, squeue, "
                                            "scancel and scontrol are not on its PATH)")
            if not slurm_job and spec.gpus > sched.gpu_slots:
                raise SpecError("resources.gpus", f"asks for {spec.gpus} GPUs; this worker has {sched.gpu_slots}")
            why = _fit_error(spec, [g.memory_total for g in gpus], "this worker")
            if not slurm_job and spec.resources.min_vram and why:
                raise SpecError("resources.min_vram", why)
            return
        known = store.workers()
        if slurm_job:
            if not any("slurm" in (w.get("executors") or []) for w in known):
                raise SpecError("executor", "no worker on this store runs executor: slurm (none has Slurm's client "
                                            "commands on its PATH)")
            return
        errors = [_fit_error(spec, [g.get("memory_total") or 0 for g in (w.get("gpus") or [])] or [0],
                             f"worker {w['id']}") for w in known]
        if known and all(errors):
            raise SpecError("resources.min_vram" if spec.resources.min_vram else "resources.gpus",
                            f"no worker on this store can run it: {'; '.join(e for e in errors[:3] if e)}")

    @app.get("/healthz")
    def healthz(challenge: str | None = None) -> Response:
        out: dict[str, Any] = {"ok": True, "version": jobs.__version__, "pid": os.getpid(), "worker_id": ident.id}
        if challenge:  # proves to a client that we hold its token, before it sends the token
            out["proof"] = hmac.new(token.encode(), challenge[:256].encode(), hashlib.sha256).hexdigest()
        return _json(out)

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/jobs")
    async def submit(request: Request) -> Response:
        spec, data = await _read_spec(request)
        from jobs.worker.intake import KEY_HEADER, submit_job  # idempotency key, store file, whole run dirs

        job, created = await asyncio.to_thread(submit_job, store, home, spec, data, request.headers.get(KEY_HEADER))
        if not created:
            return _json(job, 200)
        sched.wake()
        metrics.submitted.labels(spec.kind).inc()
        return _json(job, 201)

    @app.post("/v1/validate")
    async def validate(request: Request) -> Response:
        spec, data = await _read_spec(request)
        return _json({"ok": True, "kind": spec.kind, "name": spec.name, "spec": data})

    @app.get("/v1/jobs")
    def list_jobs(status: str | None = None, limit: int | None = None, view: str = "full") -> Response:
        statuses = [s for s in status.split(",") if s] if status else None
        if limit is not None:
            limit = max(0, min(limit, LIST_LIMIT_MAX))
        text = store.list_jobs_json(statuses, limit, summary=view == "summary")
        return Response(text, media_type="application/json")

    @app.get("/v1/jobs/{job_id}")
    def show(job_id: str) -> Response:
        job = store.get_job(job_id)
        job["attempts"] = store.attempts(job["id"])
        return _json(job)

    @app.delete("/v1/jobs/{job_id}")
    def delete(job_id: str) -> Response:
        job = store.delete_job(job_id)
        _remove_run_dir(home, job, ident.id if store.shared else None)
        return _json({"deleted": [job["id"]]})

    @app.get("/v1/workers")
    def workers() -> Response:
        """Every worker on this store: its host, GPUs (and the job on each), slots, heartbeat, running attempts."""
        return _json({"workers": store.workers(), "this": ident.id, "shared": store.shared,
                      "store": "postgresql" if store.is_postgres else "sqlite"})

    @app.post("/v1/prune")
    async def prune(request: Request) -> Response:
        body = _parse_body(await request.body() or b"{}")
        older = body.get("older_than") if isinstance(body, dict) else None
        if not isinstance(older, (int, float)) or isinstance(older, bool) or older < 0:
            raise SpecError("older_than", "must be a number of seconds >= 0")
        dry = bool(body.get("dry_run"))
        gone = await asyncio.to_thread(store.prune, time.time() - float(older), dry_run=dry)
        if not dry:
            for job in gone:
                _remove_run_dir(home, job, ident.id if store.shared else None)
        return _json({"deleted": [j["id"] for j in gone], "dry_run": dry, "jobs": gone})

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
        record = {"ts": time.time(), "action": action, "attempt": job.get("attempt")}
        if store.shared and job.get("worker_id") != ident.id:  # runs elsewhere: its worker delivers it
            await asyncio.to_thread(store.add_event, job["id"], "job.control",
                                    {**record, "worker_id": job.get("worker_id")})
        else:
            rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
            with open(rd.path / "control.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        return _json({"id": job["id"], "action": action, "status": job["status"], "attempt": job.get("attempt")}, 202)
    # ---- end of runner controls ---------------------------------------------------------------------

    @app.get("/v1/jobs/{job_id}/logs")
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

    @app.get("/v1/jobs/{job_id}/metrics")
    def job_metrics(job_id: str, offset: int = 0) -> Response:
        job = store.get_job(job_id)
        if store.shared:  # record numbers, not bytes: the store holds records
            records, nxt = store.metric_records(job["id"], max(0, offset))
        else:
            rd = RunDir(job["run_dir"] or RunDir.for_job(home, job["id"]).path)
            records, nxt = rd.read_metrics(max(0, offset))
        return _json({"offset": offset, "next_offset": nxt, "records": records})

    @app.get("/v1/events")
    async def events(request: Request, last_event_id: int | None = None, job_id: str | None = None) -> StreamingResponse:
        header = request.headers.get("last-event-id")
        start = int(header) if header and header.isdigit() else last_event_id
        if start is None:
            start = await asyncio.to_thread(store.last_event_id)  # only what happens from now on
        return StreamingResponse(_stream(store, bus, request, start, job_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    add_job_file_routes(app)  # issue 14's block at the end of this file
    app.add_middleware(TimingMiddleware, metrics=metrics)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_spec_bytes + 64 * 1024)
    app.add_middleware(AuthMiddleware, token=token, hosts=allowed_hosts(host, extra_hosts))  # outermost
    return app


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


async def _stream(store: JobStore, bus: EventBus, request: Request, last_id: int,
                  job_id: str | None = None) -> AsyncIterator[str]:
    yield "retry: 1000\n\n"
    last_beat = time.monotonic()
    while not bus.stopping.is_set():
        waiter = bus.waiter()  # taken before reading, so no event slips between read and wait
        try:
            batch = await asyncio.to_thread(store.events_since, last_id, 500, job_id)
        except StoreError:
            batch = []
        for ev in batch:
            last_id = ev["id"]
            yield f"id: {ev['id']}\nevent: {ev['type']}\ndata: {strict_json.dumps(ev)}\n\n"
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


def _fit_error(spec: JobSpec, vram: list[int], who: str) -> str | None:
    """Why `who`, with GPUs of `vram` bytes each (0: unknown), could never run `spec`; None when it could.

    A worker with no GPU has one slot of 0 bytes: GPU jobs without `min_vram` run there on the CPU.
    """
    need = spec.gpus
    floor = spec.resources.min_vram or 0
    if need == 0:
        return None
    if len(vram) < need:
        return f"asks for {need} GPUs; {who} has {len(vram)}"
    if sum(1 for v in vram if v >= floor) < need:
        have = ", ".join(f"{v / 2**30:.1f} GiB" if v else "unknown" for v in sorted(vram, reverse=True))
        return f"asks for {need} GPU(s) of at least {floor / 2**30:.1f} GiB; {who} has {have}"
    return None


# ---------------------------------------------------------------- for the dashboard and `report` (issue 14)
# A job's own events (its run dir's events.jsonl) and its outputs/ files, read-only. Only regular
# files are served: a symlink anywhere under outputs/ is neither listed nor followed.

MAX_OUTPUT_FILE = 64 << 20


def _outputs_dir(app: FastAPI, job_id: str) -> tuple[Path, Path]:
    job = app.state.store.get_job(job_id)
    rd = RunDir(job["run_dir"] or RunDir.for_job(app.state.home, job["id"]).path)
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
            if not os.path.isfile(p) or os.path.islink(p):
                continue
            files.append({"path": os.path.relpath(p, outputs), "size": st.st_size, "mtime": st.st_mtime})
            if len(files) >= limit:
                return files
    return files


def add_job_file_routes(app: FastAPI) -> None:
    @app.get("/v1/events/last")
    def last_event() -> Response:
        # A dashboard lists jobs after reading this, then streams events from it: no gap between.
        return _json({"id": app.state.store.last_event_id()})

    @app.get("/v1/jobs/{job_id}/events")
    def job_events(job_id: str) -> Response:
        run_path, _ = _outputs_dir(app, job_id)
        records: list[dict[str, Any]] = []
        try:
            with open(run_path / "events.jsonl", "rb") as f:
                for line in f.read(8 << 20).splitlines():
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict):
                        records.append(rec)
        except OSError:
            pass
        return _json({"events": records})

    @app.get("/v1/jobs/{job_id}/outputs")
    def job_outputs(job_id: str) -> Response:
        _, outputs = _outputs_dir(app, job_id)
        return _json({"files": _list_outputs(outputs)})

    @app.get("/v1/jobs/{job_id}/outputs/{path:path}")
    def job_output_file(job_id: str, path: str) -> Response:
        _, outputs = _outputs_dir(app, job_id)
        listed = {f["path"]: f for f in _list_outputs(outputs)}
        entry = listed.get(path)
        if entry is None:
            return _json({"error": f"no output file {path!r} in job {job_id}"}, 404)
        if entry["size"] > MAX_OUTPUT_FILE:
            return _json({"error": f"{path} is {entry['size']} bytes, over the {MAX_OUTPUT_FILE} limit"}, 413)
        try:
            fd = os.open(outputs / path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_OUTPUT_FILE + 1)
        except OSError as exc:
            return _json({"error": f"{path}: {exc.strerror or exc}"}, 404)
        return Response(data, media_type="application/octet-stream")
