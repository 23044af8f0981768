"""`model.transformer`: a Flux checkpoint in the BFL or ComfyUI layout, or a Wan 2.1 one in its native
(Comfy-Org) names, converted once, block by block.

The files are the tiny Flux's and Wan's transformers written back with the inverse of diffusers'
converters (single_file_helpers, ours). Detection reads the header alone; the conversion (diffusers' own
converter, one block at a time) gives bitwise the diffusers folder's tensors in the file's dtype,
and a second conversion is a cache hit. Through a real worker, a train and an infer job from each
layout SUCCEED, and the infer images (Wan: frames and GIF) are byte for byte the ones from the
diffusers folder. Bad files
(truncated, no known family, a VAE) are refused at submit naming the file; a file whose header
looks right but whose blocks the converter does not know fails the job (setup_failed). Host RAM
while converting a ~1 GB checkpoint stays under 1.05x its weights (VmHWM in a child process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runner_helpers import events, infer_spec, log, pictures, run_dir, run_job, train_spec
from single_file_helpers import COMFY, diffusers_state, to_bfl, write_bfl, write_wan_native

from jobs.errors import SpecError
from jobs.runners.convert import converted_transformer
from jobs.runners.errors import CheckpointError
from jobs.runners.single_file import detect_checkpoint

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def files(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("single")
    t, w = tiny["flux"] / "transformer", tiny["wan"] / "transformer"
    return {"bfl": write_bfl(t, root / "flux1-tiny.safetensors"),
            "comfy": write_bfl(t, root / "flux1-tiny-comfy.safetensors", prefix=COMFY),
            "wan-native": write_wan_native(w, root / "wan2.1_t2v_tiny.safetensors"),
            "wan-comfy": write_wan_native(w, root / "wan2.1_t2v_tiny-comfy.safetensors", prefix=COMFY), "root": root}


# (family, file) -> the layout detection reports
CASES = {("flux", "bfl"): "bfl", ("flux", "comfy"): "comfy", ("wan", "wan-native"): "native", ("wan", "wan-comfy"): "native"}


def _tiny_config(tiny: dict[str, Path]) -> dict:
    return json.loads((tiny["flux"] / "transformer" / "config.json").read_text())


# ---------------------------------------------------------------------------------- detection


@pytest.mark.parametrize("layout", ["bfl", "comfy"])
def test_the_header_says_layout_family_and_dimensions(tiny: dict[str, Path], files: dict[str, Path], layout: str) -> None:
    det = detect_checkpoint(files[layout])
    assert (det.family, det.layout, det.variant) == ("flux", layout, "dev")
    assert det.prefix == ("" if layout == "bfl" else COMFY)
    want = _tiny_config(tiny)
    for key, value in det.config.items():
        assert value == want[key], key
    assert det.weight_bytes == sum(v.numel() * v.element_size() for v in diffusers_state(tiny["flux"] / "transformer").values())


def test_no_guidance_embedder_reads_as_schnell(tiny: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    bfl = {k: v for k, v in to_bfl(diffusers_state(tiny["flux"] / "transformer")).items() if not k.startswith("guidance_in.")}
    save_file(bfl, str(tmp_path / "schnell.safetensors"))
    det = detect_checkpoint(tmp_path / "schnell.safetensors")
    assert det.variant == "schnell" and det.config["guidance_embeds"] is False


# ---------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("family,name", list(CASES))
def test_conversion_is_the_diffusers_weights_bitwise_and_cached(tiny: dict[str, Path], files: dict[str, Path],
                                                                 tmp_path: Path, family: str, name: str) -> None:
    det = detect_checkpoint(files[name])
    assert (det.family, det.layout, det.prefix) == (family, CASES[family, name], COMFY if "comfy" in name else "")
    got = converted_transformer(det, tiny[family], tmp_path / "converted", say=lambda _: None)
    assert not got.hit and got.written_bytes == det.weight_bytes
    ref, mine = diffusers_state(tiny[family] / "transformer"), diffusers_state(got.path)
    assert mine.keys() == ref.keys()
    for k in ref:
        assert mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]), k
    config = json.loads((got.path / "config.json").read_text())
    want = json.loads((tiny[family] / "transformer" / "config.json").read_text())
    assert {k: config[k] for k in want if not k.startswith("_")} == {k: v for k, v in want.items() if not k.startswith("_")}
    again = converted_transformer(det, tiny[family], tmp_path / "converted", say=lambda _: None)
    assert again.hit and again.path == got.path and again.written_bytes == 0


def test_the_files_dtype_is_kept(tiny: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import save_file

    bfl = {k: v.to(torch.bfloat16) for k, v in to_bfl(diffusers_state(tiny["flux"] / "transformer")).items()}
    save_file(bfl, str(tmp_path / "bf16.safetensors"))
    got = converted_transformer(detect_checkpoint(tmp_path / "bf16.safetensors"), tiny["flux"], tmp_path / "c",
                                say=lambda _: None)
    state = diffusers_state(got.path)
    assert {v.dtype for v in state.values()} == {torch.bfloat16}
    ref = diffusers_state(tiny["flux"] / "transformer")
    assert all(torch.equal(state[k], ref[k].to(torch.bfloat16)) for k in ref)


# ---------------------------------------------------------------------------------- bad files


def _truncated(files: dict[str, Path]) -> Path:
    p = files["root"] / "cut.safetensors"
    data = files["bfl"].read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    return p


def _unknown(files: dict[str, Path]) -> Path:
    from safetensors.torch import save_file

    p = files["root"] / "mystery.safetensors"
    save_file({f"layers.{i}.weight": torch.zeros(2, 2) for i in range(5)}, str(p))
    return p


def _vae(tiny: dict[str, Path], files: dict[str, Path]) -> Path:
    import shutil

    p = files["root"] / "ae.safetensors"
    shutil.copy(tiny["flux"] / "vae" / "diffusion_pytorch_model.safetensors", p)
    return p


def test_bad_files_are_one_line_naming_the_file(tiny: dict[str, Path], files: dict[str, Path]) -> None:
    cases = {"truncated": (_truncated(files), "truncated"), "unknown": (_unknown(files), "no known family: 5 tensors"),
             "vae": (_vae(tiny, files), "is a VAE")}
    for name, (path, words) in cases.items():
        with pytest.raises(CheckpointError) as err:
            detect_checkpoint(path)
        text = str(err.value)
        assert text.startswith("model.transformer: ") and str(path) in text and words in text, (name, text)
        assert "\n" not in text


# ---------------------------------------------------------------------------------- through the worker


def _single(spec: dict, path: Path, tiny: dict[str, Path], family: str = "flux") -> dict:
    spec["model"] = {"path": None, "transformer": str(path), "base": str(tiny[family])}
    return spec



# A train job from one layout of each family (the conversion is the same for train and infer); an infer
# job from every layout. The infer job from a layout no train job converted is the cache miss.
TRAINED = {"bfl", "wan-native"}


@pytest.fixture(scope="module")
def jobs(worker, tiny: dict[str, Path], files: dict[str, Path]) -> dict[str, dict]:
    """A train and an infer job from each file, and the infer job from each diffusers folder (one worker)."""
    out = {}
    with worker.client() as c:
        for family, name in CASES:
            if name in TRAINED:
                train = train_spec(tiny, family, steps=2, save_every=None)
                out[f"train-{name}"] = run_job(c, _single(train, files[name], tiny, family))
            infer = infer_spec(tiny, family, prompt="a red square", steps=2)
            out[f"infer-{name}"] = run_job(c, _single(infer, files[name], tiny, family))
        for family in ("flux", "wan"):
            out[f"infer-folder-{family}"] = run_job(c, infer_spec(tiny, family, prompt="a red square", steps=2))
    return out


@pytest.mark.parametrize("family,name", list(CASES))
def test_train_and_infer_from_a_file_succeed_and_render_the_folders_image(jobs: dict[str, dict], family: str,
                                                                          name: str) -> None:
    train, infer, folder = jobs.get(f"train-{name}"), jobs[f"infer-{name}"], jobs[f"infer-folder-{family}"]
    for job in (train, infer, folder):
        assert job is None or job["status"] == "SUCCEEDED", log(job)[-3000:]
    later = events(infer, "runner.convert")
    if train is None:
        assert len(later) == 1 and later[0]["result"] == "miss" and later[0]["layout"] == CASES[family, name]
    else:
        first = events(train, "runner.convert")
        assert len(first) == 1 and first[0]["result"] == "miss" and first[0]["layout"] == CASES[family, name]
        assert len(later) == 1 and later[0]["result"] == "hit" and later[0]["path"] == first[0]["path"]
        assert (run_dir(train) / "outputs" / "lora.safetensors").is_file()
    assert pictures(infer) and pictures(infer) == pictures(folder)


def test_a_bad_file_is_refused_at_submit_naming_it(worker, tiny: dict[str, Path], files: dict[str, Path]) -> None:
    with worker.client() as c:
        for path, words in [(_truncated(files), "truncated"), (_vae(tiny, files), "is a VAE"),
                            (_unknown(files), "no known family")]:
            with pytest.raises(SpecError) as err:
                c.submit(_single(infer_spec(tiny, "flux"), path, tiny))
            assert err.value.field == "model.transformer" and str(path) in str(err.value) and words in str(err.value)
        with pytest.raises(SpecError) as err:
            c.submit(_single(infer_spec(tiny, "flux"), files["root"] / "nowhere.safetensors", tiny))
        assert err.value.field == "model.transformer" and "does not exist" in str(err.value)
        with pytest.raises(SpecError) as err:  # a Wan file on a Flux base
            c.submit(_single(infer_spec(tiny, "flux"), files["wan-native"], tiny))
        assert err.value.field == "model.transformer" and "is a wan transformer" in str(err.value)
        assert str(tiny["flux"]) in str(err.value)


def test_a_file_the_converter_cannot_read_fails_the_job_naming_it(worker, tiny: dict[str, Path],
                                                                  files: dict[str, Path]) -> None:
    """Its header passes (a Flux, every tensor in the file), but block 1 holds a tensor no converter knows."""
    path = write_bfl(tiny["flux"] / "transformer", files["root"] / "odd.safetensors",
                     extra={"double_blocks.1.img_attn.extra.weight": torch.zeros(2)})
    with worker.client() as c:
        job = run_job(c, _single(infer_spec(tiny, "flux", prompt="a", steps=1), path, tiny))
    assert job["status"] == "FAILED" and job["reason"] == "setup_failed", job
    message = job["message"]
    assert message.startswith("model.transformer: ") and message.count("model.transformer") == 1, message
    assert str(path) in message and "double_blocks.1.img_attn.extra.weight" in message and "\n" not in message
    assert "Traceback" not in log(job)
    converted = run_dir(job).parent.parent / "models" / "converted"
    assert converted.is_dir() and not list(converted.glob("*.partial"))  # no half of the conversion is kept


# ---------------------------------------------------------------------------------- host RAM

_CHILD = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
from jobs.runners.convert import converted_transformer, flux_converter
from jobs.runners.single_file import detect_checkpoint
from jobs.runners.load import free_host_memory

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

import torch, accelerate, offload_core  # the imports loading makes, before the baseline
from jobs.runners.families import get_adapter
from jobs.runners.load import load_transformer
det = detect_checkpoint(sys.argv[1])
flux_converter(det.config["attention_head_dim"] * det.config["num_attention_heads"])
get_adapter("flux").classes()
free_host_memory()
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
before = status("VmRSS")
got = converted_transformer(det, None, Path(sys.argv[2]), say=lambda _: None)
converted = status("VmHWM")
free_host_memory()
loaded = load_transformer(got.path, get_adapter("flux"), torch.float32, torch.device("cpu"),
                          offload={"offload_granularity": "block"}, transformer_dir=got.path)
print(json.dumps({"before": before, "converted": converted, "loaded": status("VmHWM"), "weights": det.weight_bytes,
                  "hit": got.hit, "engine_weight_bytes": loaded.weight_bytes, "seconds": got.seconds}))
"""


