"""`model.path: org/name` through a real worker and a local stand-in for the hub (HF_ENDPOINT).

Only the files a pipeline loads are fetched (counted on the server), a second job fetches 0 bytes,
a gated repo without a token fails at setup naming HF_TOKEN, and the token shows up nowhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn
from jobs_helpers import WorkerProcess
from runner_helpers import events, log, run_dir, train_spec

REPO = Path(__file__).resolve().parents[3]
SECRET = "hf_standin_secret_5b1f0c"  # the gated repo's token: must show up in no output


@pytest.fixture(scope="module")
def hub(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hubrepo")
    repo = root / "tiny-flux"
    shutil.copytree(tiny["flux"], repo)
    # what a real repo carries beside the diffusers folders: none of it may be fetched
    (repo / "flux1-tiny.safetensors").write_bytes(b"\0" * 4096)   # the single-file checkpoint
    (repo / "ae.safetensors").write_bytes(b"\0" * 1024)
    (repo / "README.md").write_text("# tiny flux\n")
    (repo / "transformer" / "diffusion_pytorch_model.bin").write_bytes(b"\0" * 2048)  # a legacy format twin
    (repo / "extras").mkdir()
    (repo / "extras" / "config.json").write_text("{}")           # a folder model_index.json does not name
    server = HubStandIn()
    server.add("some-org/tiny-flux", repo)
    server.add("some-org/gated-flux", repo, gated_token=SECRET)
    server.start()
    needed = sorted(p.relative_to(tiny["flux"]).as_posix() for p in tiny["flux"].rglob("*") if p.is_file())
    yield server, needed
    server.stop()


def _worker(tmp: Path, hub: HubStandIn, **env: str) -> WorkerProcess:
    base = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(tmp / "hf-home")}
    clean = {k: "" for k in ("HF_TOKEN", "HF_HUB_OFFLINE")}
    return WorkerProcess(tmp / "home", env={**clean, **base, **env}).start()


def _hub_spec(tiny: dict[str, Path], model: str) -> dict:
    spec = train_spec(tiny, "flux", steps=2, save_every=None, sample_every=None)
    spec["model"] = {"path": model}
    return spec


def test_a_train_job_fetches_only_what_it_needs_once(hub, tiny: dict[str, Path], tmp_path: Path) -> None:
    server, needed = hub
    w = _worker(tmp_path, server)
    try:
        with w.client() as c:
            server.fetched.clear()
            first = c.wait(c.submit(_hub_spec(tiny, "some-org/tiny-flux"))["id"], timeout=300)
            assert first["status"] == "SUCCEEDED", (first.get("message"), log(first)[-3000:])
            assert sorted(f for _, f, _ in server.fetched) == needed  # each needed file once; no checkpoint
            fetched_bytes = sum(n for *_, n in server.fetched)
            start = events(first, "runner.model_fetch")[0]
            ready = events(first, "runner.model_ready")[0]
            assert start["files"] == len(needed) and start["model"] == "some-org/tiny-flux"
            cache = w.home / "models" / "models--some-org--tiny-flux" / "snapshots"
            assert Path(ready["path"]).parent == cache
            assert "model some-org/tiny-flux:" in log(first)  # progress in the job's log

            server.fetched.clear()
            second = c.wait(c.submit(_hub_spec(tiny, "some-org/tiny-flux"))["id"], timeout=300)
            assert second["status"] == "SUCCEEDED", second.get("message")
            assert server.fetched == []  # 0 bytes: the cache answered
            assert events(second, "runner.model_ready")[0]["fetched_bytes"] == 0
            print(f"first job fetched {len(needed)} files, {fetched_bytes} bytes; the second 0")
    finally:
        w.stop()


def _cli(w: WorkerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
    env.update(OFFLOAD_JOBS_URL=w.url, OFFLOAD_JOBS_TOKEN=w.token, OFFLOAD_JOBS_HOME=str(w.home))
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=120)


def test_a_gated_model_needs_the_token_and_never_shows_it(hub, tiny: dict[str, Path], tmp_path: Path) -> None:
    server, _ = hub
    w = _worker(tmp_path / "no-token", server)
    try:
        with w.client() as c:
            job = c.wait(c.submit(_hub_spec(tiny, "some-org/gated-flux"))["id"], timeout=180)
    finally:
        w.stop()
    assert (job["status"], job["reason"]) == ("FAILED", "setup_failed")
    assert "HF_TOKEN" in job["message"] and "gated" in job["message"] and "\n" not in job["message"]
    assert "Traceback" not in log(job)

    token_file = tmp_path / "hf_token"
    token_file.write_text(SECRET + "\n")  # a secret file, as Docker secrets give it
    w = _worker(tmp_path / "with-token", server, OFFLOAD_JOBS_HF_TOKEN_FILE=str(token_file))
    try:
        with w.client() as c:
            job = c.wait(c.submit(_hub_spec(tiny, "some-org/gated-flux"))["id"], timeout=300)
            assert job["status"] == "SUCCEEDED", (job.get("message"), log(job)[-3000:])
            assert f"Bearer {SECRET}" in server.auth_seen  # the token was used
            from tui.report import build_report

            report = build_report(c, job["id"])
        seen = {"ps --json": _cli(w, "ps", "--all", "--json").stdout, "show --json": _cli(w, "show", job["id"], "--json").stdout,
                "show": _cli(w, "show", job["id"]).stdout, "logs": _cli(w, "logs", job["id"]).stdout,
                "report": report, "events.jsonl": (run_dir(job) / "events.jsonl").read_text(),
                "output.log": log(job), "worker log": w.log.read_text(errors="replace")}
        assert json.loads(seen["ps --json"])  # the verbs answered
        for where, text in seen.items():
            assert SECRET not in text, f"the token is in {where}"
    finally:
        w.stop()


def test_a_hub_base_for_a_transformer_file_fetches_no_transformer_weights(hub, tiny: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    """`model.base: org/name` with `model.transformer` a file: the base's transformer/ gives only its
    config.json (the weights come from the file), every other part is fetched as before."""
    from single_file_helpers import write_bfl

    server, needed = hub
    bfl = write_bfl(tiny["flux"] / "transformer", tmp_path / "flux1-tiny-bfl.safetensors")
    spec = _hub_spec(tiny, "some-org/tiny-flux")
    spec["model"] = {"path": None, "base": "some-org/tiny-flux", "transformer": str(bfl)}
    w = _worker(tmp_path, server)
    try:
        with w.client() as c:
            server.fetched.clear()
            job = c.wait(c.submit(spec)["id"], timeout=300)
    finally:
        w.stop()
    assert job["status"] == "SUCCEEDED", (job.get("message"), log(job)[-3000:])
    fetched = sorted(f for _, f, _ in server.fetched)
    assert fetched == [f for f in needed if not f.startswith("transformer/") or f == "transformer/config.json"]
    assert events(job, "runner.convert")[0]["result"] == "miss"
