"""Where a worker keeps its state, and how clients find it (light: stdlib only).

    $OFFLOAD_JOBS_HOME (default ~/.offload-jobs)/
        token          bearer token, made on the worker's first start
        worker.lock    held (flock) by the running worker
        worker.json    {"url", "pid", "host", "port", "started_at"} of the running worker
        jobs.db        the SQLite store (WAL)
        runs/<id>/     one run dir per job
        models/        models fetched from the hub (the worker's model cache; $OFFLOAD_JOBS_MODEL_CACHE,
                       /models in the container); `offload-jobs models` lists it and the folders
                       of $OFFLOAD_JOBS_MODEL_ROOTS (os.pathsep-separated; jobs.catalog)

The state dir is 0700 and every file in it 0600: specs carry `env:` secrets (HF_TOKEN, ...).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PORT", "DEFAULT_URL", "state_home", "read_token", "ensure_token", "read_worker_info",
           "secure_home", "write_private", "model_cache"]

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


def model_cache(home: Path) -> Path:
    """Where hub models are kept: $OFFLOAD_JOBS_MODEL_CACHE (the container sets /models), else the state dir's."""
    env = os.environ.get("OFFLOAD_JOBS_MODEL_CACHE")
    return Path(env).expanduser() if env else home / "models"


def read_token(home: Path) -> str | None:
    try:
        return (home / TOKEN_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def write_private(path: Path, text: str) -> None:
    """Write `path` atomically with mode 0600 (a temp file beside it, renamed over it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def ensure_token(home: Path) -> str:
    """Read the token, or create it (0600, written atomically) on first start."""
    token = read_token(home)
    if token:
        return token
    secure_home(home)
    token = secrets.token_urlsafe(32)
    write_private(home / TOKEN_FILE, token + "\n")
    return token


_PRIVATE_FILES = ("jobs.db", "jobs.db-wal", "jobs.db-shm", TOKEN_FILE, WORKER_FILE, "worker.log", "worker.lock")


def secure_home(home: Path) -> Path:
    """Make the state dir (0700) or take back its mode, and its own files' (0600).

    A state dir made by an older version (0755, files 0644) is tightened on the next start.
    """
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(home, 0o700)
    runs = home / "runs"
    if runs.is_dir() and not runs.is_symlink():
        os.chmod(runs, 0o700)
    for name in _PRIVATE_FILES:
        p = home / name
        try:
            if not p.is_symlink():
                os.chmod(p, 0o600)
        except FileNotFoundError:
            pass
    return home


def read_worker_info(home: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((home / WORKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None
