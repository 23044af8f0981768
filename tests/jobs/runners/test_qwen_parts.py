"""Qwen-Image's text encoder and VAE as single files (issue 31): `qwen_2.5_vl_7b*.safetensors` and
`qwen_image_vae.safetensors` as ComfyUI writes them.

The files are the tiny Qwen-Image pipeline's own encoder and VAE: the encoder in ComfyUI's names
(`model.layers.N.`, `visual.`: what transformers < 4.52 wrote, and what 5.x still saves) alone and
under a whole checkpoint's `text_encoders.qwen25_7b.transformer.`, without `lm_head` (ComfyUI's model
has none), without the vision tower, in transformers >= 4.52's names (`model.language_model.`), and
in ComfyUI's scaled fp8; the VAE in Wan-AI's native names (the inverse of the loader's renaming,
written in component_file_helpers) under `vae.`. Each loads as the base's module bitwise; the fp8
one keeps its decoder layers fp8 and computes what a folder holding its widened weights computes.
Through a real worker, an infer job from the files renders the folder's image byte for byte, and one
from the fp8 file the widened folder's. A Qwen encoder for a Flux model, a T5 for a Qwen-Image
model, a 2-D VAE for Qwen-Image: refused at submit naming the field and the file.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from component_file_helpers import (QWEN_PREFIX, T5_PREFIX, component_state, fp8, to_ldm_vae, to_wan_native_vae,
                                    widened, with_files, write_file)
from runner_helpers import infer_spec, log, pictures

from jobs.errors import SpecError
from jobs.runners.component_files import check_parts, identify
from jobs.runners.component_load import load_part
from jobs.runners.errors import CheckpointError

QWEN = "qwen-image"


@pytest.fixture(scope="module")
def files(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen-parts")
    te = component_state(tiny[QWEN] / "text_encoder")
    assert "model.layers.0.self_attn.q_proj.weight" in te and "visual.merger.ln_q.weight" in te  # ComfyUI's names
    from transformers import Qwen2_5_VLForConditionalGeneration

    new = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tiny[QWEN] / "text_encoder"), dtype=torch.float32)
    new_names = {k: v.clone() for k, v in new.state_dict().items()}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in new_names
    vae = component_state(tiny[QWEN] / "vae")
    return {
        "te": write_file(te, root / "qwen_2.5_vl_7b.safetensors"),
        "te_whole": write_file(te, root / "qwen_whole.safetensors", QWEN_PREFIX),
        "te_no_head": write_file({k: v for k, v in te.items() if not k.startswith("lm_head.")},
                                 root / "qwen_no_head.safetensors"),
        "te_no_tower": write_file({k: v for k, v in te.items() if not k.startswith("visual.")},
                                  root / "qwen_no_tower.safetensors"),
        "te_part_tower": write_file({k: v for k, v in te.items() if not k.startswith("visual.merger.")},
                                    root / "qwen_part_tower.safetensors"),
        "te_new": write_file(new_names, root / "qwen_new_names.safetensors"),
        "te_fp8": write_file(fp8(te, scaled=True), root / "qwen_2.5_vl_7b_fp8_scaled.safetensors"),
        "vae": write_file(to_wan_native_vae(vae, num_res_blocks=1), root / "qwen_image_vae.safetensors", "vae."),
        "vae_diffusers": write_file(vae, root / "qwen_image_vae_diffusers.safetensors"),
        "t5xxl": write_file(component_state(tiny["flux"] / "text_encoder_2"), root / "t5xxl.safetensors", T5_PREFIX),
        "ae": write_file(to_ldm_vae(component_state(tiny["flux"] / "vae"), 2), root / "ae.safetensors"),
        "root": root,
    }


@pytest.fixture(scope="module")
def widened_qwen(tiny: dict[str, Path], files: dict[str, Path]) -> Path:
    """The tiny Qwen-Image folder with its text encoder holding the scaled fp8 file's widened weights."""
    from safetensors.torch import load_file, save_file

    folder = files["root"] / "qwen-widened"
    shutil.copytree(tiny[QWEN], folder)
    for f in (folder / "text_encoder").glob("*.safetensors"):
        f.unlink()
    save_file(widened(load_file(str(files["te_fp8"])), torch.float32),
              str(folder / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _hidden(module: torch.nn.Module) -> torch.Tensor:
    from jobs.runners.load import component_offload

    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad(), component_offload(module, torch.device("cpu")):  # fp8 kept as stored: the engine
        return module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]


def _reference(folder: Path, attr: str) -> torch.nn.Module:
    from jobs.runners.component_load import _class_of

    _, cls = _class_of(folder, attr)
    return cls.from_pretrained(str(folder / attr), dtype=torch.float32).eval().requires_grad_(False)


def _same(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> list[str]:
    assert mine.keys() == theirs.keys()
    return [k for k in mine if mine[k].dtype != theirs[k].dtype or not torch.equal(mine[k], theirs[k])]


# (file, prefix, fp8, what the loader settles that the file lacks)
ENCODERS = [("te", "", None, []), ("te_whole", QWEN_PREFIX, None, []), ("te_new", "", None, []),
            ("te_no_head", "", None, ["lm_head"]), ("te_no_tower", "", None, ["the vision tower"]),
            ("te_part_tower", "", None, ["the vision tower"]),
            ("te_fp8", "", "scaled", [])]


@pytest.mark.parametrize("name,prefix,fp8_kind,settled", ENCODERS, ids=[c[0] for c in ENCODERS])
def test_a_qwen_encoder_file_loads_as_the_bases_module_bitwise(tiny: dict[str, Path], files: dict[str, Path],
                                                               widened_qwen: Path, name: str, prefix: str,
                                                               fp8_kind: str | None, settled: list[str]) -> None:
    found = identify(files[name])
    assert (found.kind, found.family, found.role, found.prefix, found.fp8) == (
        "text_encoder", QWEN, "qwen_2.5_vl", prefix, fp8_kind)
    assert found.dims == {"width": 16, "layers": 2, "vocab": len(component_state(tiny[QWEN] / "text_encoder")
                                                                  ["model.embed_tokens.weight"])}
    module, info = load_part(files[name], "text_encoder", tiny[QWEN], torch.float32)
    assert [s.split(" (")[0] for s in info["left_out"]] == settled
    ref = _reference(widened_qwen if fp8_kind else tiny[QWEN], "text_encoder")
    if fp8_kind:  # the decoder layers' weights kept fp8 as stored, the rest widened: less than the widened bytes
        assert 0 < info["fp8_kept"] < info["fp8_params"]
        kept = [n for n, p in module.named_parameters() if p.dtype == torch.float8_e4m3fn]
        assert kept and all(n.startswith("model.language_model.layers.") for n in kept)
        assert info["held_bytes"] < sum(t.numel() * t.element_size() for t in ref.state_dict().values())
        assert torch.equal(_hidden(module), _hidden(ref))  # streamed by the engine, widened where they compute
        module, info = load_part(files[name], "text_encoder", tiny[QWEN], torch.float32, keep_fp8=False)
        assert info["fp8_kept"] == 0
    mine, theirs = module.state_dict(), ref.state_dict()
    if "lm_head" in settled:  # the head is the embedding's own tensor, not a copy
        assert module.lm_head.weight is module.get_input_embeddings().weight
        theirs["lm_head.weight"] = mine["lm_head.weight"]
    if "the vision tower" in settled:
        assert module.model.visual is None
        theirs = {k: v for k, v in theirs.items() if not k.startswith("model.visual.")}
    assert _same(mine, theirs) == []
    assert torch.equal(_hidden(module), _hidden(ref))


@pytest.mark.parametrize("name,layout,prefix", [("vae", "native", "vae."), ("vae_diffusers", "diffusers", "")])
def test_a_qwen_image_vae_file_loads_as_the_bases_vae_bitwise(tiny: dict[str, Path], files: dict[str, Path],
                                                              name: str, layout: str, prefix: str) -> None:
    found = identify(files[name])
    assert (found.kind, found.family, found.layout, found.prefix) == ("vae", "wan", layout, prefix)
    assert "qwen-image" in (found.note or "")
    module, _ = load_part(files[name], "vae", tiny[QWEN], torch.float32)
    ref = _reference(tiny[QWEN], "vae")
    assert type(module).__name__ == "AutoencoderKLQwenImage"
    assert _same(module.state_dict(), ref.state_dict()) == []
    x = torch.linspace(-1, 1, 3 * 32 * 32).reshape(1, 3, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(module.decode(module.encode(x).latent_dist.mean).sample,
                           ref.decode(ref.encode(x).latent_dist.mean).sample)


def test_the_native_vae_names_map_as_diffusers_own_converter_maps_the_released_wan_vae() -> None:
    """At the released widths (the only ones diffusers' convert_wan_vae_to_diffusers numbers right), the
    loader's config-driven renaming gives diffusers' names for every tensor, and the module's."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from jobs.runners.component_names import wan_vae_to_diffusers

    with torch.device("meta"):
        vae = AutoencoderKLWan()
    want = vae.state_dict()
    native = to_wan_native_vae(dict(want), num_res_blocks=vae.config.num_res_blocks)
    assert "decoder.upsamples.14.residual.6.weight" in native and "decoder.upsamples.4.shortcut.weight" in native
    ours, theirs = wan_vae_to_diffusers(dict(native), dict(vae.config)), convert_wan_vae_to_diffusers(dict(native))
    assert set(ours) == set(want) and ours == theirs


def test_a_wan_vae_fits_a_qwen_image_model_and_a_2d_vae_does_not(tiny: dict[str, Path], files: dict[str, Path]) -> None:
    wan_vae = write_file(component_state(tiny["wan"] / "vae"), files["root"] / "wan_2.1_vae.safetensors")
    assert check_parts(QWEN, tiny[QWEN], [], wan_vae) == {"vae": wan_vae}  # the same architecture
    with pytest.raises(CheckpointError) as err:
        check_parts(QWEN, tiny[QWEN], [], files["ae"])
    assert str(files["ae"]) in str(err.value) and "is a 2-D (image) VAE, a flux model's" in str(err.value)


def test_a_missing_tensor_the_pipeline_needs_is_refused_naming_the_file_and_it(tiny: dict[str, Path],
                                                                             files: dict[str, Path]) -> None:
    te = component_state(tiny[QWEN] / "text_encoder")
    path = write_file({k: v for k, v in te.items() if k != "model.layers.1.mlp.up_proj.weight"},
                      files["root"] / "qwen_holed.safetensors", QWEN_PREFIX)
    with pytest.raises(CheckpointError) as err:
        load_part(path, "text_encoder", tiny[QWEN], torch.float32)
    msg = str(err.value)
    assert msg.startswith("model.text_encoders: ") and str(path) in msg and "lacks 1 tensor(s)" in msg
    assert "layers.1.mlp.up_proj.weight" in msg and "\n" not in msg


def test_an_encoder_of_another_size_is_refused_naming_the_file_and_a_tensor(tiny: dict[str, Path],
                                                                           files: dict[str, Path]) -> None:
    from make_tiny_pipelines import _qwen_text_encoder

    vocab = identify(files["te"]).dims["vocab"]
    wider = _qwen_text_encoder(vocab, hidden=32)
    path = files["root"] / "qwen_wider.safetensors"
    wider.save_pretrained(files["root"] / "wider")
    shutil.copy(files["root"] / "wider" / "model.safetensors", path)
    with pytest.raises(CheckpointError) as err:
        load_part(path, "text_encoder", tiny[QWEN], torch.float32)
    msg = str(err.value)
    assert msg.startswith("model.text_encoders: ") and str(path) in msg and "another size" in msg
    assert ", 32] (the base's [" in msg  # the file's width, then the base's


def test_models_lists_the_files_with_family_and_role(tmp_path: Path, files: dict[str, Path]) -> None:
    from jobs.catalog import list_models

    for name in ("te", "te_fp8", "vae"):
        shutil.copy(files[name], tmp_path / files[name].name)
    by = {m["name"]: m for m in list_models(tmp_path / "home", roots=[tmp_path])["models"]}
    for name in ("qwen_2.5_vl_7b.safetensors", "qwen_2.5_vl_7b_fp8_scaled.safetensors"):
        m = by[name]
        assert (m["kind"], m["field"], m["family"], m["variant"], m["layout"]) == (
            "text_encoder", "model.text_encoders", QWEN, "qwen_2.5_vl", "hf"), m
    assert "F8_E4M3" in by["qwen_2.5_vl_7b_fp8_scaled.safetensors"]["dtype"].split("/")
    vae = by["qwen_image_vae.safetensors"]
    assert (vae["kind"], vae["field"], vae["layout"]) == ("vae", "model.vae", "native") and QWEN in vae["note"]


# ---------------------------------------------------------------------------------- through a worker




@pytest.fixture(scope="module")
def jobs(worker, tiny: dict[str, Path], files: dict[str, Path], widened_qwen: Path) -> dict[str, dict]:
    """Four infer jobs, submitted at once."""
    one = {"prompt": "a red square", "steps": 2}
    widened_spec = infer_spec(tiny, QWEN, **one)
    widened_spec["model"]["path"] = str(widened_qwen)
    specs = {"folder": infer_spec(tiny, QWEN, **one),
             "files": with_files(infer_spec(tiny, QWEN, **one), [files["te_whole"]], files["vae"]),
             "widened": widened_spec,
             "fp8": with_files(infer_spec(tiny, QWEN, **one), [files["te_fp8"]])}
    with worker.client() as c:
        ids = {name: c.submit(spec)["id"] for name, spec in specs.items()}
        return {name: c.wait(jid, timeout=300) for name, jid in ids.items()}


def test_infer_from_qwen_encoder_and_vae_files_renders_the_folders_image(jobs: dict[str, dict],
                                                                         files: dict[str, Path]) -> None:
    for job in (jobs["folder"], jobs["files"]):
        assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert pictures(jobs["files"]) and pictures(jobs["files"]) == pictures(jobs["folder"])
    text = log(jobs["files"])
    assert f"text_encoder: {files['te_whole']} (qwen_2.5_vl, hf names" in text
    assert f"vae: {files['vae']} (vae, native names" in text


def test_a_scaled_fp8_qwen_encoder_renders_what_its_widened_encoder_renders(jobs: dict[str, dict]) -> None:
    for job in (jobs["widened"], jobs["fp8"]):
        assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert pictures(jobs["fp8"]) and pictures(jobs["fp8"]) == pictures(jobs["widened"])
    assert pictures(jobs["fp8"]) != pictures(jobs["folder"])  # the file's weights, not the base's, did it
    assert "fp8 (scaled): " in log(jobs["fp8"]) and "kept as stored, streamed by the engine" in log(jobs["fp8"])


def test_an_encoder_or_vae_of_another_family_is_refused_at_submit_naming_it(worker, tiny: dict[str, Path],
                                                                            files: dict[str, Path]) -> None:
    cases = [  # (family, text encoders, vae, words)
        ("flux", [files["te"]], None, f"is a qwen_2.5_vl text encoder (a {QWEN} model's)"),
        (QWEN, [files["t5xxl"]], None, "is a t5xxl text encoder (a flux model's)"),
        (QWEN, [files["vae"]], None, "is a VAE, not a text encoder"),
        (QWEN, [files["te"], files["te_fp8"]], None, "are both qwen_2.5_vl text encoders"),
        (QWEN, [], files["ae"], "is a 2-D (image) VAE, a flux model's"),
        (QWEN, [], files["te"], "not a VAE"),
    ]
    with worker.client() as c:
        for family, encoders, vae, words in cases:
            with pytest.raises(SpecError) as err:
                c.submit(with_files(infer_spec(tiny, family), encoders, vae))
            bad = vae if vae is not None else encoders[-1]
            field = "model.vae" if vae is not None else "model.text_encoders"
            assert err.value.field == field and str(bad) in str(err.value) and words in str(err.value), str(err.value)
