"""The host side of `offload-jobs up`/`down` without a daemon: finding the checkout from anywhere,
.env and its token, and validate's warning for host paths a container cannot see."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from containers_helpers import REPO, compose_cmd
from typer.testing import CliRunner

from jobs._cli import compose
from jobs._cli.output import CliError
from jobs.cli import app


def fake_checkout(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "compose.yaml").write_text("services: {}\n")
    (d / "pyproject.toml").write_text('[project]\nname = "offload-jobs"\n')
    return d


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def test_project_is_found_from_a_subfolder_and_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    co = fake_checkout(tmp_path / "co")
    (co / "examples").mkdir()
    monkeypatch.chdir(co / "examples")
    assert compose.find_project(None, tmp_path / "home").dir == co
    # a compose.yaml of some other project is not ours
    other = tmp_path / "other"
    other.mkdir()
    (other / "compose.yaml").write_text("services: {}\n")
    monkeypatch.chdir(other)
    assert compose.find_project(None, tmp_path / "home").dir == REPO  # the installed package's checkout
    monkeypatch.setenv("OFFLOAD_JOBS_PROJECT", str(co))
    assert compose.find_project(None, tmp_path / "home").dir == co


def test_explicit_file_and_bad_project_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    co = fake_checkout(tmp_path / "co")
    (co / "compose.cpu.yaml").write_text("services: {}\n")
    p = compose.find_project(co / "compose.cpu.yaml", tmp_path)
    assert (p.dir, p.files) == (co, [co / "compose.cpu.yaml"])
    assert p.command(["docker", "compose"], "x") == ["docker", "compose", "-f", str(co / "compose.cpu.yaml"), "-p", "x"]
    with pytest.raises(CliError, match="no such compose file"):
        compose.find_project(tmp_path / "nope.yaml", tmp_path)
    monkeypatch.setenv("OFFLOAD_JOBS_PROJECT", str(tmp_path / "empty"))
    with pytest.raises(CliError, match="OFFLOAD_JOBS_PROJECT=.*no compose.yaml"):
        compose.find_project(None, tmp_path)


def test_down_prefers_the_project_up_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    co = fake_checkout(tmp_path / "co")
    home = tmp_path / "home"
    home.mkdir()
    (home / compose.RECORD_FILE).write_text(json.dumps({"project_dir": str(co), "files": [], "project": "p"}))
    monkeypatch.chdir(REPO)
    assert compose.find_project(None, home).dir == REPO
    assert compose.find_project(None, home, recorded_first=True).dir == co
    # a recorded checkout that has gone is skipped
    (co / "compose.yaml").unlink()
    assert compose.find_project(None, home, recorded_first=True).dir == REPO


def test_read_dotenv(tmp_path: Path) -> None:
    f = tmp_path / ".env"
    f.write_text("# comment\nA=1\nexport B = two words # note\nC='quoted # kept'\nD=\"x\"\nnot a line\nE=\n")
    assert compose.read_dotenv(f) == {"A": "1", "B": "two words", "C": "quoted # kept", "D": "x", "E": ""}
    assert compose.read_dotenv(tmp_path / "missing") == {}


def test_token_goes_into_dotenv_made_from_the_example(tmp_path: Path) -> None:
    co = fake_checkout(tmp_path / "co")
    (co / ".env.example").write_text((REPO / ".env.example").read_text())
    token = compose._write_token(compose.Project(co))
    env_file = co / ".env"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    values = compose.read_dotenv(env_file)
    assert values["OFFLOAD_JOBS_TOKEN"] == token and len(token) >= 32
    assert values["OFFLOAD_DIR"] == "./offload-data"  # the rest of the example is kept
    assert env_file.read_text().count("OFFLOAD_JOBS_TOKEN=") == 1
    # an existing .env without the key gets it appended, its other lines untouched
    env_file.write_text("OFFLOAD_PORT=9000")
    token2 = compose._write_token(compose.Project(co))
    assert compose.read_dotenv(env_file) == {"OFFLOAD_PORT": "9000", "OFFLOAD_JOBS_TOKEN": token2}


def test_published_url() -> None:
    assert compose._published_url({"ports": [{"target": 8765, "published": "9001", "host_ip": "127.0.0.1"}]}) \
        == "http://127.0.0.1:9001"
    assert compose._published_url({"ports": [{"target": 8765, "published": 9002}]}) == "http://127.0.0.1:9002"
    with pytest.raises(CliError, match="publishes no port"):
        compose._published_url({"ports": [{"target": 22, "published": 2222}]})


def write_container_record(home: Path, data_dir: Path, project: Path) -> None:
    home.mkdir(parents=True, exist_ok=True)
    mounts = [{"source": str(data_dir / n), "target": f"/{n}"} for n in ("state", "models", "data", "cache", "outputs")]
    (home / "worker.json").write_text(json.dumps({
        "url": "http://127.0.0.1:1", "host": "127.0.0.1", "port": 1,
        "compose": {"project_dir": str(project), "mounts": mounts,
                    "image_paths": {str(project / "examples"): "/app/examples"}}}))


def test_validate_warns_about_host_paths_the_container_cannot_see(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home, box = tmp_path / "home", tmp_path / "offload-data"
    (box / "models" / "flux").mkdir(parents=True)
    elsewhere = tmp_path / "my-images"
    elsewhere.mkdir()
    monkeypatch.setenv("OFFLOAD_JOBS_HOME", str(home))
    spec = tmp_path / "train.yaml"
    spec.write_text(f"kind: train\nmodel:\n  path: {box}/models/flux\ntrain:\n  dataset: {elsewhere}\n")

    # a local worker (no container recorded): no warning
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and result.stderr == ""

    write_container_record(home, box, REPO)
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and result.stdout.strip() == "ok"  # a warning, not an error
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"warning: model.path: {box}/models/flux exists on this machine")
    assert "write /models/flux" in lines[0]
    assert lines[1].startswith(f"warning: train.dataset: {elsewhere}") and str(box) in lines[1]

    # container paths, and host paths that do not exist here, are left alone
    spec.write_text("kind: train\nmodel:\n  path: /models/flux\ntrain:\n  dataset: /data/nowhere-on-this-host\n")
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0 and result.stderr == ""


def test_validate_json_carries_the_warnings(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("OFFLOAD_JOBS_HOME", str(home))
    write_container_record(home, tmp_path / "offload-data", REPO)
    # examples/toy.yaml's `workdir: .` is a host folder; the image has its own copy of it
    result = runner.invoke(app, ["validate", "--json", str(REPO / "examples" / "toy.yaml")])
    assert result.exit_code == 0
    out = json.loads(result.stdout)
    (warning,) = out["warnings"]
    assert warning.startswith("warning: workdir: ") and "write /app/examples" in warning


def test_up_without_docker_is_one_line(runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = runner.invoke(app, ["up", "--home", str(tmp_path / "home")])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and "docker is not installed" in result.stderr


@pytest.mark.skipif(compose_cmd() is None, reason="Docker Compose v2 is not installed")
def test_up_with_a_missing_compose_file(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["up", "--file", str(tmp_path / "nope.yaml"), "--home", str(tmp_path / "home")])
    assert result.exit_code == 2 and "nope.yaml: no such compose file" in result.stderr
    assert not (tmp_path / "home").exists()  # nothing recorded


@pytest.mark.skipif(compose_cmd() is None, reason="Docker Compose v2 is not installed")
def test_up_refuses_a_local_worker_in_the_same_home(runner: CliRunner, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("OFFLOAD_JOBS_TOKEN", "t" * 32)  # so that `up` does not write the checkout's .env
    monkeypatch.setenv("OFFLOAD_DIR", str(tmp_path / "box"))
    started = runner.invoke(app, ["up", "--local", "--port", "0", "--home", str(home)])
    assert started.exit_code == 0, started.stderr
    try:
        result = runner.invoke(app, ["up", "--home", str(home)])
        assert result.exit_code == 2
        assert "a local worker (pid" in result.stderr and "down --local" in result.stderr
        assert not (tmp_path / "box").exists()  # refused before anything was made or started
    finally:
        runner.invoke(app, ["down", "--local", "--home", str(home)])