def _big_bfl(path: Path, width: int = 512, doubles: int = 14, singles: int = 26, dtype=torch.float32) -> int:
    """A Flux BFL file of real head width (128) and many blocks, about 1 GB, written a block at a time."""
    import accelerate
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    with accelerate.init_empty_weights():
        model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=doubles, num_single_layers=singles,
                                       attention_head_dim=128, num_attention_heads=width // 128, joint_attention_dim=256,
                                       pooled_projection_dim=64, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    shapes = {k: v.shape for k, v in to_bfl(model.state_dict()).items()}
    gen = torch.Generator().manual_seed(0)
    tile = torch.randn(1 << 20, generator=gen).to(dtype)
    tensors = {}
    for k, shape in shapes.items():
        n = shape.numel()
        tensors[k] = tile.repeat(n // tile.numel() + 1)[:n].view(shape).clone()
    save_file(tensors, str(path))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_converting_a_1gb_checkpoint_holds_under_1_05x_its_weights(tmp_path: Path) -> None:
    weights = _big_bfl(tmp_path / "big.safetensors")
    assert weights > 0.9e9
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "big.safetensors"), str(tmp_path / "cache")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    converting, loading = got["converted"] - got["before"], got["loaded"] - got["before"]
    print(f"{weights / 1e9:.2f} GB of weights: peak RSS above the baseline {converting / 1e6:.0f} MB converting "
          f"({converting / weights:.3f}x), {loading / 1e6:.0f} MB converting then loading into the engine "
          f"({loading / weights:.3f}x); converted in {got['seconds']:.1f} s")
    assert not got["hit"] and got["weights"] == weights == got["engine_weight_bytes"]
    assert converting <= 0.25 * weights  # a block at a time, never the model
    assert loading <= 1.05 * weights


