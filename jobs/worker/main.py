"""Start a worker: take the state dir's lock, serve the app with uvicorn, publish worker.json."""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from jobs.errors import JobsError, StoreError
from jobs.home import DEFAULT_PORT, WORKER_FILE, secure_home, state_home, write_private

__all__ = ["run_worker", "main"]

log = logging.getLogger("offload_jobs.worker")


class _Server(uvicorn.Server):
    """Publishes worker.json once the socket is bound; ends event streams as soon as a stop is asked."""

    def __init__(self, config: uvicorn.Config, home: Path, host: str) -> None:
        super().__init__(config)
        self.home = home
        self.host = host
        self.startup_error: str | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        port = self.servers[0].sockets[0].getsockname()[1]
        host = self.host if self.host not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        info = {"url": url, "pid": os.getpid(), "host": self.host, "port": port, "started_at": time.time()}
        try:
            write_private(self.home / WORKER_FILE, json.dumps(info))
        except OSError as exc:  # a full disk: no client could find this worker; stop cleanly and say why
            self.startup_error = _os_message(self.home / WORKER_FILE, exc)
            self.should_exit = True
            return
        worker = getattr(getattr(_unwrap(self.config.loaded_app), "state", None), "worker", None)
        if isinstance(worker, dict) and not worker.get("url"):
            worker["url"] = url  # what /v1/workers shows (--advertise-url says better for other hosts)
        print(f"offload-jobs worker listening on {url} (state dir {self.home})", file=sys.stderr, flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        app = self.config.loaded_app if self.config.loaded else None
        bus = getattr(getattr(_unwrap(app), "state", None), "bus", None)
        if bus is not None:
            bus.stopping.set()
            bus.notify()
        super().handle_exit(sig, frame)


def _unwrap(app: Any) -> Any:
    # uvicorn wraps the app in its own middlewares; find the FastAPI instance underneath.
    seen = 0
    while app is not None and not hasattr(app, "state") and seen < 10:
        app = getattr(app, "app", None)
        seen += 1
    return app


def _os_message(path: Path | str | None, exc: OSError) -> str:
    """One line for an OSError at start, naming the file (and the full disk, when that is the cause)."""
    where = exc.filename or path or "the state dir"
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        why += " (the disk is full: free some space)"
    return f"cannot write {where}: {why}"


class _Stopped(Exception):
    pass


def _stopped(sig: int, frame: Any) -> None:
    raise _Stopped()


def _lock(home: Path) -> Any:
    f = open(home / "worker.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        other = f.read().strip()
        f.close()
        raise StoreError(f"another worker (pid {other or '?'}) already owns {home}") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f  # held open for the life of the process; the kernel releases it when we die


def run_worker(host: str = "127.0.0.1", port: int = DEFAULT_PORT, home: str | os.PathLike[str] | None = None,
               *, max_cpu_jobs: int = 4, gpus: int | None = None, allow_hosts: list[str] | None = None,
               log_level: str = "warning", max_spec_bytes: int | None = None, db_url: str | None = None,
               worker_id: str | None = None, heartbeat_timeout: float | None = None, gpu_vram: str | None = None,
               max_slurm_jobs: int | None = None, advertise_url: str | None = None,
               rebuild_store: bool = False) -> None:
    from jobs.spec import MAX_SPEC_BYTES
    from jobs.worker.app import create_app

    # Everything the worker writes is private (specs carry env secrets); jobs get the caller's umask.
    job_umask = os.umask(0o077)
    h = secure_home(state_home(home))
    lock = _lock(h)
    try:
        if rebuild_store:
            _rebuild_store(h, db_url if db_url is not None else (os.environ.get("OFFLOAD_JOBS_DB") or None))
        extra = list(allow_hosts or []) + [x for x in os.environ.get("OFFLOAD_JOBS_ALLOWED_HOSTS", "").split(",") if x]
        from jobs.worker.inventory import parse_vram_list

        vram_text = gpu_vram if gpu_vram is not None else os.environ.get("OFFLOAD_JOBS_GPU_VRAM")
        app = create_app(h, host=host, max_cpu_jobs=max_cpu_jobs, gpu_count=gpus, extra_hosts=extra,
                         job_umask=job_umask, max_spec_bytes=max_spec_bytes or MAX_SPEC_BYTES, db_url=db_url,
                         worker_id=worker_id, heartbeat_timeout=heartbeat_timeout,
                         gpu_vram=parse_vram_list(vram_text) if vram_text else None, max_slurm_jobs=max_slurm_jobs,
                         public_url=advertise_url)
        from jobs.worker.http_protocol import GuardedHTTPProtocol  # a header-read timeout (slow clients)

        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                timeout_graceful_shutdown=5, access_log=False, http=GuardedHTTPProtocol)
        # uvicorn re-raises the signal that stopped it once it has shut down; make that a clean return.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, _stopped)
        server = _Server(config, h, host)
        try:
            server.run()
        except _Stopped:
            pass
        if server.startup_error:
            raise JobsError(server.startup_error)
    finally:
        info = h / WORKER_FILE
        try:
            if json.loads(info.read_text()).get("pid") == os.getpid():
                info.unlink()
        except (OSError, ValueError):
            pass
        lock.close()


def _rebuild_store(home: Path, db_url: str | None) -> None:
    """`--rebuild-store`: put back the jobs the state dir's store lost, from their run dirs (under the lock)."""
    if db_url:
        raise StoreError("--rebuild-store rebuilds the state dir's SQLite store; a shared store ("
                         f"{db_url.split('://')[0]}) is restored from its own backups")
    from jobs.store import JobStore
    from jobs.store_rebuild import rebuild

    store = JobStore(home / "jobs.db")
    try:
        done = rebuild(store, home)
    finally:
        store.close()
    states: dict[str, int] = {}
    for job in done:
        states[job["status"]] = states.get(job["status"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "nothing was missing"
    print(f"offload-jobs worker: rebuilt {len(done)} jobs of {home / 'jobs.db'} from {home / 'runs'} ({summary})",
          file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.worker", description="Run an offload-jobs worker.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--home", default=None, help="state dir (default $OFFLOAD_JOBS_HOME or ~/.offload-jobs)")
    p.add_argument("--max-cpu-jobs", type=int, default=4, help="concurrent jobs that need no GPU")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to schedule (default: detected)")
    p.add_argument("--allow-host", action="append", default=[], help="extra Host header name to accept")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--max-spec-bytes", type=int, default=None, help="largest spec accepted (default 1 MiB)")
    p.add_argument("--db", default=None, help="shared store URL, e.g. postgresql+psycopg://user@host/db "
                                               "(default $OFFLOAD_JOBS_DB; none: the state dir's SQLite)")
    p.add_argument("--worker-id", default=None, help="this worker's name (default $OFFLOAD_JOBS_WORKER_ID, "
                                                      "else one kept in the state dir)")
    p.add_argument("--heartbeat-timeout", type=float, default=None,
                   help="seconds without a heartbeat before this worker's jobs are retried elsewhere (default "
                        "$OFFLOAD_JOBS_HEARTBEAT_TIMEOUT or 30)")
    p.add_argument("--gpu-vram", default=None, help="declare the GPUs and their memory, e.g. 24GiB,8GiB (default: NVML)")
    p.add_argument("--max-slurm-jobs", type=int, default=None,
                   help="attempts this worker keeps in Slurm at once (default 64 where sbatch is on PATH)")
    p.add_argument("--advertise-url", default=None, help="the API URL other hosts use for this worker")
    p.add_argument("--rebuild-store", action="store_true",
                   help="rebuild the jobs the state dir's store lost (jobs.db or jobs.db-wal deleted) from their run dirs")
    a = p.parse_args(argv)
    if a.heartbeat_timeout is not None and not (1.0 <= a.heartbeat_timeout <= 3600):
        p.error("--heartbeat-timeout must be between 1 and 3600 seconds")
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_worker(a.host, a.port, a.home, max_cpu_jobs=a.max_cpu_jobs, gpus=a.gpus, allow_hosts=a.allow_host,
                   log_level=a.log_level, max_spec_bytes=a.max_spec_bytes, db_url=a.db, worker_id=a.worker_id,
                   heartbeat_timeout=a.heartbeat_timeout, gpu_vram=a.gpu_vram, max_slurm_jobs=a.max_slurm_jobs,
                   advertise_url=a.advertise_url, rebuild_store=a.rebuild_store)
    except JobsError as exc:
        # One line, and the line `up --local` shows: the real cause, not a library's link.
        print("error: " + " ".join(str(exc).split()), file=sys.stderr, flush=True)
        return 2
    except OSError as exc:  # the state dir, its lock, token or store files: a full disk, a read-only mount
        if not (exc.filename or exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)):
            raise  # not a file of ours: a bug, with its traceback
        print("error: " + _os_message(None, exc), file=sys.stderr, flush=True)
        return 2
    return 0
