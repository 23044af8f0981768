"""compose.yaml's profiles: `single` (no profile: the worker alone on SQLite, as before) and `cluster`
(a Postgres service the worker shares with other hosts'). `docker compose config` only: no daemon,
no image pulled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _compose() -> list[str] | None:
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        ok = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [docker, "compose"] if ok else None


COMPOSE = _compose()
pytestmark = pytest.mark.skipif(COMPOSE is None, reason="Docker Compose v2 (`docker compose`) is not installed")


def config(*files: str, **env: str) -> dict:
    assert COMPOSE is not None
    clean = {k: v for k, v in os.environ.items() if not (k.startswith("OFFLOAD") or k.startswith("COMPOSE"))}
    args = ["--env-file", "/dev/null", *(a for f in files for a in ("-f", f))]
    for extra in (["config", "-q"], ["config", "--format", "json"]):
        res = subprocess.run([*COMPOSE, *args, *extra], cwd=REPO, env={**clean, **env}, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)["services"]


@pytest.mark.parametrize("files", [("compose.yaml",), ("compose.yaml", "compose.cpu.yaml")])
def test_no_profile_is_the_single_worker_on_sqlite(files: tuple[str, ...]) -> None:
    services = config(*files)
    assert set(services) == {"worker"}
    env = services["worker"]["environment"]
    assert env["OFFLOAD_JOBS_DB"] == ""  # empty: the state dir's SQLite, as before
    assert services["worker"]["depends_on"]["postgres"]["required"] is False


def test_the_cluster_profile_adds_postgres_on_loopback() -> None:
    url = "postgresql+psycopg://offload:pw@postgres:5432/offload"
    services = config("compose.yaml", "compose.cpu.yaml", COMPOSE_PROFILES="cluster", OFFLOAD_PG_PASSWORD="pw",
                      OFFLOAD_JOBS_DB=url, OFFLOAD_WORKER_ID="box-1")
    assert set(services) == {"worker", "postgres"}
    pg, worker = services["postgres"], services["worker"]
    assert pg["environment"]["POSTGRES_PASSWORD"] == "pw" and pg["environment"]["POSTGRES_USER"] == "offload"
    (port,) = pg["ports"]
    assert (port["host_ip"], port["target"]) == ("127.0.0.1", 5432)
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    assert any(v["target"] == "/var/lib/postgresql/data" for v in pg["volumes"])
    assert worker["environment"]["OFFLOAD_JOBS_DB"] == url and worker["environment"]["OFFLOAD_JOBS_WORKER_ID"] == "box-1"
    assert worker["depends_on"]["postgres"]["condition"] == "service_healthy"
