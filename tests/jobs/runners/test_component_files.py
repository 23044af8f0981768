"""`model.text_encoders` and `model.vae` as single files (issue 31, items 1 and 3).

The files are the tiny pipelines' own encoders and VAE written as single files (component_file_helpers):
CLIP under `text_model.`, T5 under a whole ComfyUI checkpoint's prefix, the VAE in the BFL/LDM
layout (the inverse of diffusers' converter) under `first_stage_model.`, and fp8 copies (plain, and
ComfyUI's scaled layout). Loaded in-process, each module is the base's own from_pretrained bitwise
(its tensors and its output); an fp8 T5/UMT5 keeps its block weights fp8 (under 0.6x the widened
bytes) and, streamed by the engine on the CPU, computes the fp8-widened module's output bitwise. Through a real worker,
an infer job from the files renders the diffusers folder's images byte for byte, a train job
SUCCEEDS, and a Wan infer job from a scaled fp8 umt5_xxl file renders what a folder holding the
widened encoder renders. A wrong family's encoder, a VAE given as an encoder, a transformer or a
video VAE given as the VAE: refused at submit naming the field, the file and what it is.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from component_file_helpers import (CLIP_PREFIX, T5_PREFIX, component_state, fp8, to_ldm_vae, widened, with_files,
                                    write_file)
from runner_helpers import infer_spec, log, pictures, run_dir, train_spec
from single_file_helpers import write_bfl

from jobs.errors import SpecError
from jobs.runners.component_files import identify
from jobs.runners.component_load import load_part
from jobs.runners.errors import CheckpointError


@pytest.fixture(scope="module")
def files(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parts")
    flux, wan = tiny["flux"], tiny["wan"]
    umt5 = component_state(wan / "text_encoder")
    return {
        "clip_l": write_file(component_state(flux / "text_encoder"), root / "clip_l.safetensors", CLIP_PREFIX),
        "t5xxl": write_file(component_state(flux / "text_encoder_2"), root / "t5xxl_fp16.safetensors", T5_PREFIX),
        "t5xxl_fp8": write_file(fp8(component_state(flux / "text_encoder_2"), scaled=False),
                                root / "t5xxl_fp8_e4m3fn.safetensors"),
        "umt5_xxl": write_file(umt5, root / "umt5_xxl.safetensors"),
        "umt5_xxl_scaled": write_file(fp8(umt5, scaled=True), root / "umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
        "ae": write_file(to_ldm_vae(component_state(flux / "vae"), 2), root / "ae.safetensors", "first_stage_model."),
        "ae_diffusers": write_file(component_state(flux / "vae"), root / "ae_diffusers.safetensors"),
        "wan_vae": write_file(component_state(wan / "vae"), root / "wan_2.1_vae.safetensors"),
        "flux_transformer": write_bfl(flux / "transformer", root / "flux1-tiny.safetensors"),
        "root": root,
    }


# (file, pipeline attribute, family, role, layout, fp8)
CASES = [("clip_l", "text_encoder", "flux", "clip_l", "hf", None),
         ("t5xxl", "text_encoder_2", "flux", "t5xxl", "hf", None),
         ("umt5_xxl", "text_encoder", "wan", "umt5_xxl", "hf", None),
         ("ae", "vae", "flux", "vae", "bfl", None),
         ("ae_diffusers", "vae", "flux", "vae", "diffusers", None),
         ("t5xxl_fp8", "text_encoder_2", "flux", "t5xxl", "hf", "plain"),
         ("umt5_xxl_scaled", "text_encoder", "wan", "umt5_xxl", "hf", "scaled")]


def _run(module: torch.nn.Module, attr: str) -> torch.Tensor:
    from jobs.runners.load import component_offload

    with torch.no_grad(), component_offload(module, torch.device("cpu")):  # fp8 kept as stored: the engine
        if attr == "vae":
            x = torch.linspace(-1, 1, 3 * 32 * 32).reshape(1, 3, 32, 32)
            return module.decode(module.encode(x).latent_dist.mean).sample
        return module(torch.tensor([[1, 5, 9, 2, 0]]))[0]


@pytest.mark.parametrize("name,attr,family,role,layout,fp8_kind", CASES, ids=[c[0] for c in CASES])
def test_a_file_loads_as_the_bases_module_bitwise(tiny: dict[str, Path], files: dict[str, Path], name: str, attr: str,
                                                 family: str, role: str, layout: str, fp8_kind: str | None) -> None:
    found = identify(files[name])
    assert (found.family, found.role, found.layout, found.fp8) == (family, role, layout, fp8_kind)
    module, info = load_part(files[name], attr, tiny[family], torch.float32)
    ref = type(module).from_pretrained(str(tiny[family] / attr), dtype=torch.float32).eval().requires_grad_(False)
    if fp8_kind:  # the base's module holding what the fp8 file means, widened
        from safetensors.torch import load_file

        ref.load_state_dict(widened(load_file(str(files[name])), torch.float32), strict=False)
        # every fp8 weight (all in blocks here) kept as stored: half the bytes of the widened module and less
        assert info["fp8_kept"] == info["fp8_params"] > 0
        assert info["held_bytes"] < 0.6 * sum(t.numel() * t.element_size() for t in ref.state_dict().values())
        assert torch.equal(_run(module, attr), _run(ref, attr))  # streamed by the engine, widened where it computes
        module, info = load_part(files[name], attr, tiny[family], torch.float32, keep_fp8=False)
        assert info["fp8_kept"] == 0  # widened at load instead: the widened module, tensor for tensor
    mine, theirs = module.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    assert [k for k in mine if mine[k].dtype != theirs[k].dtype or not torch.equal(mine[k], theirs[k])] == []
    assert torch.equal(_run(module, attr), _run(ref, attr))


def test_a_hub_base_fetches_only_the_configs_of_the_parts_given_as_files(files: dict[str, Path]) -> None:
    from jobs.runners.component_files import FAMILY_ROLES
    from jobs.runners.inputs import _given_as_files

    assert FAMILY_ROLES == {"flux": {"clip_l": "text_encoder", "t5xxl": "text_encoder_2"},
                            "wan": {"umt5_xxl": "text_encoder"}, "qwen-image": {"qwen_2.5_vl": "text_encoder"}}
    assert _given_as_files([str(files["clip_l"]), str(files["t5xxl_fp8"])], str(files["ae"])) == (
        "text_encoder", "text_encoder_2", "vae")
    assert _given_as_files([str(files["umt5_xxl_scaled"])], None) == ("text_encoder",)


def test_an_unknown_tensor_is_refused_naming_it(tiny: dict[str, Path], files: dict[str, Path]) -> None:
    odd = component_state(tiny["flux"] / "text_encoder_2")
    odd["encoder.block.0.layer.0.SelfAttention.extra.weight"] = torch.zeros(2, 2)
    path = write_file(odd, files["root"] / "t5xxl_odd.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_part(path, "text_encoder_2", tiny["flux"], torch.float32)
    msg = str(err.value)
    assert msg.startswith("model.text_encoders: ") and str(path) in msg and "SelfAttention.extra.weight" in msg


# ---------------------------------------------------------------------------------- through a worker




@pytest.fixture(scope="module")
def widened_wan(tiny: dict[str, Path], files: dict[str, Path]) -> Path:
    """The tiny Wan folder with its umt5 holding the scaled fp8 file's widened weights."""
    from safetensors.torch import load_file, save_file

    folder = files["root"] / "wan-widened"
    shutil.copytree(tiny["wan"], folder)
    for f in (folder / "text_encoder").glob("*.safetensors"):
        f.unlink()
    save_file(widened(load_file(str(files["umt5_xxl_scaled"])), torch.float32),
              str(folder / "text_encoder" / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def jobs(worker, tiny: dict[str, Path], files: dict[str, Path], widened_wan: Path) -> dict[str, dict]:
    """Five jobs, submitted at once (the worker runs as many side by side as it has CPU slots)."""
    flux_parts = [files["clip_l"], files["t5xxl"]]
    wan = infer_spec(tiny, "wan", prompt="a red square", steps=2)
    wan["model"]["path"] = str(widened_wan)
    specs = {"flux-folder": infer_spec(tiny, "flux", prompt="a red square", steps=2),
             "flux-files": with_files(infer_spec(tiny, "flux", prompt="a red square", steps=2), flux_parts, files["ae"]),
             "flux-train": with_files(train_spec(tiny, "flux", steps=2, save_every=None), flux_parts, files["ae"]),
             "wan-widened": wan,
             "wan-fp8": with_files(infer_spec(tiny, "wan", prompt="a red square", steps=2), [files["umt5_xxl_scaled"]])}
    with worker.client() as c:
        ids = {name: c.submit(spec)["id"] for name, spec in specs.items()}
        return {name: c.wait(jid, timeout=300) for name, jid in ids.items()}


def test_infer_from_encoder_and_vae_files_renders_the_folders_images(jobs: dict[str, dict], files: dict[str, Path]) -> None:
    folder, mine = jobs["flux-folder"], jobs["flux-files"]
    for job in (folder, mine, jobs["flux-train"]):
        assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert pictures(mine) and pictures(mine) == pictures(folder)
    text = log(mine)
    assert f"text_encoder: {files['clip_l']} (clip_l" in text and f"vae: {files['ae']} (vae, bfl names" in text
    assert (run_dir(jobs["flux-train"]) / "outputs" / "lora.safetensors").is_file()


def test_a_scaled_fp8_umt5_renders_what_its_widened_encoder_renders(jobs: dict[str, dict], files: dict[str, Path]) -> None:
    for job in (jobs["wan-widened"], jobs["wan-fp8"]):
        assert job["status"] == "SUCCEEDED", log(job)[-3000:]
    assert pictures(jobs["wan-fp8"]) and pictures(jobs["wan-fp8"]) == pictures(jobs["wan-widened"])
    assert "fp8 (scaled): 5,152 of 5,152 fp8 weights kept as stored, streamed by the engine" in log(jobs["wan-fp8"])


def test_a_file_that_does_not_fit_is_refused_at_submit_naming_it(worker, tiny: dict[str, Path],
                                                                files: dict[str, Path]) -> None:
    cases = [  # (text encoders, vae, field, words)
        ([files["umt5_xxl"]], None, "model.text_encoders", "is a umt5_xxl text encoder"),
        ([files["ae"]], None, "model.text_encoders", "is a VAE, not a text encoder"),
        ([files["clip_l"], files["clip_l"]], None, "model.text_encoders", "are both clip_l text encoders"),
        ([], files["flux_transformer"], "model.vae", "is a flux transformer (bfl layout), not a VAE"),
        ([], files["clip_l"], "model.vae", "not a VAE"),
        ([], files["wan_vae"], "model.vae", "is a 3-D (video) VAE, a wan or qwen-image model's"),
    ]
    with worker.client() as c:
        for encoders, vae, field, words in cases:
            with pytest.raises(SpecError) as err:
                c.submit(with_files(infer_spec(tiny, "flux"), encoders, vae))
            bad = vae if vae is not None else encoders[-1]
            assert err.value.field == field and str(bad) in str(err.value) and words in str(err.value), str(err.value)


def test_the_spec_takes_encoder_and_vae_files_and_names_the_field_of_each_mistake() -> None:
    from jobs.spec import parse_spec

    base = {"kind": "infer", "infer": {"prompt": "a"}}
    m = parse_spec({**base, "model": {"base": "/m/FLUX.1-dev", "text_encoders": ["/m/clip_l.safetensors",
                                                                                 "/m/t5xxl_fp8_e4m3fn.safetensors"],
                                      "vae": "/m/ae.safetensors"}}).model
    assert (m.path, m.base, m.text_encoders, m.vae) == (None, "/m/FLUX.1-dev", ["/m/clip_l.safetensors",
                                                        "/m/t5xxl_fp8_e4m3fn.safetensors"], "/m/ae.safetensors")
    assert parse_spec({**base, "model": {"path": "/m/FLUX.1-dev", "vae": "/m/ae.safetensors"}}).model.vae
    wrong = [({"vae": "/m/ae.safetensors"}, "model.path", "needs `model.path`"),
             ({"path": "/a", "base": "/b", "vae": "/m/ae.safetensors"}, "model.base", "not both"),
             ({"path": "/a", "text_encoders": [" "]}, "model.text_encoders", "item 0 must not be empty"),
             ({"path": "/a", "vae": ""}, "model.vae", "must not be empty")]
    for model, field, words in wrong:
        with pytest.raises(SpecError) as err:
            parse_spec({**base, "model": model})
        assert err.value.field == field and words in str(err.value), (model, str(err.value))