# ---------------------------------------------------------------------------------- the spec


def test_the_spec_takes_a_transformer_file_and_names_the_field_of_each_mistake() -> None:
    from jobs._cli.specfile import read_spec
    from jobs.spec import parse_spec

    base = {"kind": "infer", "infer": {"prompt": "a"}}
    m = parse_spec({**base, "model": {"transformer": "/m/flux1-dev.safetensors", "base": "/m/FLUX.1-dev"}}).model
    assert (m.path, m.transformer, m.base) == (None, "/m/flux1-dev.safetensors", "/m/FLUX.1-dev")
    wrong = [({"transformer": "/m/f.safetensors"}, "model.base", "needs `model.base`"),
             ({"transformer": "/m/f.safetensors", "base": "/a", "path": "/b"}, "model.base", "not both"),
             ({"path": "/a", "base": "/b"}, "model.base", "only with `model.transformer`"),
             ({}, "model.path", "needs `model.path`")]
    for model, field, words in wrong:
        with pytest.raises(SpecError) as err:
            parse_spec({**base, "model": model})
        assert err.value.field == field and words in str(err.value), (model, str(err.value))
    spec = read_spec(REPO / "examples" / "train-flux.yaml",
                     ["model.path=null", "model.transformer=/m/flux1-dev.safetensors", "model.base=/m/FLUX.1-dev"])
    assert spec.model.path is None and spec.model.transformer == "/m/flux1-dev.safetensors"


