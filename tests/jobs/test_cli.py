"""In-process tests of the `offload-jobs` CLI (typer CliRunner): verbs that need no worker, error
formatting, and job-id prefixes against an httpx MockTransport that answers like a worker."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from jobs.cli import app

REPO = Path(__file__).resolve().parents[2]
VERBS = ("submit", "ps", "show", "logs", "cancel", "retry", "delete", "prune", "validate", "init", "schema",
         "shard", "tui", "worker", "up", "down")

GOOD_SPEC = """\
kind: command
name: hello
command: echo hello
limits:
  max_duration: 1m
"""


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def closed_port_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """OFFLOAD_JOBS_URL pointing at a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("OFFLOAD_JOBS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OFFLOAD_JOBS_URL", url)
    monkeypatch.delenv("OFFLOAD_JOBS_TOKEN", raising=False)
    return url


def one_error_line(result: Any) -> str:
    """The single stderr line of a user error (and no traceback anywhere)."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ------------------------------------------------------------------ help


def test_help_lists_every_verb(runner: CliRunner) -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for verb in VERBS:
        assert f" {verb} " in result.stdout, verb


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(runner: CliRunner, verb: str) -> None:
    result = runner.invoke(app, [verb, "--help"])
    assert result.exit_code == 0, result.output
    assert f"offload-jobs {verb}" in result.stdout
    # A sentence of help, not just the usage line.
    body = result.stdout.split("Usage:", 1)[1]
    assert len(body.split()) > 8


def test_unknown_option_is_one_line(runner: CliRunner) -> None:
    line = one_error_line(runner.invoke(app, ["ps", "--bogus"]))
    assert "--bogus" in line and "offload-jobs ps --help" in line


# ------------------------------------------------------------------ validate / init / schema


def test_validate_good_file(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(GOOD_SPEC)
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "ok"


def test_validate_names_the_field_and_line(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(GOOD_SPEC + "retry:\n  max_attempts: 0\n")
    line = one_error_line(runner.invoke(app, ["validate", str(spec)]))
    assert "retry.max_attempts" in line
    assert f"{spec}:7" in line


def test_validate_set_override_is_checked(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(GOOD_SPEC)
    assert runner.invoke(app, ["validate", str(spec), "--set", "priority=5"]).exit_code == 0
    line = one_error_line(runner.invoke(app, ["validate", str(spec), "--set", "limits.stop_grace=soon"]))
    assert "limits.stop_grace" in line


def test_validate_json(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(GOOD_SPEC)
    ok = runner.invoke(app, ["validate", str(spec), "--json"])
    assert ok.exit_code == 0
    data = json.loads(ok.stdout)
    assert data["ok"] is True and data["kind"] == "command" and data["name"] == "hello"

    spec.write_text("kind: command\ncommand: echo\npriority: high\n")
    bad = runner.invoke(app, ["validate", str(spec), "--json"])
    assert bad.exit_code == 2
    data = json.loads(bad.stdout)
    assert data["ok"] is False and data["field"] == "priority" and data["line"] == 3
    assert len(bad.stderr.strip().splitlines()) == 1


def test_validate_missing_file(runner: CliRunner, tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    line = one_error_line(runner.invoke(app, ["validate", str(missing)]))
    assert str(missing) in line and "no such file" in line


def test_validate_directory(runner: CliRunner, tmp_path: Path) -> None:
    line = one_error_line(runner.invoke(app, ["validate", str(tmp_path)]))
    assert "directory" in line


def test_validate_malformed_yaml(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("kind: command\ncommand: [echo\n")
    line = one_error_line(runner.invoke(app, ["validate", str(spec)]))
    assert "YAML" in line and str(spec) in line


@pytest.mark.parametrize("name", ["train", "infer", "shard", "command"])
def test_examples_validate(runner: CliRunner, name: str) -> None:
    path = REPO / "examples" / f"{name}.yaml"
    if not path.exists():
        pytest.skip(f"{path} not written yet")
    text = path.read_text()
    assert text.startswith("#") and "offload-jobs submit" in text.split("kind:")[0]
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("kind", ["train", "infer", "shard", "command"])
def test_init_writes_a_valid_commented_template(runner: CliRunner, tmp_path: Path, kind: str) -> None:
    out = tmp_path / f"{kind}.yaml"
    result = runner.invoke(app, ["init", "--kind", kind, "--output", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("#") and f"kind: {kind}" in text
    assert runner.invoke(app, ["validate", str(out)]).exit_code == 0


def test_init_to_stdout_and_no_overwrite(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["init", "--kind", "command"])
    assert result.exit_code == 0 and "kind: command" in result.stdout
    out = tmp_path / "x.yaml"
    out.write_text("mine\n")
    line = one_error_line(runner.invoke(app, ["init", "--output", str(out)]))
    assert "already exists" in line and out.read_text() == "mine\n"
    assert runner.invoke(app, ["init", "--output", str(out), "--force"]).exit_code == 0
    assert "kind: train" in out.read_text()


def test_init_rejects_unknown_kind(runner: CliRunner) -> None:
    line = one_error_line(runner.invoke(app, ["init", "--kind", "dance"]))
    assert "--kind" in line


def test_schema_is_json_schema(runner: CliRunner) -> None:
    result = runner.invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert {"kind", "limits", "retry", "offload"} <= set(schema["properties"])


# ------------------------------------------------------------------ placeholders and local tools


def test_tui_placeholder(runner: CliRunner) -> None:
    try:
        import tui.app  # noqa: F401
    except ModuleNotFoundError:
        line = one_error_line(runner.invoke(app, ["tui"]))
        assert "not built yet" in line
    else:
        pytest.skip("the TUI exists now")


def test_tui_launches_the_app_once_it_exists(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    launched: list[bool] = []
    fake = types.ModuleType("tui.app")
    fake.main = lambda read_only=False, **kw: launched.append(read_only)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tui.app", fake)
    result = runner.invoke(app, ["tui", "--read-only"])
    assert result.exit_code == 0, result.output
    assert launched == [True]


def test_shard_missing_source(runner: CliRunner, tmp_path: Path) -> None:
    line = one_error_line(runner.invoke(app, ["shard", str(tmp_path / "none"), str(tmp_path / "dst")]))
    assert "none" in line and "no such file" in line


def _tiny_checkpoint(path: Path) -> Path:
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                   guidance_embeds=False, axes_dims_rope=(4, 4, 8))
    model.save_pretrained(path)
    return path


def test_shard_runs_the_engine_in_process(runner: CliRunner, tmp_path: Path) -> None:
    src = _tiny_checkpoint(tmp_path / "flux")
    result = runner.invoke(app, ["shard", str(src), str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(tmp_path / "out" / "index.json")
    assert (tmp_path / "out" / "index.json").is_file()


def test_shard_corrupt_checkpoint_is_one_line(runner: CliRunner, tmp_path: Path) -> None:
    src = _tiny_checkpoint(tmp_path / "flux")
    weights = next(src.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    line = one_error_line(runner.invoke(app, ["shard", str(src), str(tmp_path / "out")]))
    assert weights.name in line
    assert not (tmp_path / "out" / "index.json").exists()


def test_up_and_down_without_docker(runner: CliRunner, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker binary here
    for verb in ("up", "down"):
        line = one_error_line(runner.invoke(app, [verb]))
        assert "docker is not installed" in line and "up --local" in line


def test_down_local_with_nothing_running(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(app, ["down", "--local", "--home", str(tmp_path)])
    assert result.exit_code == 0
    assert "no local worker" in result.stderr


# ------------------------------------------------------------------ talking to a worker


@pytest.mark.parametrize("argv", [["ps"], ["ps", "--json"], ["show", "abc"], ["logs", "abc"],
                                  ["cancel", "abc"], ["retry", "abc"]])
def test_no_worker_is_one_line(runner: CliRunner, closed_port_env: str, argv: list[str]) -> None:
    line = one_error_line(runner.invoke(app, argv))
    assert closed_port_env in line and "offload-jobs up --local" in line


def test_submit_no_worker_after_validation(runner: CliRunner, closed_port_env: str, tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(GOOD_SPEC)
    line = one_error_line(runner.invoke(app, ["submit", str(spec), "-d"]))
    assert "up --local" in line
    # A bad spec is refused before any worker is contacted.
    spec.write_text("kind: command\n")
    line = one_error_line(runner.invoke(app, ["submit", str(spec), "-d"]))
    assert "a command job needs `command`" in line and "up --local" not in line


FAKE_JOBS = [
    {"id": "abc111", "name": "a", "kind": "command", "status": "RUNNING", "reason": None, "attempt": 1,
     "priority": 0, "created_at": 1.0e9, "started_at": 1.0e9, "finished_at": None, "exit_code": None},
    {"id": "abc222", "name": "b", "kind": "command", "status": "SUCCEEDED", "reason": None, "attempt": 1,
     "priority": 0, "created_at": 1.0e9, "started_at": 1.0e9, "finished_at": 1.0e9 + 5, "exit_code": 0},
    {"id": "def333", "name": "c", "kind": "shard", "status": "FAILED", "reason": "exit_nonzero", "attempt": 2,
     "priority": 3, "created_at": 1.0e9, "started_at": 1.0e9, "finished_at": 1.0e9 + 9, "exit_code": 1},
]


def fake_worker(token: str = "t0k") -> httpx.MockTransport:
    """Answers the few endpoints prefix resolution and listing use, like the worker does."""
    by_id = {j["id"]: j for j in FAKE_JOBS}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != f"Bearer {token}":
            return httpx.Response(401, json={"error": "missing or wrong bearer token"})
        parts = request.url.path.strip("/").split("/")
        if parts == ["v1", "jobs"]:
            status = request.url.params.get("status")
            wanted = set(status.split(",")) if status else None
            jobs = [j for j in FAKE_JOBS if wanted is None or j["status"] in wanted]
            limit = request.url.params.get("limit")
            page = jobs[: int(limit)] if limit else jobs
            return httpx.Response(200, json={"jobs": page, "total": len(jobs)})
        if parts[:2] == ["v1", "jobs"] and len(parts) == 3:
            job = by_id.get(parts[2])
            if job is None:
                return httpx.Response(404, json={"error": "no such job", "job_id": parts[2]})
            return httpx.Response(200, json=job)
        return httpx.Response(404, json={"error": "not found"})

    return httpx.MockTransport(handle)


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs._cli import connect
    from jobs.client import JobsClient

    monkeypatch.setattr(connect, "connect", lambda: JobsClient("http://fake", "t0k", transport=fake_worker()))


def test_show_accepts_a_unique_prefix(runner: CliRunner, fake_client: None) -> None:
    result = runner.invoke(app, ["show", "def", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["id"] == "def333"
    assert {k: data[k] for k in ("name", "kind", "status", "reason", "attempt")} == {
        "name": "c", "kind": "shard", "status": "FAILED", "reason": "exit_nonzero", "attempt": 2}


def test_ambiguous_prefix(runner: CliRunner, fake_client: None) -> None:
    line = one_error_line(runner.invoke(app, ["show", "abc"]))
    assert "ambiguous" in line and "abc111" in line and "abc222" in line


@pytest.mark.parametrize("ref", ["zzz", "a/b", "../v1/jobs", "x y"])
def test_unknown_job(runner: CliRunner, fake_client: None, ref: str) -> None:
    line = one_error_line(runner.invoke(app, ["show", ref]))
    assert f"no job with id {ref!r}" in line


def test_ps_defaults_to_active_jobs(runner: CliRunner, fake_client: None) -> None:
    active = json.loads(runner.invoke(app, ["ps", "--json"]).stdout)
    assert [j["id"] for j in active] == ["abc111"]
    every = json.loads(runner.invoke(app, ["ps", "--json", "--all"]).stdout)
    assert [j["id"] for j in every] == ["abc111", "abc222", "def333"]
    failed = json.loads(runner.invoke(app, ["ps", "--json", "--status", "failed"]).stdout)
    assert [j["id"] for j in failed] == ["def333"]
    line = one_error_line(runner.invoke(app, ["ps", "--status", "DANCING"]))
    assert "--status" in line


def test_ps_table(runner: CliRunner, fake_client: None) -> None:
    result = runner.invoke(app, ["ps", "--all"])
    assert result.exit_code == 0
    for job in FAKE_JOBS:
        assert job["id"] in result.stdout and job["status"] in result.stdout
    assert "exit_nonzero" in result.stdout


def test_bad_token_is_one_line(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    from jobs._cli import connect
    from jobs.client import JobsClient

    monkeypatch.setattr(connect, "connect", lambda: JobsClient("http://fake", "wrong", transport=fake_worker()))
    line = one_error_line(runner.invoke(app, ["ps"]))
    assert "token" in line


# ------------------------------------------------------------------ generated docs


def test_generated_docs_are_current() -> None:
    """docs/cli.md and docs/yaml-reference.md match the app and the schema (rerun scripts/gen_docs.py)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    cli_md = (REPO / "docs" / "cli.md").read_text()
    assert all(f"## `offload-jobs {verb}`" in cli_md for verb in VERBS)
    yaml_md = (REPO / "docs" / "yaml-reference.md").read_text()
    assert "`limits.max_duration` | *duration*" in yaml_md and "`offload.vram_budget` | *size*" in yaml_md
