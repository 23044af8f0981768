"""`offload-jobs worker`, `up` and `down`: run the worker here, in the background, or in Docker."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765  # jobs.home.DEFAULT_PORT; repeated so --help does not import it

HOME_HELP = "State dir (default $OFFLOAD_JOBS_HOME or ~/.offload-jobs)."
HostOpt = Annotated[str, typer.Option("--host", help="Address to listen on.")]
PortOpt = Annotated[int, typer.Option("--port", "-p", min=0, max=65535, help="Port to listen on.")]
HomeOpt = Annotated[Optional[Path], typer.Option("--home", help=HOME_HELP, show_default=False)]
ComposeFileOpt = Annotated[Optional[Path], typer.Option(
    "--file", "-f", help="Compose file (default: the offload-jobs checkout's compose.yaml, found from anywhere).",
    show_default=False)]


def worker(
    host: HostOpt = DEFAULT_HOST,
    port: PortOpt = DEFAULT_PORT,
    home: HomeOpt = None,
    max_cpu_jobs: Annotated[Optional[int], typer.Option(
        "--max-cpu-jobs", min=1, show_default=False, help="Jobs that need no GPU run this many at once (default 4).")
    ] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=0, show_default=False,
                                                help="GPUs to schedule (default: detected).")] = None,
    log_level: Annotated[Optional[str], typer.Option("--log-level", show_default=False,
                                                     help="debug, info or warning (default).")] = None,
    db: Annotated[Optional[str], typer.Option(
        "--db", show_default=False, help="A store several workers share: postgresql+psycopg://user@host/db "
                                         "(default $OFFLOAD_JOBS_DB; none: SQLite in the state dir).")] = None,
    worker_id: Annotated[Optional[str], typer.Option(
        "--worker-id", show_default=False, help="This worker's name (default: one kept in the state dir).")] = None,
    heartbeat_timeout: Annotated[Optional[float], typer.Option(
        "--heartbeat-timeout", min=1.0, max=3600.0, show_default=False,
        help="Seconds of silence before this worker's jobs are retried by another (default 30).")] = None,
    gpu_vram: Annotated[Optional[str], typer.Option(
        "--gpu-vram", show_default=False, help="Declare the GPUs and their memory, e.g. 24GiB,8GiB (default: NVML).")
    ] = None,
    rebuild_store: Annotated[bool, typer.Option(
        "--rebuild-store", help="Rebuild the jobs the state dir's store lost (deleted jobs.db or jobs.db-wal) from "
                                "their run dirs, then run.")] = False,
) -> None:
    """Run the worker in the foreground (HTTP API, scheduler, store). Ctrl-C stops it."""
    from jobs._cli.worker_entry import run_worker_foreground

    code = run_worker_foreground(host, port, home, max_cpu_jobs=max_cpu_jobs, gpus=gpus, log_level=log_level,
                                 db=db, worker_id=worker_id, heartbeat_timeout=heartbeat_timeout, gpu_vram=gpu_vram,
                                 rebuild_store=rebuild_store)
    if code:
        raise typer.Exit(code)


def up(
    local: Annotated[bool, typer.Option(
        "--local", help="Start a worker process here instead of `docker compose`.")] = False,
    host: HostOpt = DEFAULT_HOST,
    port: PortOpt = DEFAULT_PORT,
    home: HomeOpt = None,
    wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for the worker to answer.")] = 30.0,
    file: ComposeFileOpt = None,
) -> None:
    """Start the worker: `docker compose up -d`, or with --local a background process on this machine."""
    if not local:
        from jobs._cli.compose import compose_up
        from jobs.home import state_home

        typer.echo(compose_up(file, state_home(home), wait_s=wait))
        return
    from jobs._cli.local_worker import LOG_FILE, start_local_worker, worker_healthy
    from jobs.home import read_worker_info, state_home

    state = state_home(home)
    info = read_worker_info(state) or {}
    if info.get("url") and worker_healthy(str(info["url"])):
        typer.echo(f"a worker is already running at {info['url']} (pid {info.get('pid', '?')})", err=True)
        typer.echo(str(info["url"]))
        return
    url = start_local_worker(state, host, port, wait_s=wait)
    typer.echo(f"worker up; state in {state}, log in {state / LOG_FILE}; stop it with: offload-jobs down --local",
               err=True)
    typer.echo(url)


def down(
    local: Annotated[bool, typer.Option("--local", help="Stop the background worker started by `up --local`.")] = False,
    home: HomeOpt = None,
    wait: Annotated[float, typer.Option("--wait", help="Seconds between SIGTERM and SIGKILL.")] = 15.0,
    file: ComposeFileOpt = None,
) -> None:
    """Stop the worker: `docker compose down`, or with --local the background process."""
    if not local:
        from jobs._cli.compose import compose_down
        from jobs.home import state_home

        compose_down(file, state_home(home))
        return
    from jobs._cli.local_worker import stop_local_worker
    from jobs.home import state_home

    state = state_home(home)
    pid = stop_local_worker(state, wait_s=wait)
    if pid is None:
        typer.echo(f"no local worker is running for {state}", err=True)
    else:
        typer.echo(f"stopped worker (pid {pid})", err=True)

