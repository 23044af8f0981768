"""The runner's parts in-process: LoRA key names (golden), checkpoints, buckets, prompts, JSON, specs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from jobs.runners.checkpoint import MARKER, CheckpointStore
from jobs.runners.data import make_buckets, nearest_bucket
from jobs.runners.families import FamilyError, detect_family, get_adapter
from jobs.runners.lora import export_lora, inject_lora, lora_family
from jobs.runners.render import PromptSpec, parse_prompt
from jobs.runners.telemetry import MetricsWriter
from jobs.spec import SpecError, parse_spec

# ComfyUI maps `transformer.<diffusers key>` for Flux and `diffusion_model.<native key>` for every
# model; Qwen-Image's native names are diffusers'; Wan's are its own (blocks.N.self_attn.q, ...).
GOLDEN = {
    "flux": {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight",
        "transformer.transformer_blocks.0.attn.to_out.0.lora_A.weight",
        "transformer.transformer_blocks.0.attn.to_add_out.lora_B.weight",
        "transformer.transformer_blocks.0.ff.net.0.proj.lora_A.weight",
        "transformer.transformer_blocks.0.ff_context.net.2.lora_B.weight",
        "transformer.single_transformer_blocks.1.attn.to_v.lora_A.weight",
        "transformer.single_transformer_blocks.1.proj_mlp.lora_B.weight",
    },
    "qwen-image": {
        "diffusion_model.transformer_blocks.0.attn.to_q.lora_A.weight",
        "diffusion_model.transformer_blocks.0.attn.add_v_proj.lora_B.weight",
        "diffusion_model.transformer_blocks.0.attn.to_out.0.lora_A.weight",
        "diffusion_model.transformer_blocks.0.attn.to_add_out.lora_B.weight",
        "diffusion_model.transformer_blocks.1.img_mlp.net.2.lora_A.weight",
        "diffusion_model.transformer_blocks.1.img_mod.1.lora_B.weight",
        "diffusion_model.transformer_blocks.1.txt_mlp.net.2.lora_A.weight",
        "diffusion_model.transformer_blocks.1.txt_mod.1.lora_B.weight",
    },
    "wan": {
        "diffusion_model.blocks.0.self_attn.q.lora_A.weight",
        "diffusion_model.blocks.0.self_attn.o.lora_B.weight",
        "diffusion_model.blocks.0.cross_attn.k.lora_A.weight",
        "diffusion_model.blocks.0.cross_attn.o.lora_B.weight",
        "diffusion_model.blocks.1.ffn.0.lora_A.weight",
        "diffusion_model.blocks.1.ffn.2.lora_B.weight",
    },
    "sd3": {  # diffusers' SD3 LoRA names, which ComfyUI maps as `transformer.<diffusers key>`
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer.transformer_blocks.0.attn.to_add_out.lora_B.weight",
        "transformer.transformer_blocks.1.attn.add_v_proj.lora_A.weight",
    },
}
# the default targets of the tiny blocks (2+2 / 2 / 2 / 2; SD3's last block has no to_add_out)
KEY_COUNT = {"flux": 64, "qwen-image": 48, "wan": 40, "sd3": 30}


def _adapted_transformer(tiny: dict[str, Path], family: str, rank: int = 4, alpha: float = 8.0) -> torch.nn.Module:
    adapter = get_adapter(family)
    _, cls = adapter.classes()
    model = cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    torch.manual_seed(0)
    inject_lora(model, rank, alpha, list(adapter.default_targets))
    with torch.no_grad():  # nonzero B, so the files carry something
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan", "sd3"])
def test_lora_keys_follow_each_ecosystem(tiny: dict[str, Path], family: str, tmp_path: Path) -> None:
    model = _adapted_transformer(tiny, family)
    path = tmp_path / "lora.safetensors"
    written = export_lora(model, get_adapter(family), path, rank=4, alpha=8.0)
    with safe_open(str(path), framework="pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert GOLDEN[family] <= keys
    assert len(keys) == KEY_COUNT[family]
    assert not any(k.endswith(".alpha") for k in keys)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    assert meta["lora_rank"] == "4" and meta["lora_alpha"] == "8.0" and meta["offload_jobs.family"] == family
    # alpha/rank (2) is folded into B: the file's B is twice the model's
    name = next(n for n, _ in model.named_parameters() if ".lora_B." in n)
    module = name.split(".lora_B")[0]
    key = get_adapter(family).lora_key(module) + ".lora_B.weight"
    assert torch.equal(written[key], dict(model.named_parameters())[name].detach() * 2.0)
    assert lora_family(path) == family


@pytest.mark.parametrize("family", ["flux", "qwen-image", "wan"])
def test_foreign_lora_files_are_recognised_by_their_keys(tiny: dict[str, Path], family: str, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    model = _adapted_transformer(tiny, family)
    written = export_lora(model, get_adapter(family), tmp_path / "ours.safetensors", rank=4, alpha=4.0)
    save_file(written, str(tmp_path / "bare.safetensors"))  # no header: as other trainers write them
    assert lora_family(tmp_path / "bare.safetensors") == family


def test_wan_names_round_trip() -> None:
    wan = get_adapter("wan")
    for mod in ("blocks.3.attn1.to_q", "blocks.3.attn2.to_out.0", "blocks.0.ffn.net.0.proj", "proj_out",
                "condition_embedder.time_proj"):
        assert wan.module_from_lora_key(wan.lora_key(mod)) == mod
    assert wan.lora_key("blocks.0.norm2") is None  # no native name: refused, not written wrong


def test_detect_family(tiny: dict[str, Path], tmp_path: Path) -> None:
    names = ["flux", "qwen-image", "wan", "sd3"]
    assert [detect_family(tiny[f]) for f in names] == names
    with pytest.raises(FamilyError, match="spec says wan, but .* is a flux model"):
        detect_family(tiny["flux"], "wan")
    with pytest.raises(FamilyError, match="no model_index.json"):
        detect_family(tmp_path)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(FamilyError, match="StableDiffusionPipeline"):
        detect_family(tmp_path)


def test_checkpoints_are_atomic_verified_and_bounded(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    for step in (10, 20, 30):
        store.save(step, {"a.bin": lambda p, s=step: p.write_bytes(bytes([s]) * 100)})
    assert [s for s, _ in store.candidates()] == [30, 20]  # keep_last
    assert store.latest().name == "step-000030"
    # torn: the newest file cut short; then one without its marker; then a leftover temp folder
    with open(tmp_path / "ck" / "step-000030" / "a.bin", "r+b") as f:
        f.truncate(50)
    skipped: list[str] = []
    assert store.latest(on_skip=skipped.append).name == "step-000020"
    assert "truncated" in skipped[0]
    (tmp_path / "ck" / "step-000020" / MARKER).unlink()
    skipped.clear()
    assert store.latest(on_skip=skipped.append) is None
    assert any("cut off mid-write" in s for s in skipped)
    tmp = tmp_path / "ck" / ".step-000040.tmp-99999999"
    tmp.mkdir()
    store.save(40, {"a.bin": lambda p: p.write_bytes(b"x")})
    assert not tmp.exists() and store.latest().name == "step-000040"


def test_buckets() -> None:
    buckets = make_buckets(1024 * 1024, 16)
    assert all(w % 16 == 0 and h % 16 == 0 and w * h <= 1024 * 1024 for w, h in buckets)
    assert nearest_bucket((2000, 2000), buckets) == (1024, 1024)
    w, h = nearest_bucket((1920, 1080), buckets)
    assert abs(w / h - 16 / 9) < 0.1
    assert nearest_bucket((32, 48), make_buckets(1024, 4)) in [(24, 40), (28, 36), (24, 36)]


def test_inline_prompt_options() -> None:
    base = PromptSpec(prompt="", width=512, height=512, seed=0, steps=20, guidance=3.5)
    p = parse_prompt("a red fox --w 768 --h 512 --seed 3 --steps 8 --guidance 4.5 --n blurry, dark --f 17", base)
    assert (p.prompt, p.width, p.height, p.seed, p.steps, p.guidance, p.negative, p.frames) == (
        "a red fox", 768, 512, 3, 8, 4.5, "blurry, dark", 17)
    assert parse_prompt("plain", base).as_dict() == {**base.as_dict(), "prompt": "plain"}


def test_metrics_are_strict_json(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    MetricsWriter(out).write({"loss": float("nan"), "lr": float("inf"), "t": torch.tensor(2.5), "n": [1.0, -math.inf]})
    assert json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c)) == {
        "loss": None, "lr": None, "t": 2.5, "n": [1.0, None]}


def test_train_spec_fields() -> None:
    spec = parse_spec({"kind": "train", "model": {"path": "m"}, "train": {
        "lora_target_modules": "to_q,to_k, img_mod.1", "learning_rate": 5e-5, "lora_rank": 16}})
    assert spec.train.lora_target_modules == ["to_q", "to_k", "img_mod.1"]
    with pytest.raises(SpecError, match="train: set `steps` or `num_epochs`, not both"):
        parse_spec({"kind": "train", "model": {"path": "m"}, "train": {"steps": 3, "num_epochs": 1}})
    with pytest.raises(SpecError) as err:
        parse_spec({"kind": "train", "model": {"path": "m", "family": "sdxl"}})
    assert err.value.field == "model.family"


def test_examples_validate() -> None:
    from jobs.spec import load_spec

    repo = Path(__file__).resolve().parents[3]
    names = ["train.yaml", "train-flux.yaml", "train-wan.yaml", "infer.yaml", "infer-wan.yaml", "tiny-train.yaml",
             "tiny-infer.yaml", "train-flux-single-file.yaml"]
    for name in names:
        text = (repo / "examples" / name).read_text()
        assert text.startswith("#") and "Run:" in text.split("kind:")[0], f"{name}: opens with how to run it"
        assert "Targets:" in text.split("kind:")[0], f"{name}: says which VRAM it targets"
        load_spec(repo / "examples" / name)
    assert os.path.exists(repo / "scripts" / "make_tiny_pipelines.py")


def test_a_metrics_line_is_appended_by_one_write_and_whole_after_short_writes(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics.jsonl is tailed while it grows (the dashboard, the tests): a line goes in with one write(2)
    on an O_APPEND descriptor, continued where the kernel wrote less, never through a buffered file that
    may split it (a test read a row cut after 105 characters)."""
    from jobs.runners import telemetry

    path = tmp_path / "metrics.jsonl"
    calls: list[int] = []
    write = os.write

    def short(fd: int, data) -> int:  # the kernel may write less than asked: at most 4 KiB at a time here
        calls.append(len(data))
        return write(fd, bytes(data[:4096]))

    row = {"step": 1, "loss": 0.5, "units": ["x" * 100] * 200}  # 20 KiB: past a buffered file's chunk
    MetricsWriter(path).write(row)
    monkeypatch.setattr(telemetry.os, "write", short)
    MetricsWriter(path).write({**row, "step": 2})
    lines = path.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2] and json.loads(lines[1])["units"] == row["units"]
    assert len(calls) == 6 and calls[0] > 20_000, "one write asked for the whole line, continued after each short one"


def test_the_shard_runners_metrics_lines_go_in_whole_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard runner writes metrics.jsonl through _entry.write_metrics: the same one-write append,
    with NaN written as null."""
    from jobs.runners import _entry, telemetry

    path = tmp_path / "metrics.jsonl"
    monkeypatch.setenv("OFFLOAD_JOBS_METRICS", str(path))
    calls: list[int] = []
    write = os.write

    def short(fd: int, data) -> int:
        calls.append(len(data))
        return write(fd, bytes(data[:4096]))

    monkeypatch.setattr(telemetry.os, "write", short)
    _entry.write_metrics({"step": 3, "files": ["f" * 100] * 100, "loss": float("nan")})
    line = path.read_text()
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line)["loss"] is None and json.loads(line)["files"] == ["f" * 100] * 100
    assert len(calls) == 3 and calls[0] > 10_000, calls
