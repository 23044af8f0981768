"""LoRA files in every common format, in and out (issue 31 items 4 and 5), in-process on the tiny models.

A known LoRA (peft on the tiny transformer, B nonzero) is written by our inverse mapping in kohya
(`lora_unet_...`, fused BFL qkv/linear1 for Flux), ComfyUI (BFL names under `diffusion_model.`),
diffusers and native names; each file, fused by the infer runner's own `_fuse_lora` into the
engine-loaded transformer, gives bitwise the output of the diffusers file. alpha/rank is 2 here: a
power of two, so it does not matter that kohya's reader scales the down matrix where ours scaled
the up (see test_an_alpha_that_is_no_power_of_two_is_close_not_bitwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from runner_helpers import log, run_dir, run_job, train_spec
from test_train_jobs import _transformer_inputs

from jobs.runners.families import get_adapter
from jobs.runners.folders import LoraError
from jobs.runners.infer import _fuse_lora
from jobs.runners.load import load_transformer
from jobs.runners.lora import check_lora_format, export_lora, inject_lora, load_lora_file, load_trainable_state
from jobs.runners.lora_formats import to_kohya

CPU = torch.device("cpu")
RANK, ALPHA = 4, 8.0


def _trained(tiny: dict[str, Path], family: str, alpha: float = ALPHA, targets: list[str] | None = None) -> torch.nn.Module:
    adapter = get_adapter(family)
    _, cls = adapter.classes()
    model = cls.from_pretrained(str(tiny[family]), subfolder="transformer")
    torch.manual_seed(0)
    inject_lora(model, RANK, alpha, targets or list(adapter.default_targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    return model


def _bare(path: Path) -> Path:
    """The same tensors without our header, as other tools write them (the family comes from the names)."""
    save_file(load_file(str(path)), str(path))
    return path


def _write(model: torch.nn.Module, family: str, fmt: str, path: Path, alpha: float = ALPHA) -> Path:
    export_lora(model, get_adapter(family), path, rank=RANK, alpha=alpha, fmt=fmt)
    return _bare(path)


def _comfy_bfl(model: torch.nn.Module, path: Path, peft_names: bool = False) -> Path:
    """Flux in BFL names under `diffusion_model.` (ComfyUI's trainer); lora_A/lora_B with `peft_names`."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in model.named_parameters():
        if ".lora_" in n:
            module, _, rest = n.partition(".lora_")
            pairs.setdefault(module, {})[rest[0]] = p.detach().float()
    out = to_kohya({m: (ab["A"], ab["B"]) for m, ab in pairs.items()}, "flux", rank=RANK, alpha=ALPHA,
                   native={}, prefix="diffusion_model.")
    if peft_names:  # alpha folded into B, as peft-style writers do
        out = {k.replace(".lora_down.", ".lora_A.").replace(".lora_up.", ".lora_B."): v for k, v in out.items()}
        for k in [k for k in out if k.endswith(".alpha")]:
            alpha, rank = float(out.pop(k)), out[k[:-6] + ".lora_A.weight"].shape[0]
            out[k[:-6] + ".lora_B.weight"] = out[k[:-6] + ".lora_B.weight"] * (alpha / rank)
    save_file(out, str(path))
    return path


def _infer_output(tiny: dict[str, Path], family: str, lora: Path, events_dir: Path,
                  scale: float = 0.7) -> tuple[torch.Tensor, dict]:
    """The transformer as the infer runner builds it (meta, the engine, the LoRA fused at `scale`), on fixed inputs."""
    events_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_transformer(tiny[family], get_adapter(family), torch.float32, CPU,
                              offload={"offload_granularity": "block"},
                              with_weights=_fuse_lora(get_adapter(family), lora, scale, events_dir))
    with torch.no_grad():
        out = loaded.model(**_transformer_inputs(family, loaded.model))[0]
    loaded.handle.remove()
    (event,) = [json.loads(line) for line in (events_dir / "events.jsonl").read_text().splitlines()]
    assert event["type"] == "runner.lora_applied"
    return out, event


def test_flux_kohya_and_comfy_files_give_the_diffusers_output_bitwise(tiny: dict[str, Path], tmp_path: Path) -> None:
    model = _trained(tiny, "flux")
    files = {"diffusers": _write(model, "flux", "diffusers", tmp_path / "diffusers.safetensors"),
             "kohya": _write(model, "flux", "kohya", tmp_path / "kohya.safetensors"),
             "comfy-bfl": _comfy_bfl(model, tmp_path / "comfy_bfl.safetensors"),
             "comfy-bfl-peft": _comfy_bfl(model, tmp_path / "comfy_bfl_peft.safetensors", peft_names=True)}
    kohya = load_file(str(files["kohya"]))
    # fused qkv: the three rank-4 downs stacked (rank 12), a block-diagonal up, alpha 3 x 8
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert kohya[f"{qkv}.lora_down.weight"].shape[0] == 3 * RANK and float(kohya[f"{qkv}.alpha"]) == 3 * ALPHA
    up = kohya[f"{qkv}.lora_up.weight"]
    assert not up[:up.shape[0] // 3, RANK:].any() and up[:up.shape[0] // 3, :RANK].any()
    assert kohya["lora_unet_single_blocks_1_linear1.lora_down.weight"].shape[0] == 4 * RANK
    assert not any(k.startswith(("transformer.", "diffusion_model.")) for k in kohya)

    want, ev = _infer_output(tiny, "flux", files["diffusers"], tmp_path / "run-diffusers")
    assert (ev["format"], ev["modules"], ev["tensors"]) == ("diffusers", 32, 64)
    base = load_transformer(tiny["flux"], get_adapter("flux"), torch.float32, CPU, offload=None)
    with torch.no_grad():
        assert not torch.equal(base.model(**_transformer_inputs("flux", base.model))[0], want)  # the LoRA did something
    for name in ("kohya", "comfy-bfl", "comfy-bfl-peft"):
        got, ev = _infer_output(tiny, "flux", files[name], tmp_path / f"run-{name}")
        assert ev["modules"] == 32 and ev["format"] == ("kohya" if name == "kohya" else "comfy"), ev
        assert torch.equal(got, want), (name, (got - want).abs().max())


def test_flux_top_level_and_final_layer_kohya_names_and_text_encoder_tensors(tiny: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """img_in, time_in and the final layer (its adaLN halves swapped, BFL order) in kohya names give the
    diffusers file's output bitwise; a text encoder's tensors in the same file are counted, not applied."""
    model = _trained(tiny, "flux", targets=["proj_out", "norm_out.linear", "x_embedder", "context_embedder",
                                            "time_text_embed.timestep_embedder.linear_1"])
    ours = _write(model, "flux", "diffusers", tmp_path / "diffusers.safetensors")
    kohya = load_file(str(_write(model, "flux", "kohya", tmp_path / "kohya.safetensors")))
    assert {"lora_unet_final_layer_adaLN_modulation_1.lora_up.weight", "lora_unet_final_layer_linear.alpha",
            "lora_unet_img_in.lora_down.weight", "lora_unet_txt_in.alpha", "lora_unet_time_in_in_layer.lora_up.weight",
            "lora_unet_single_blocks_1_linear2.lora_down.weight"} <= set(kohya)
    te = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    kohya.update({f"{te}.lora_down.weight": torch.randn(RANK, 32), f"{te}.lora_up.weight": torch.randn(32, RANK),
                  f"{te}.alpha": torch.tensor(float(RANK))})
    save_file(kohya, str(tmp_path / "with_te.safetensors"))
    want, _ = _infer_output(tiny, "flux", ours, tmp_path / "a")
    got, ev = _infer_output(tiny, "flux", tmp_path / "with_te.safetensors", tmp_path / "b")
    assert (ev["modules"], ev["other_model_tensors"]) == (7, 2)  # proj_out: the final layer and 2 single blocks
    assert torch.equal(got, want)


def test_an_alpha_that_is_no_power_of_two_is_close_not_bitwise(tiny: dict[str, Path], tmp_path: Path) -> None:
    """alpha/rank 1.5: ours folds it into up, kohya's readers (diffusers' converter) into down; B(1.5A)
    and (1.5B)A round differently, by at most a few float32 ulps of the weights."""
    model = _trained(tiny, "flux", alpha=6.0)
    ours = _write(model, "flux", "comfy", tmp_path / "comfy.safetensors", alpha=6.0)
    kohya = _write(model, "flux", "kohya", tmp_path / "kohya.safetensors", alpha=6.0)
    want, _ = _infer_output(tiny, "flux", ours, tmp_path / "a")
    got, _ = _infer_output(tiny, "flux", kohya, tmp_path / "b")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["wan", "qwen-image"])
def test_native_diffusers_and_musubi_names_give_the_same_output_bitwise(tiny: dict[str, Path], family: str,
                                                                        tmp_path: Path) -> None:
    model = _trained(tiny, family)
    files = {fmt: _write(model, family, fmt, tmp_path / f"{fmt}.safetensors") for fmt in ("comfy", "diffusers", "kohya")}
    keys = {fmt: set(load_file(str(f))) for fmt, f in files.items()}
    if family == "wan":
        assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in keys["comfy"]  # Wan's native names
        assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in keys["diffusers"]
        assert "lora_unet_blocks_1_ffn_2.alpha" in keys["kohya"]  # musubi-tuner's
    else:
        assert "lora_unet_transformer_blocks_1_img_mod_1.lora_down.weight" in keys["kohya"]
    want, ev = _infer_output(tiny, family, files["comfy"], tmp_path / "run-comfy")
    assert ev["modules"] == len(keys["comfy"]) // 2
    for fmt in ("diffusers", "kohya"):
        got, ev = _infer_output(tiny, family, files[fmt], tmp_path / f"run-{fmt}")
        assert ev["format"] == fmt and ev["modules"] == len(keys["comfy"]) // 2
        assert torch.equal(got, want), (family, fmt)


def test_a_lora_of_another_family_or_of_no_module_is_refused_naming_the_file(tiny: dict[str, Path],
                                                                             tmp_path: Path) -> None:
    wan = _write(_trained(tiny, "wan"), "wan", "kohya", tmp_path / "wan_musubi.safetensors")
    flux = get_adapter("flux")
    _, cls = flux.classes()
    with pytest.raises(LoraError, match=r"infer.lora: .*wan_musubi.safetensors is a wan LoRA; .* flux model "
                                        r"\(kohya names, e.g. lora_unet_blocks_0_"):
        _fuse_lora(flux, wan, 1.0)(cls.from_pretrained(str(tiny["flux"]), subfolder="transformer"))
    # a Flux LoRA of a deeper model: blocks 7 and 8, which the tiny one lacks
    src = load_file(str(_write(_trained(tiny, "flux"), "flux", "kohya", tmp_path / "k.safetensors")))
    far = tmp_path / "deeper.safetensors"
    save_file({k.replace("blocks_0_", "blocks_7_").replace("blocks_1_", "blocks_8_"): v for k, v in src.items()}, str(far))
    with pytest.raises(LoraError, match=r"none of the 32 modules of .*deeper.safetensors \(kohya\) is in this model"):
        _fuse_lora(flux, far, 1.0)(cls.from_pretrained(str(tiny["flux"]), subfolder="transformer"))
    junk = tmp_path / "junk.safetensors"
    save_file({"model.layers.0.weight": torch.zeros(2, 2)}, str(junk))
    with pytest.raises(LoraError, match=r"junk.safetensors has no LoRA names"):
        _fuse_lora(flux, junk, 1.0)(cls.from_pretrained(str(tiny["flux"]), subfolder="transformer"))


@pytest.mark.parametrize("fmt", ["kohya", "comfy"])
def test_init_lora_reads_other_formats(tiny: dict[str, Path], fmt: str, tmp_path: Path) -> None:
    """train.init_lora from a kohya file: A and B may differ from the trained pair by where alpha/rank
    went, their product (what the LoRA does) may not."""
    src = _trained(tiny, "flux")
    path = _write(src, "flux", fmt, tmp_path / "init.safetensors")
    adapter = get_adapter("flux")
    _, cls = adapter.classes()
    dst = cls.from_pretrained(str(tiny["flux"]), subfolder="transformer")
    inject_lora(dst, RANK, ALPHA, list(adapter.default_targets))
    applied = load_lora_file(dst, adapter, path, rank=RANK, alpha=ALPHA)
    assert applied == {"format": "diffusers" if fmt == "comfy" else fmt, "tensors": 64, "modules": 32}
    a, b = dict(src.named_parameters()), dict(dst.named_parameters())
    for n in (n for n in a if ".lora_A." in n):
        bn = n.replace(".lora_A.", ".lora_B.")
        assert torch.equal(b[bn] @ b[n], a[bn] @ a[n]), n
    inject = cls.from_pretrained(str(tiny["flux"]), subfolder="transformer")
    inject_lora(inject, 8, 8.0, list(adapter.default_targets))
    with pytest.raises(LoraError, match=r"train.init_lora: .* has rank 4 at .*; set train.lora_rank"):
        load_lora_file(inject, adapter, path, rank=8, alpha=8.0)


def test_formats_that_cannot_hold_the_targets_are_refused_at_setup() -> None:
    flux, wan, sd3 = get_adapter("flux"), get_adapter("wan"), get_adapter("sd3")
    with pytest.raises(LoraError, match=r"double_blocks.0.img_attn.qkv is one fused module"):
        check_lora_format(["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"], flux, "kohya")
    with pytest.raises(LoraError, match=r"block 0 lacks .*cross_attn.q"):
        check_lora_format(["blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v",
                           "blocks.0.attn1.to_out.0", "blocks.0.ffn.net.0.proj", "blocks.0.ffn.net.2"], wan, "kohya")
    with pytest.raises(LoraError, match=r"kohya is written for flux, wan and qwen-image, not sd3"):
        check_lora_format(["transformer_blocks.0.attn.to_q"], sd3, "kohya")
    check_lora_format(["transformer_blocks.0.attn.to_q"], flux, "diffusers")  # any module has a diffusers name


def test_our_kohya_flux_names_split_back_exactly_in_diffusers_at_flux_dev_widths() -> None:
    """diffusers' own converter (FluxPipeline.lora_state_dict), which splits single blocks' linear1 at
    Flux-dev's widths only, reads what to_kohya writes at those widths: the same A and alpha/rank x B
    (2 here, in A: kohya's readers scale the down matrix)."""
    from diffusers import FluxPipeline

    g = torch.Generator().manual_seed(0)
    inner, mlp, r = 3072, 12288, 2
    modules = {"single_transformer_blocks.0.attn.to_q": inner, "single_transformer_blocks.0.attn.to_k": inner,
               "single_transformer_blocks.0.attn.to_v": inner, "single_transformer_blocks.0.proj_mlp": mlp,
               "transformer_blocks.0.attn.add_q_proj": inner, "transformer_blocks.0.attn.add_k_proj": inner,
               "transformer_blocks.0.attn.add_v_proj": inner, "transformer_blocks.0.ff.net.2": inner}
    pairs = {m: (torch.randn(r, 64, generator=g), torch.randn(out, r, generator=g)) for m, out in modules.items()}
    kohya = to_kohya(pairs, "flux", rank=r, alpha=2.0 * r, native={})
    got = FluxPipeline.lora_state_dict(kohya)
    assert len(got) == 2 * len(modules)
    for m, (a, b) in pairs.items():
        assert torch.equal(got[f"transformer.{m}.lora_A.weight"], a * 2.0), m
        assert torch.equal(got[f"transformer.{m}.lora_B.weight"], b), m


# Flux targets whose kohya names diffusers 0.42.1 reads on the tiny model: not the single blocks' fused
# linear1 (its converter splits that at Flux-dev's widths only) nor the final layer (it names that
# `proj_out` without the `transformer.` prefix, and its pipeline then skips it). Our loader reads both.
DIFFUSERS_READABLE = ["add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out", "ff.net.0.proj", "ff.net.2",
                      "ff_context.net.0.proj", "ff_context.net.2", "norm1_context.linear",
                      "single_transformer_blocks.0.proj_out", "single_transformer_blocks.1.proj_out"]


def test_a_kohya_train_job_loads_back_in_our_loader_and_in_diffusers(client, tiny: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    from diffusers import FluxPipeline

    spec = train_spec(tiny, "flux", steps=3, save_every=None, lora_alpha=ALPHA, lora_format="kohya",
                      lora_target_modules=DIFFUSERS_READABLE)
    job = run_job(client, spec)
    assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    lora = run_dir(job) / "outputs" / "lora.safetensors"
    written = load_file(str(lora))
    assert all(k.startswith("lora_unet_") for k in written)
    assert written["lora_unet_double_blocks_1_txt_attn_qkv.lora_down.weight"].shape[0] == 3 * RANK
    assert float(written["lora_unet_single_blocks_0_linear2.alpha"]) == ALPHA

    # ours: the same transformer as the job's last checkpoint written in today's (comfy) names, bitwise
    adapter = get_adapter("flux")
    _, cls = adapter.classes()
    trained = cls.from_pretrained(str(tiny["flux"]), subfolder="transformer")
    inject_lora(trained, RANK, ALPHA, DIFFUSERS_READABLE)
    (ckpt,) = (run_dir(job) / "checkpoints").iterdir()
    load_trainable_state(trained, load_file(str(ckpt / "trainable.safetensors")))
    comfy = _write(trained, "flux", "comfy", tmp_path / "comfy.safetensors")
    want, _ = _infer_output(tiny, "flux", comfy, tmp_path / "run-comfy", scale=1.0)
    got, ev = _infer_output(tiny, "flux", lora, tmp_path / "run-kohya", scale=1.0)
    modules = sum(".lora_A." in n for n, _ in trained.named_parameters())
    assert ev["format"] == "kohya" and ev["modules"] == modules
    assert torch.equal(got, want)

    # diffusers' own load_lora_weights: every trained module gets its LoRA (0 missed), to the same output
    pipe = FluxPipeline.from_pretrained(str(tiny["flux"]))
    pipe.load_lora_weights(str(lora))
    loaded = {n.split(".lora_A")[0] for n, _ in pipe.transformer.named_parameters() if ".lora_A." in n}
    assert loaded == {n.split(".lora_A")[0] for n, _ in trained.named_parameters() if ".lora_A." in n}
    with torch.no_grad():
        theirs = pipe.transformer(**_transformer_inputs("flux", pipe.transformer))[0]
    torch.testing.assert_close(theirs, got, rtol=1e-5, atol=1e-5)  # unfused against fused: float order differs
