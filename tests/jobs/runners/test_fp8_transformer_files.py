"""`model.transformer` fp8 files: Flux stored as plain float8_e4m3fn, and ComfyUI's scaled fp8 (a
`scale_weight` beside each weight, `scale_input`, a `scaled_fp8` marker).

The tiny Flux's weights are quantized in diffusers' names (the q, k and v that BFL fuses share one
scale, as a scaled file's fused qkv has one) and written back in the BFL layout. The conversion keeps
a block's fp8 weights and their scales as stored; the loader hands them to the engine, which streams
them as stored (its host store holds the fp8 bytes) and widens them where they compute. Through a
real worker: an infer job from each layout SUCCEEDS and renders bitwise the image of the same job on
a diffusers folder holding the fp8-widened weights (written here); a train job from the scaled file
SUCCEEDS.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from runner_helpers import infer_spec, log, pictures, run_dir, run_job, train_spec
from single_file_helpers import COMFY, diffusers_state, to_bfl

from jobs.contract import Metric
from jobs.runners.convert import converted_transformer
from jobs.runners.single_file import detect_checkpoint

FP8 = torch.float8_e4m3fn


def _sources(sd: dict[str, torch.Tensor]) -> dict[str, str]:
    """diffusers weight name -> the BFL tensor it ends up in (to_bfl run on (rows, 1) tags)."""
    names = sorted(k for k, v in sd.items() if k.endswith(".weight") and v.dim() >= 2)
    tags = {k: torch.full((sd[k].shape[0], 1), float(i)) for i, k in enumerate(names)}
    rest = {k: torch.zeros(v.shape[0] if v.dim() else 1, 1) - 1 for k, v in sd.items() if k not in tags}
    out = {}
    for b, t in to_bfl({**tags, **rest}).items():
        for i in t.unique().tolist():
            if i >= 0:
                out[names[int(i)]] = b
    return out


def quantized(transformer: Path, scaled: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the fp8 diffusers state, the BFL scales by BFL weight name, the widened diffusers state)."""
    sd = diffusers_state(transformer)
    src = _sources(sd)
    scales: dict[str, torch.Tensor] = {}
    if scaled:  # one scale per BFL tensor, from the amax of what it fuses; unequal, so a mixed-up scale shows
        for i, b in enumerate(sorted(set(src.values()))):
            amax = max(float(sd[d].abs().max()) for d in src if src[d] == b)
            scales[b] = torch.tensor(amax / 448.0 * (1.0 + 0.01 * i), dtype=torch.float32)
    fp8, widened = dict(sd), dict(sd)
    for d, b in src.items():
        s = scales.get(b)
        fp8[d] = (sd[d] / s if s is not None else sd[d]).to(FP8)
        widened[d] = fp8[d].float() * s if s is not None else fp8[d].float()
    return fp8, scales, widened


def write_fp8_file(transformer: Path, dst: Path, scaled: bool, prefix: str = "") -> dict[str, torch.Tensor]:
    """The fp8 BFL file; returns the widened diffusers state it stands for."""
    from safetensors.torch import save_file

    fp8, scales, widened = quantized(transformer, scaled)
    out = {prefix + k: v for k, v in to_bfl(fp8).items()}
    for b, s in scales.items():
        out[prefix + b.removesuffix(".weight") + ".scale_weight"] = s
        out[prefix + b.removesuffix(".weight") + ".scale_input"] = torch.tensor(1.0)
    if scaled:
        out["scaled_fp8"] = torch.empty(0, dtype=FP8)
    save_file(out, str(dst))
    return widened


