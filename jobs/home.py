"""Where a worker keeps its state, and how clients find it (light: stdlib only).

    $OFFLOAD_JOBS_HOME (default ~/.offload-jobs)/
        token          bearer token, mode 0600, made on the worker's first start
        worker.json    {"url", "pid", "host", "port", "started_at"} of the running worker
        jobs.db        the SQLite store (WAL)
        runs/<id>/     one run dir per job
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PORT", "DEFAULT_URL", "state_home", "read_token", "ensure_token", "read_worker_info"]

DEFAULT_PORT = 8765
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
TOKEN_FILE = "token"
WORKER_FILE = "worker.json"


def state_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The state dir: `home`, else $OFFLOAD_JOBS_HOME, else ~/.offload-jobs."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("OFFLOAD_JOBS_HOME")
    return Path(env).expanduser() if env else Path.home() / ".offload-jobs"


def read_token(home: Path) -> str | None:
    try:
        return (home / TOKEN_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def ensure_token(home: Path) -> str:
    """Read the token, or create it (0600, written atomically) on first start."""
    token = read_token(home)
    if token:
        return token
    home.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = home / f".{TOKEN_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, home / TOKEN_FILE)
    return token


def read_worker_info(home: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((home / WORKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
