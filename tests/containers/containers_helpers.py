"""Helpers for the container tests: is Docker (and Compose v2) here, run compose and the host CLI."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The CLI of this checkout, as a user runs it: the venv's console script.
CLI = [sys.executable, "-m", "jobs.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compose_cmd() -> list[str] | None:
    """`docker compose` when Compose v2 runs here, else None."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        ok = subprocess.run([docker, "compose", "version", "--short"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if ok else None


def docker_daemon() -> str | None:
    """None when a Docker daemon answers, else why not."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker binary"
    try:
        res = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker info failed ({type(exc).__name__})"
    return None if res.returncode == 0 else "no Docker daemon reachable"


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def run(cmd: list[str], env: dict[str, str], *, cwd: Path = REPO, timeout: float = 120,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {res.returncode}\nstdout:\n{res.stdout[-3000:]}\n"
                             f"stderr:\n{res.stderr[-3000:]}")
    return res


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any OFFLOAD_*/COMPOSE_* of the developer's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_", "COMPOSE_", "BASE_IMAGE"))}
    env.update(extra)
    return env