# ---------------------------------------------------------------------------------- offload-jobs shard


def test_offload_jobs_shard_takes_a_bfl_file_and_streams_it_bitwise(tiny: dict[str, Path], files: dict[str, Path],
                                                                   tmp_path: Path, monkeypatch) -> None:
    """`offload-jobs shard flux1.safetensors DST`: converted (into the state dir's model cache), then
    sharded; the engine streaming those shards gives the diffusers folder's output bitwise."""
    from test_loading import _out
    from typer.testing import CliRunner

    from jobs.cli import app
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    monkeypatch.setenv("OFFLOAD_JOBS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OFFLOAD_JOBS_MODEL_CACHE", raising=False)
    res = CliRunner().invoke(app, ["shard", str(files["comfy"]), str(tmp_path / "shards"), "--base", str(tiny["flux"])])
    assert res.exit_code == 0, res.output
    assert "converting" in res.output and str(files["comfy"]) in res.output
    converted = tmp_path / "home" / "models" / "converted"
    assert len([p for p in converted.iterdir() if p.is_dir()]) == 1
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert "transformer_blocks.0" in index["units"] and "single_transformer_blocks.1" in index["units"]
    cpu, adapter = torch.device("cpu"), get_adapter("flux")
    disk = load_transformer(tiny["flux"], adapter, torch.float32, cpu,
                            offload={"offload_granularity": "block", "lazy_load": True, "shard_dir": str(tmp_path / "shards")})
    ram = load_transformer(tiny["flux"], adapter, torch.float32, cpu, offload={"offload_granularity": "block"})
    assert disk.stats()["host_store"] == "disk"
    assert torch.equal(_out("flux", disk.model, torch.float32), _out("flux", ram.model, torch.float32))
    disk.handle.remove()
    ram.handle.remove()
    # a file of no family we convert is sharded by its own names, as before: nothing converted
    other = CliRunner().invoke(app, ["shard", str(_vae(tiny, files)), str(tmp_path / "vae-shards")])
    assert other.exit_code == 0, other.output
    assert "converting" not in other.output and len([p for p in converted.iterdir() if p.is_dir()]) == 1


