"""`offload-jobs models` (issue 31, item 6): what a REAL worker sees under its model roots.

The model cache (the worker's state dir's models/) holds a hub-cache snapshot of the tiny Flux and a
BFL-layout Flux file already converted into the cache; a second root ($OFFLOAD_JOBS_MODEL_ROOTS)
holds a Wan file in native names (not converted), the tiny Flux's VAE and text encoders as single
files, a LoRA, a truncated file, and a sparse "24 GB" file whose header says so (listed from its
header in a blink: nothing but headers is read). The CLI prints each in a table and as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from jobs_helpers import WorkerProcess
from single_file_helpers import write_bfl, write_wan_native

from jobs.catalog import ROOTS_ENV

REPO = Path(__file__).resolve().parents[3]


def _sparse_transformer(path: Path, gb: int = 24) -> None:
    """A BFL-named header claiming `gb` GB of bf16 (a sparse file: it takes no disk)."""
    n = gb * 10**9 // 2
    header = {"double_blocks.0.img_attn.qkv.weight": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + 2 * n)


@pytest.fixture(scope="module")
def roots(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from jobs.runners.convert import converted_root, converted_transformer
    from jobs.runners.single_file import detect_checkpoint

    base = tmp_path_factory.mktemp("models")
    home, extra = base / "home", base / "extra"
    cache = home / "models"
    shutil.copytree(tiny["flux"], cache / "models--org--tiny-flux" / "snapshots" / "0123456789abcdef")
    flux_file = write_bfl(tiny["flux"] / "transformer", cache / "flux1-tiny.safetensors")
    converted_transformer(detect_checkpoint(flux_file), tiny["flux"], converted_root(cache), say=lambda _: None)
    write_wan_native(tiny["wan"] / "transformer", extra / "checkpoints" / "wan2.1_t2v_tiny.safetensors")
    (extra / "vae").mkdir(parents=True)
    shutil.copy(tiny["flux"] / "vae" / "diffusion_pytorch_model.safetensors", extra / "vae" / "ae.safetensors")
    (extra / "text_encoders").mkdir()
    shutil.copy(tiny["flux"] / "text_encoder" / "model.safetensors", extra / "text_encoders" / "clip_l.safetensors")
    shutil.copy(tiny["flux"] / "text_encoder_2" / "model.safetensors", extra / "text_encoders" / "t5xxl.safetensors")
    shutil.copy(tiny["wan"] / "text_encoder" / "model.safetensors", extra / "text_encoders" / "umt5_xxl.safetensors")
    whole = (extra / "checkpoints" / "wan2.1_t2v_tiny.safetensors").read_bytes()
    (extra / "checkpoints" / "cut.safetensors").write_bytes(whole[: len(whole) // 2])
    _sparse_transformer(extra / "checkpoints" / "flux1-dev-huge.safetensors")
    return {"home": home, "extra": extra, "cache": cache, "flux_file": flux_file}


@pytest.fixture(scope="module")
def worker(roots: dict[str, Path]) -> Iterator[WorkerProcess]:
    w = WorkerProcess(roots["home"], env={ROOTS_ENV: str(roots["extra"])}).start()
    yield w
    w.stop()


def _cli(home: Path, *args: str) -> tuple[int, str, str]:
    import subprocess

    from test_cli_e2e import cli_env, console_script

    p = subprocess.run([console_script(), "models", *args], capture_output=True, text=True, timeout=60,
                       env=cli_env(home), cwd=REPO)
    return p.returncode, p.stdout, p.stderr


def test_models_json_names_each_checkpoint_with_family_layout_dtype_size_and_cache(
        worker: WorkerProcess, roots: dict[str, Path], tiny: dict[str, Path]) -> None:
    rc, out, err = _cli(roots["home"], "--json")
    assert rc == 0, err
    body = json.loads(out)
    assert [r["path"] for r in body["roots"]] == [str(roots["cache"]), str(roots["extra"])]
    by = {m["name"]: m for m in body["models"]}
    assert not [n for n in by if n.startswith(("converted", "shards"))]  # the cache's own entries are not models

    hub = by["org/tiny-flux@0123456789"]
    assert (hub["kind"], hub["field"], hub["family"], hub["layout"], hub["dtype"]) == (
        "pipeline", "model.path", "flux", "diffusers", "F32")
    assert hub["bytes"] == sum(p.stat().st_size for p in tiny["flux"].rglob("*.safetensors"))

    flux = by["flux1-tiny.safetensors"]
    assert (flux["kind"], flux["field"], flux["family"], flux["variant"], flux["layout"], flux["dtype"]) == (
        "transformer", "model.transformer", "flux", "dev", "bfl", "F32")
    assert flux["converted"] is True and flux["bytes"] == roots["flux_file"].stat().st_size

    wan = by["checkpoints/wan2.1_t2v_tiny.safetensors"]
    assert (wan["kind"], wan["family"], wan["layout"], wan["converted"], wan["sharded"]) == (
        "transformer", "wan", "native", False, False)
    huge = by["checkpoints/flux1-dev-huge.safetensors"]
    assert (huge["kind"], huge["dtype"]) == ("unknown", "BF16") and huge["bytes"] > 24 * 10**9
    cut = by["checkpoints/cut.safetensors"]
    assert cut["kind"] == "unknown" and "truncated" in cut["note"]

    expect = {"vae/ae.safetensors": ("vae", "model.vae", "flux", "diffusers"),
              "text_encoders/clip_l.safetensors": ("text_encoder", "model.text_encoders", "flux", "hf"),
              "text_encoders/t5xxl.safetensors": ("text_encoder", "model.text_encoders", "flux", "hf"),
              "text_encoders/umt5_xxl.safetensors": ("text_encoder", "model.text_encoders", "wan", "hf")}
    for name, want in expect.items():
        assert (by[name]["kind"], by[name]["field"], by[name]["family"], by[name]["layout"]) == want, by[name]


def test_models_text_is_a_table_a_root(worker: WorkerProcess, roots: dict[str, Path]) -> None:
    rc, out, err = _cli(roots["home"])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{roots['cache']}: 2 model(s)" and "NAME" in lines[1] and "CACHE" in lines[1]
    row = next(line for line in lines if "flux1-tiny.safetensors" in line)
    assert row.split()[1:5] == ["transformer", "flux", "dev", "bfl"] and row.rstrip().endswith("converted")
    row = next(line for line in lines if "wan2.1_t2v_tiny" in line)
    assert "not converted" in row and "wan" in row and "native" in row
    assert any(line.startswith(f"{roots['extra']}: ") for line in lines)
    assert "truncated" in next(line for line in lines if "cut.safetensors" in line)


def test_a_root_that_is_not_there_says_so(roots: dict[str, Path], tmp_path: Path) -> None:
    from jobs._cli.models import models_text_table
    from jobs.catalog import list_models

    body = list_models(roots["home"], roots=[tmp_path / "nowhere", roots["extra"]])
    text = models_text_table(body)
    assert text.splitlines()[0] == f"{tmp_path / 'nowhere'} (not there)"
    assert os.path.basename(str(roots["extra"])) in text


def test_a_file_rewritten_after_its_conversion_reads_as_not_converted(roots: dict[str, Path]) -> None:
    from jobs.catalog import list_models

    def converted() -> bool | None:
        body = list_models(roots["home"], roots=[roots["cache"]])
        return next(m for m in body["models"] if m["name"] == "flux1-tiny.safetensors")["converted"]

    f = roots["flux_file"]
    st = f.stat()
    assert converted() is True
    try:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the cache's key would differ now
        assert converted() is False
    finally:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
