"""The locked-down worker: private state, bounded requests, a token that goes only to its own
worker, and run dirs a container cannot use to reach host files (against the real dockerd)."""

from __future__ import annotations

import http.server
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from jobs.client import JobsClient
from jobs.errors import AuthError, RequestTooLarge, WorkerUnreachable


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_state_dir_is_0700_and_its_files_0600(worker_factory, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    os.chmod(home, 0o755)  # as an older version left it
    (home / "token").write_text("old-token\n")
    os.chmod(home / "token", 0o644)
    w = worker_factory(home=home)
    c = w.client()
    job = c.wait(c.submit({"kind": "command", "command": "echo secret", "env": {"HF_TOKEN": "hf_x"}})["id"], timeout=30)
    rd = Path(job["run_dir"])
    assert mode(home) == 0o700 and mode(home / "runs") == 0o700 and mode(rd) == 0o700
    for f in (home / "jobs.db", home / "jobs.db-wal", home / "token", home / "worker.json", rd / "spec.yaml",
              rd / "output.log", rd / "events.jsonl", rd / "metrics.jsonl", rd / "exit.json"):
        assert mode(f) == 0o600, (f, oct(mode(f)))
    assert "hf_x" in (rd / "spec.yaml").read_text()  # the secret is there, and only the owner may read it


def test_up_local_makes_a_private_state_dir(tmp_path: Path) -> None:
    home = tmp_path / "fresh"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(home)
    exe = str(Path(sys.executable).parent / "offload-jobs")
    res = subprocess.run([exe, "up", "--local", "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    try:
        assert res.returncode == 0, res.stderr
        assert mode(home) == 0o700
        for name in ("jobs.db", "token", "worker.json", "worker.log"):
            assert mode(home / name) == 0o600, name
    finally:
        subprocess.run([exe, "down", "--local"], capture_output=True, env=env, timeout=60)


def test_request_size_limit(worker) -> None:
    auth = {"Authorization": f"Bearer {worker.token}"}
    big = {"spec": {"kind": "command", "command": "true", "name": "x", "env": {"BLOB": "x" * (2 << 20)}}}
    r = httpx.post(f"{worker.url}/v1/jobs", json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        yield b'{"spec": {"kind": "command", "command": "' + b"y" * 100
        for _ in range(40):
            yield b"y" * 65536
        yield b'"}}'

    r = httpx.post(f"{worker.url}/v1/jobs", content=chunks(), headers={**auth, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413
    with worker.client() as c:
        with pytest.raises(RequestTooLarge):
            c.submit(big["spec"])
        # a spec under the limit still goes through, and nothing of the refused ones was stored
        assert all(j["name"] != "x" for j in c.list(summary=True))
        ok = c.submit({"kind": "command", "command": "true", "env": {f"V{i}": "z" * 100_000 for i in range(8)}})
        assert ok["status"] == "PENDING"


def test_request_size_limit_through_the_cli(worker, tmp_path: Path) -> None:
    spec = tmp_path / "big.yaml"
    spec.write_text("kind: command\ncommand: 'true'\nenv:\n  A: " + "a" * 120_000 + "\n  B: " + "b" * 120_000 + "\n"
                    + "".join(f"  V{i}: {'c' * 120_000}\n" for i in range(8)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env["OFFLOAD_JOBS_HOME"] = str(worker.home)
    exe = str(Path(sys.executable).parent / "offload-jobs")
    res = subprocess.run([exe, "submit", str(spec), "-d"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "limit" in res.stderr


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        _Recorder.seen.append(dict(self.headers))
        body = json.dumps({"ok": True, "proof": "not-a-proof"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def test_the_token_goes_only_to_the_worker_its_home_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "token").write_text("the-secret-token\n")
    for k in ("OFFLOAD_JOBS_URL", "OFFLOAD_JOBS_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    # No worker.json: no request at all (nothing is guessed, 127.0.0.1:8765 included).
    with pytest.raises(WorkerUnreachable, match="no worker.json"):
        JobsClient.from_env(home)
    # A stale worker.json whose port another program now holds: it never sees the token.
    server = http.server.HTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        (home / "worker.json").write_text(json.dumps({"url": url, "pid": 1}))
        _Recorder.seen.clear()
        with pytest.raises(AuthError, match="cannot prove"):
            JobsClient.from_env(home).list()
        assert _Recorder.seen, "the impostor was asked to prove itself"
        assert all("the-secret-token" not in json.dumps(h) for h in _Recorder.seen)
        # Another worker's URL from the environment gets no token of the state dir's either.
        monkeypatch.setenv("OFFLOAD_JOBS_URL", url.replace("127.0.0.1", "localhost"))
        _Recorder.seen.clear()
        JobsClient.from_env(home).health()
        assert all("authorization" not in {k.lower() for k in h} for h in _Recorder.seen)
    finally:
        server.shutdown()


def test_the_real_worker_proves_itself(worker) -> None:
    with JobsClient.from_env(worker.home) as c:
        assert c.list(summary=True) is not None  # verified, then authorised


# ------------------------------------------------------------------ the symlink attack (docker)

IMAGE = os.environ.get("OFFLOAD_JOBS_TEST_IMAGE", "local/debian:bookworm")


def _docker_ready() -> str | None:
    try:
        import docker

        client = docker.from_env()
        client.ping()
        client.images.get(IMAGE)
    except Exception as exc:
        return f"needs a Docker daemon with {IMAGE} ({type(exc).__name__})"
    return None


@pytest.mark.docker
def test_a_container_cannot_reach_host_files_through_its_run_dir(worker_factory, tmp_path: Path) -> None:
    why = _docker_ready()
    if why:
        pytest.skip(why)
    canary = tmp_path / "host-secret"  # a host file the container never had mounted
    canary.write_text("host secret, never to be served\n")
    before = canary.read_bytes()
    cron = Path("/etc/cron.d") / f"offload-jobs-test-{os.getpid()}"
    assert not cron.exists()
    plant = (f'ln -sf {cron} "$OFFLOAD_JOBS_RUN_DIR/output.log"; '
             f'ln -sf {canary} "$OFFLOAD_JOBS_RUN_DIR/events.jsonl"; '
             f'ln -sf {canary} "$OFFLOAD_JOBS_RUN_DIR/metrics.jsonl"; '
             f'ln -sf {canary} "$OFFLOAD_JOBS_RUN_DIR/report.json"; '
             'echo planted; exit 3')
    w = worker_factory()
    c = w.client()
    job = c.submit({"kind": "command", "command": plant, "executor": "docker", "image": IMAGE,
                    "retry": {"max_attempts": 1}})
    done = c.wait(job["id"], timeout=120)
    rd = Path(done["run_dir"])
    assert (rd / "output.log").is_symlink(), "the container did plant its links"
    assert done["status"] == "FAILED" and done["exit_code"] == 3  # recorded, whatever it planted
    assert not cron.exists(), "the worker wrote through output.log -> /etc/cron.d"
    assert canary.read_bytes() == before, "the worker wrote through a planted link"
    r = httpx.get(f"{w.url}/v1/jobs/{job['id']}/logs", headers={"Authorization": f"Bearer {w.token}"})
    assert r.status_code == 409 and "symbolic link" in r.json()["error"]
    assert "host secret" not in r.text
    m = httpx.get(f"{w.url}/v1/jobs/{job['id']}/metrics", headers={"Authorization": f"Bearer {w.token}"})
    # the run dir's safe reader refuses a planted link outright, as for the log (not an empty answer)
    assert m.status_code == 409 and "symbolic link" in m.json()["error"] and "host secret" not in m.text
    assert "host secret" not in json.dumps(c.get(job["id"]))
    # deleting the job removes the links, never what they point at
    c.delete(job["id"])
    assert not rd.exists() and canary.read_bytes() == before
