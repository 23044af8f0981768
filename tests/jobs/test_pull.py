"""`offload-jobs pull MODEL` against a local hub stand-in: advice first, only the needed files, offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_standin import HubStandIn

REPO = Path(__file__).resolve().parents[2]


def _repo(root: Path) -> Path:
    """A diffusers-shaped repo (files need not be loadable: pull only fetches them) plus what it must skip."""
    index = {"_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "scheduler": ["diffusers", "X"],
             "image_encoder": [None, None]}
    files = {"model_index.json": json.dumps(index), "transformer/config.json": "{}",
             "transformer/diffusion_pytorch_model.safetensors": "t" * 5000, "vae/config.json": "{}",
             "vae/diffusion_pytorch_model.safetensors": "v" * 3000, "text_encoder/config.json": "{}",
             "text_encoder/model.safetensors": "e" * 2000, "tokenizer/vocab.json": "{}",
             "scheduler/scheduler_config.json": "{}",
             # skipped: a single-file checkpoint, a legacy twin, a component model_index.json does not name
             "flux1-dev.safetensors": "x" * 9000, "transformer/diffusion_pytorch_model.bin": "b" * 5000,
             "image_encoder/model.safetensors": "i" * 100, "README.md": "# model"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        # distinct bytes each: the hub client stores a blob once per ETag, so twins would be fetched once
        (root / name).write_text(json.dumps({"name": name}) if text == "{}" else text)
    return root


@pytest.fixture
def hub(tmp_path: Path):
    server = HubStandIn()
    server.add("some-org/tiny-flux", _repo(tmp_path / "repo"))
    server.start()
    yield server
    server.stop()


def _pull(tmp: Path, hub: HubStandIn, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_JOBS_", "HF_"))}
    e.update({"OFFLOAD_JOBS_HOME": str(tmp / "home"), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"),
              "HF_HUB_DISABLE_TELEMETRY": "1", **env})
    return subprocess.run([sys.executable, "-m", "jobs.cli", "pull", *args], capture_output=True, text=True,
                          env=e, cwd=REPO, timeout=120)


NEEDED = ["model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
          "text_encoder/model.safetensors", "tokenizer/vocab.json", "transformer/config.json",
          "transformer/diffusion_pytorch_model.safetensors", "vae/config.json", "vae/diffusion_pytorch_model.safetensors"]


def test_pull_prints_advice_then_fetches_only_the_pipeline_files(hub: HubStandIn, tmp_path: Path) -> None:
    res = _pull(tmp_path, hub, "some-org/tiny-flux")
    assert res.returncode == 0, res.stderr
    out = res.stdout.splitlines()
    assert out[0].startswith("disk: ") and "9 files" in out[0] and "GB free in" in out[0]
    assert out[1].startswith("ram: the transformer is 0.00 GB")
    path = Path(out[-1])
    assert path.is_dir() and path.parent.parent.parent == tmp_path / "home" / "models"  # the state dir's cache
    assert sorted(f for _, f, _ in hub.fetched) == NEEDED
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()) == NEEDED

    hub.fetched.clear()
    again = _pull(tmp_path, hub, "some-org/tiny-flux", "--json")
    assert again.returncode == 0, again.stderr
    body = json.loads(again.stdout)
    assert body["to_fetch"] == 0 and len(body["files"]) == 9 and all(f["cached"] for f in body["files"])
    assert 5000 < body["advice"]["transformer_bytes"] < 5100 and body["path"] == str(path)
    assert hub.fetched == []


def test_offline_uses_the_cache_or_says_what_is_missing(hub: HubStandIn, tmp_path: Path) -> None:
    res = _pull(tmp_path, hub, "some-org/tiny-flux", HF_HUB_OFFLINE="1")
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert "HF_HUB_OFFLINE=1" in res.stderr and "no snapshot of some-org/tiny-flux" in res.stderr
    assert hub.fetched == []
    assert _pull(tmp_path, hub, "some-org/tiny-flux").returncode == 0
    hub.fetched.clear()
    offline = _pull(tmp_path, hub, "some-org/tiny-flux", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert "using the cached snapshot" in offline.stdout and hub.fetched == []
    # a partial cache (a component folder gone) is named, offline
    snapshot = Path(offline.stdout.splitlines()[-1])
    import shutil

    shutil.rmtree(snapshot / "vae")
    partial = _pull(tmp_path, hub, "some-org/tiny-flux", HF_HUB_OFFLINE="1")
    assert partial.returncode == 2 and "lacks vae" in partial.stderr


def test_pull_refuses_a_local_path_and_a_missing_repo(hub: HubStandIn, tmp_path: Path) -> None:
    res = _pull(tmp_path, hub, "/models/flux")
    assert res.returncode == 2 and "not a hub id" in res.stderr
    res = _pull(tmp_path, hub, "some-org/no-such-model")
    assert res.returncode == 2 and "neither a folder on the worker nor a model on the hub" in res.stderr
    assert "Traceback" not in res.stderr


def test_no_network_uses_the_cache_or_says_what_is_missing(hub: HubStandIn, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on: the hub cannot be reached
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    res = _pull(tmp_path, hub, "some-org/tiny-flux", HF_ENDPOINT=dead)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "the hub cannot be reached" in res.stderr and "no snapshot of some-org/tiny-flux" in res.stderr
    assert _pull(tmp_path, hub, "some-org/tiny-flux").returncode == 0
    res = _pull(tmp_path, hub, "some-org/tiny-flux", HF_ENDPOINT=dead)
    assert res.returncode == 0, res.stderr
    assert "using the cached snapshot" in res.stdout


def test_what_reads_as_a_hub_id(tmp_path: Path) -> None:
    from jobs.hub import HubRef, parse_hub_id

    assert parse_hub_id("black-forest-labs/FLUX.1-dev") == HubRef("black-forest-labs/FLUX.1-dev", "main")
    assert parse_hub_id("some-org/tiny-flux@v1.0") == HubRef("some-org/tiny-flux", "v1.0")
    for local in ("/models/flux", "./flux", "~/flux", "../models/flux", "flux", "a/b/c", "org/model.safetensors"):
        assert parse_hub_id(local) is None, local
    (tmp_path / "some-org" / "tiny-flux").mkdir(parents=True)  # a folder by that name wins
    assert parse_hub_id("some-org/tiny-flux", tmp_path) is None
