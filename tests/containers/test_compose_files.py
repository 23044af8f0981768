"""compose.yaml alone (GPU reservation) and with compose.cpu.yaml: `docker compose config` accepts
both, and the resolved model has what the worker needs. Needs the Compose v2 CLI, not a daemon."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from containers_helpers import REPO, clean_env, compose_cmd, run

COMPOSE = compose_cmd()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="Docker Compose v2 (`docker compose`) is not installed")


def config(tmp_path: Path, *files: str, **env: str) -> dict[str, Any]:
    assert COMPOSE is not None
    # --env-file /dev/null: the defaults of the files themselves, whatever .env a developer has
    args = ["--env-file", "/dev/null", *(a for f in files for a in ("-f", f))]
    # -q first: the acceptance check as a user types it
    run([*COMPOSE, *args, "config", "-q"], clean_env(**env), cwd=REPO)
    out = run([*COMPOSE, *args, "config", "--format", "json"], clean_env(**env), cwd=REPO).stdout
    return json.loads(out)["services"]["worker"]


@needs_compose
def test_gpu_compose_file_validates_with_its_reservation(tmp_path: Path) -> None:
    w = config(tmp_path, "compose.yaml")
    (dev,) = w["deploy"]["resources"]["reservations"]["devices"]
    assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"] and dev["count"] == -1  # "all"
    # the count comes from .env / the environment
    w = config(tmp_path, "compose.yaml", OFFLOAD_GPUS="1")
    assert w["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1


@needs_compose
def test_cpu_override_drops_the_reservation_only(tmp_path: Path) -> None:
    gpu = config(tmp_path, "compose.yaml")
    cpu = config(tmp_path, "compose.yaml", "compose.cpu.yaml")
    assert "deploy" not in cpu
    assert cpu["environment"]["OFFLOAD_JOBS_GPUS"] == "0"
    for key in ("ports", "volumes", "user", "command", "shm_size", "restart", "init", "image"):
        assert cpu[key] == gpu[key], key


@needs_compose
def test_worker_service_defaults(tmp_path: Path) -> None:
    w = config(tmp_path, "compose.yaml")
    (port,) = w["ports"]
    assert (port["host_ip"], port["target"], str(port["published"])) == ("127.0.0.1", 8765, "8765")
    assert "--host=0.0.0.0" in w["command"] and "--port=8765" in w["command"]
    assert w["user"] == "1000:1000" and w["restart"] == "unless-stopped" and w["init"] is True
    assert int(w["shm_size"]) == 8 * 2**30 and w.get("ipc") is None  # see compose.yaml for why not ipc: host
    mounts = {v["target"]: Path(v["source"]) for v in w["volumes"]}
    assert set(mounts) == {"/state", "/models", "/data", "/cache", "/outputs"}
    assert {p.parent for p in mounts.values()} == {REPO / "offload-data"}  # one host folder
    assert {p.name for p in mounts.values()} == {"state", "models", "data", "cache", "outputs"}
    assert w["environment"]["OFFLOAD_JOBS_TOKEN"] == ""  # no token in the file itself


@needs_compose
def test_options_come_from_dotenv(tmp_path: Path) -> None:
    # compose reads the project's .env; --env-file stands in for it so the checkout is not touched
    env_file = tmp_path / "env"
    env_file.write_text(f"OFFLOAD_JOBS_TOKEN=s3cret\nOFFLOAD_PORT=9999\nOFFLOAD_DIR={tmp_path}/box\n"
                        "OFFLOAD_UID=1234\nOFFLOAD_GID=99\nOFFLOAD_SHM_SIZE=1gb\nOFFLOAD_MAX_CPU_JOBS=2\n"
                        "BASE_IMAGE=local/debian:bookworm\n")
    assert COMPOSE is not None
    out = run([*COMPOSE, "--env-file", str(env_file), "config", "--format", "json"], clean_env(), cwd=REPO).stdout
    w = json.loads(out)["services"]["worker"]
    assert w["environment"]["OFFLOAD_JOBS_TOKEN"] == "s3cret"
    assert str(w["ports"][0]["published"]) == "9999" and w["ports"][0]["host_ip"] == "127.0.0.1"
    assert {Path(v["source"]).parent for v in w["volumes"]} == {tmp_path / "box"}
    assert w["user"] == "1234:99" and int(w["shm_size"]) == 2**30 and "--max-cpu-jobs=2" in w["command"]
    assert w["build"]["args"] == {"BASE_IMAGE": "local/debian:bookworm"}


def test_dockerfile_shape() -> None:
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=pytorch/pytorch:\S+-cuda\S+-runtime$", text, re.M)
    assert re.search(r"^USER 1000:1000$", text, re.M)  # the last USER: non-root
    assert text.rfind("USER 1000:1000") > text.rfind("USER root")
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert '"offload-jobs", "worker"' in text
    # the dependency layer comes before any source
    assert text.index("COPY pyproject.toml .ct[x]") < text.index("COPY --from=deps") < text.index("COPY jobs")


def test_build_context_and_git_keep_secrets_and_data_out() -> None:
    ignored = (REPO / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "offload-data", ".env", "**/__pycache__"):
        assert entry in ignored, entry
    assert ".ctx" not in ignored  # the build reads certificates and wheels from it
    gitignore = (REPO / ".gitignore").read_text().split()
    for entry in ("/.ctx/", "/.env", "/offload-data/"):
        assert entry in gitignore, entry
    example = (REPO / ".env.example").read_text()
    assert re.search(r"^OFFLOAD_JOBS_TOKEN=$", example, re.M)  # never a committed token