def write_reference(base: Path, widened: dict[str, torch.Tensor], dst: Path) -> Path:
    """`base` with its transformer replaced by the widened weights (the other parts linked)."""
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    for p in base.iterdir():
        if p.name != "transformer":
            (dst / p.name).symlink_to(p)
    (dst / "transformer").mkdir()
    shutil.copy(base / "transformer" / "config.json", dst / "transformer" / "config.json")
    save_file(widened, str(dst / "transformer" / "diffusion_pytorch_model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def fp8_files(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """layout -> (the fp8 file, the diffusers folder of its widened weights)."""
    root = tmp_path_factory.mktemp("fp8")
    t = tiny["flux"] / "transformer"
    out = {}
    for name, scaled, prefix in (("plain", False, COMFY), ("scaled", True, "")):
        f = root / f"flux1-tiny-{name}-fp8.safetensors"
        widened = write_fp8_file(t, f, scaled, prefix)
        out[name] = (f, write_reference(tiny["flux"], widened, root / f"ref-{name}"))
    return out


def test_conversion_keeps_the_blocks_fp8_with_their_scales(tiny: dict[str, Path], fp8_files, tmp_path: Path) -> None:
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    f, ref = fp8_files["scaled"]
    det = detect_checkpoint(f)
    assert (det.family, det.layout, det.fp8) == ("flux", "bfl", "scaled") and "scaled fp8" in det.describe()
    got = converted_transformer(det, tiny["flux"], tmp_path / "c", say=lambda _: None)
    state, want = diffusers_state(got.path), diffusers_state(ref / "transformer")
    assert state["transformer_blocks.0.attn.to_q.weight"].dtype == FP8
    assert "transformer_blocks.0.attn.to_q.scale_weight" in state and "scaled_fp8" not in state
    assert not any(k.endswith("scale_input") for k in state)
    assert state["x_embedder.weight"].dtype == torch.float32  # outside the blocks: widened at conversion
    for k, v in want.items():  # each weight as stored times its own scale is the widened one
        s = state.get(k.removesuffix(".weight") + ".scale_weight")
        mine = state[k].float() * s if s is not None else state[k].float()
        assert torch.equal(mine, v), k
    loaded = load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, torch.device("cpu"),
                              offload={"offload_granularity": "block"}, transformer_dir=got.path)
    try:
        units = loaded.handle.engine.streamed
        kept = [ts for u in units for ts in u.tensors if ts.store_dtype == FP8]
        assert kept and all(ts.native_dtype == FP8 and ts.dtype == torch.float32 for ts in kept)
        assert {ts.scale for ts in kept if ts.attr == "weight"} - {None}  # the scales reached the engine
        assert all(ts.store_nbytes == math.prod(ts.shape) for ts in kept)  # one byte a weight on the host
        assert loaded.handle.engine.store.used_bytes == sum(ts.store_nbytes + ts.scale_nbytes for u in units
                                                            for ts in u.tensors)
    finally:
        loaded.handle.remove()


# ---------------------------------------------------------------------------------- through the worker


def _single(spec: dict, path: Path, base: Path) -> dict:
    spec["model"] = {"path": None, "transformer": str(path), "base": str(base)}
    return spec



@pytest.fixture(scope="module")
def fp8_jobs(worker, tiny: dict[str, Path], fp8_files) -> dict[str, dict]:
    out = {}
    one = {"prompt": "a red square", "steps": 2}
    with worker.client() as c:
        for name, (f, ref) in fp8_files.items():
            out[f"file-{name}"] = run_job(c, _single(infer_spec(tiny, "flux", **one), f, tiny["flux"]))
            folder = infer_spec(tiny, "flux", **one)
            folder["model"]["path"] = str(ref)
            out[f"folder-{name}"] = run_job(c, folder)
        train = train_spec(tiny, "flux", steps=2, save_every=None)
        out["train-scaled"] = run_job(c, _single(train, fp8_files["scaled"][0], tiny["flux"]))
    return out


@pytest.mark.parametrize("name", ["plain", "scaled"])
def test_infer_from_an_fp8_file_renders_the_widened_folders_image(fp8_jobs: dict[str, dict], name: str) -> None:
    job, folder = fp8_jobs[f"file-{name}"], fp8_jobs[f"folder-{name}"]
    for j in (job, folder):
        assert j["status"] == "SUCCEEDED", log(j)[-3000:]
    assert "fp8 block weights" in log(job) and "kept as stored" in log(job)
    assert pictures(job) and pictures(job) == pictures(folder)


def test_train_from_a_scaled_fp8_file_succeeds(fp8_jobs: dict[str, dict]) -> None:
    job = fp8_jobs["train-scaled"]
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert "kept as stored" in log(job)
    assert (run_dir(job) / "outputs" / "lora.safetensors").is_file()
    losses = [json.loads(line).get(Metric.loss) for line in (run_dir(job) / "metrics.jsonl").read_text().splitlines()]
    assert any(v is not None for v in losses)


def engine_outputs(tiny: dict[str, Path], fp8_files, tmp_path: Path, device: torch.device, dtype: torch.dtype,
                   resident: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The scaled file's converted transformer and the widened folder's, each on the engine (with
    every unit resident with `resident`: cpu_offload off): their outputs, and how many fp8 weights stayed fp8 in the host store."""
    from test_loading import _out

    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    f, ref = fp8_files["scaled"]
    got = converted_transformer(detect_checkpoint(f), tiny["flux"], tmp_path / "c", say=lambda _: None)
    offload = {"offload_granularity": "block", **({"cpu_offload": False} if resident else {})}
    outs, kept = [], 0
    for folder in (got.path, ref / "transformer"):
        loaded = load_transformer(tiny["flux"], get_adapter("flux"), dtype, device, offload=offload,
                                  transformer_dir=folder)
        try:
            kept += sum(ts.store_dtype == FP8 for u in loaded.handle.engine.streamed for ts in u.tensors)
            outs.append(_out("flux", loaded.model, dtype, device).float().cpu())
        finally:
            loaded.handle.remove()
    return outs[0], outs[1], kept


@pytest.mark.parametrize("resident", [False, True])
def test_blocks_kept_resident_are_widened_once_and_compute_the_same(tiny: dict[str, Path], fp8_files, tmp_path: Path,
                                                                    resident: bool) -> None:
    mine, ref, kept = engine_outputs(tiny, fp8_files, tmp_path, torch.device("cpu"), torch.float32, resident)
    assert kept == (0 if resident else 40) and torch.equal(mine, ref)


def test_a_lora_to_fuse_into_fp8_weights_is_refused_by_name(tiny: dict[str, Path], fp8_files, tmp_path: Path) -> None:
    from jobs.runners.errors import SetupError
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    got = converted_transformer(detect_checkpoint(fp8_files["plain"][0]), tiny["flux"], tmp_path / "c", say=lambda _: None)
    with pytest.raises(SetupError) as err:
        load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, torch.device("cpu"),
                         offload={"offload_granularity": "block"}, transformer_dir=got.path, with_weights=lambda m: None)
    assert str(err.value).startswith("infer.lora: ") and str(got.path) in str(err.value) and "\n" not in str(err.value)


def _shard_outputs(tiny: dict[str, Path], fp8_files, tmp_path: Path, dtype: str | None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The scaled file converted and sharded (as `offload-jobs shard` does), lazy-loaded on the engine,
    against the widened folder's weights on the engine: their outputs, and the shards' index."""
    from test_loading import _out

    from jobs.runners.convert import shard_source
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer
    from offload_core.shard import shard_checkpoint

    f, ref = fp8_files["scaled"]
    src = shard_source(f, tiny["flux"], tmp_path / "cache")
    shards = tmp_path / "shards"
    shard_checkpoint(str(src), str(shards), dtype=dtype, progress=False)
    outs = []
    for folder, off in ((src, {"lazy_load": True, "shard_dir": str(shards)}), (ref / "transformer", {})):
        loaded = load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, torch.device("cpu"),
                                  offload={"offload_granularity": "block", **off}, transformer_dir=folder)
        try:
            outs.append(_out("flux", loaded.model, torch.float32))
        finally:
            loaded.handle.remove()
    return outs[0], outs[1], json.loads((shards / "index.json").read_text())


@pytest.mark.parametrize("dtype", [None, "float32"])
def test_shards_of_a_scaled_file_keep_its_scales(tiny: dict[str, Path], fp8_files, tmp_path: Path,
                                                 dtype: str | None) -> None:
    """Sharded as stored, each fp8 weight keeps its scale_weight as its fp8 scale; sharded widened, the
    scale is applied: either way lazy_load computes the widened folder's output bitwise (the shards
    held the bare fp8 values before: off by their scales)."""
    got, want, index = _shard_outputs(tiny, fp8_files, tmp_path, dtype)
    tensors = {n: t for u in index["units"].values() for n, t in u["tensors"].items()}
    fp8 = [t for t in tensors.values() if t["dtype"] == "float8_e4m3fn"]
    if dtype is None:
        assert len(fp8) == 40 and all(isinstance(t.get("scale"), float) for t in fp8)
    else:
        assert not fp8
    assert not any("scale_weight" in n or "scale_input" in n for n in tensors)
    assert index["native_fp8_scales"] == 40
    assert torch.equal(got, want)


def test_shards_written_without_the_scales_are_refused_by_name(tiny: dict[str, Path], fp8_files, tmp_path: Path) -> None:
    from jobs.runners.convert import shard_source
    from jobs.runners.errors import SetupError
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer

    _shard_outputs(tiny, fp8_files, tmp_path, None)
    index = tmp_path / "shards" / "index.json"
    data = json.loads(index.read_text())
    del data["native_fp8_scales"]  # as an older writer left it
    index.write_text(json.dumps(data))
    src = shard_source(fp8_files["scaled"][0], tiny["flux"], tmp_path / "cache")
    with pytest.raises(SetupError, match=r"offload.shard_dir: .*shards was written without the scale_weight .*shard it again"):
        load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, torch.device("cpu"),
                         offload={"offload_granularity": "block", "lazy_load": True, "shard_dir": str(tmp_path / "shards")},
                         transformer_dir=src)


@pytest.mark.parametrize("name", ["plain", "scaled"])
def test_the_disk_tier_keeps_an_fp8_file_fp8_and_streams_it_bitwise(tiny: dict[str, Path], fp8_files, tmp_path: Path,
                                                                    name: str) -> None:
    """RAM short (here: offload.lazy_load), an fp8 file's weights go to the model cache's shards as
    stored, counted at their bytes (they were widened to the job's dtype: twice the disk and the reads,
    and a RAM need counted at twice the weights), and the disk tier computes the RAM engine's output
    bitwise."""
    from test_loading import _out

    from jobs.runners.convert import shard_source
    from jobs.runners.families import get_adapter
    from jobs.runners.host_tier import choose_host_tier
    from jobs.runners.load import load_transformer, offload_config
    from jobs.runners.shard_cache import read_source
    from jobs.spec import parse_spec

    home = tmp_path / "home"
    run = home / "runs" / "job1"
    run.mkdir(parents=True)
    folder = shard_source(fp8_files[name][0], tiny["flux"], home / "models")
    src = read_source(folder, torch.float32)
    fp8_bytes = sum(n for _, dt, _, _, n in src.tensors if dt == "float8_e4m3fn")
    assert src.store_dtype is None and fp8_bytes > 0
    assert src.weight_bytes == sum(n for _, _, _, _, n in src.tensors)  # every tensor at its bytes in the file
    keys = {"target_device": "cpu", "offload_granularity": "block"}
    spec = parse_spec({"kind": "infer", "model": {"path": str(tiny["flux"])}, "infer": {"prompt": "a"},
                       "offload": {**keys, "lazy_load": True}})
    cpu, adapter = torch.device("cpu"), get_adapter("flux")
    config = choose_host_tier(spec, offload_config(spec, cpu, training=False), tiny["flux"], torch.float32, run,
                              held_bytes=0, transformer_dir=folder)
    index = json.loads((Path(config.shard_dir) / "index.json").read_text())
    stored = [t for u in index["units"].values() for t in u["tensors"].values() if t["dtype"] == "float8_e4m3fn"]
    assert len(stored) == sum(dt == "float8_e4m3fn" for _, dt, _, _, _ in src.tensors)
    assert all((t.get("scale") is not None) == (name == "scaled") for t in stored)
    disk = load_transformer(tiny["flux"], adapter, torch.float32, cpu, offload=config, transformer_dir=folder)
    ram = load_transformer(tiny["flux"], adapter, torch.float32, cpu, offload=keys, transformer_dir=folder)
    try:
        assert disk.stats()["host_store"] == "disk" and ram.stats()["host_store"] != "disk"
        assert torch.equal(_out("flux", disk.model, torch.float32), _out("flux", ram.model, torch.float32))
    finally:
        disk.handle.remove()
        ram.handle.remove()