def test_wan_heads_come_from_the_base_or_are_refused_by_name(files: dict[str, Path], tiny: dict[str, Path]) -> None:
    from jobs.runners.convert import transformer_config

    det = detect_checkpoint(files["wan-native"])  # 24 wide: the file cannot say 2 heads of 12
    config = transformer_config(det, tiny["wan"])
    assert (config["num_attention_heads"], config["attention_head_dim"]) == (2, 12)
    with pytest.raises(CheckpointError) as err:
        transformer_config(det, None)
    assert str(files["wan-native"]) in str(err.value) and "attention_head_dim" in str(err.value)


def test_a_diffusers_named_transformer_is_taken_as_it_is_or_converted_from_a_prefix(tiny: dict[str, Path],
                                                                                 tmp_path: Path) -> None:
    """A diffusers transformer folder (config.json beside it) is read in place; one file of diffusers
    names under a prefix is renamed (no converter) into the cache, bitwise."""
    from safetensors.torch import save_file

    from jobs.runners.convert import transformer_folder

    run = tmp_path / "home" / "runs" / "job1"
    run.mkdir(parents=True)
    folder = tiny["flux"] / "transformer"
    assert transformer_folder(tiny["flux"], folder, run, say=lambda _: None) == folder
    assert not (run / "events.jsonl").exists()
    ref = diffusers_state(folder)
    save_file({"transformer." + k: v for k, v in ref.items()}, str(tmp_path / "prefixed.safetensors"))
    det = detect_checkpoint(tmp_path / "prefixed.safetensors")
    assert (det.layout, det.prefix) == ("diffusers", "transformer.")
    got = transformer_folder(tiny["flux"], tmp_path / "prefixed.safetensors", run, say=lambda _: None)
    assert got.parent == tmp_path / "home" / "models" / "converted"
    mine = diffusers_state(got)
    assert mine.keys() == ref.keys() and all(torch.equal(mine[k], ref[k]) for k in ref)
    assert json.loads((run / "events.jsonl").read_text())["type"] == "runner.convert"
