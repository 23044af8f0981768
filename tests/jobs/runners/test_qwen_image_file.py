"""`model.transformer`: ComfyUI's Qwen-Image file (`qwen_image_bf16.safetensors`: diffusers' own names
under `model.diffusion_model.`; diffusers has no single-file converter for Qwen-Image 1, only for 2.1).

Detected by its tensors (family qwen-image, its dimensions), renamed into the model cache bitwise,
and loaded as `model.transformer` with `model.base`: through a real worker the infer job renders
bitwise the image of the same job on the diffusers folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runner_helpers import events, infer_spec, log, pictures, run_dir, run_job, train_spec
from single_file_helpers import COMFY, diffusers_state

from jobs.runners.convert import converted_transformer
from jobs.runners.errors import CheckpointError
from jobs.runners.single_file import detect_checkpoint


@pytest.fixture(scope="module")
def qwen_file(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("qwen") / "qwen_image_tiny.safetensors"
    save_file({COMFY + k: v for k, v in diffusers_state(tiny["qwen-image"] / "transformer").items()}, str(path))
    return path


def test_the_comfy_file_is_detected_and_converted_bitwise(tiny: dict[str, Path], qwen_file: Path, tmp_path: Path) -> None:
    det = detect_checkpoint(qwen_file)
    assert (det.family, det.layout, det.prefix) == ("qwen-image", "diffusers", COMFY)
    want = json.loads((tiny["qwen-image"] / "transformer" / "config.json").read_text())
    for key, value in det.config.items():
        assert value == want[key], key
    got = converted_transformer(det, tiny["qwen-image"], tmp_path / "c", say=lambda _: None)
    ref, mine = diffusers_state(tiny["qwen-image"] / "transformer"), diffusers_state(got.path)
    assert mine.keys() == ref.keys() and all(mine[k].dtype == ref[k].dtype and torch.equal(mine[k], ref[k]) for k in ref)
    config = json.loads((got.path / "config.json").read_text())
    assert {k: config[k] for k in want if not k.startswith("_")} == {k: v for k, v in want.items() if not k.startswith("_")}


def test_a_qwen_image_2_1_file_is_refused_by_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "qwen21.safetensors"
    save_file({"transformer_blocks.0.img_mlp.gate_up.weight": torch.zeros(4, 2)}, str(path))
    with pytest.raises(CheckpointError) as err:
        detect_checkpoint(path)
    assert str(path) in str(err.value) and "Qwen-Image 2.1" in str(err.value)



def test_train_and_infer_from_the_file_succeed_and_render_the_folders_image(worker, tiny: dict[str, Path],
                                                                          qwen_file: Path) -> None:
    one = {"prompt": "a red square", "steps": 2}
    from_file = {"path": None, "transformer": str(qwen_file), "base": str(tiny["qwen-image"])}
    with worker.client() as c:
        train = train_spec(tiny, "qwen-image", steps=2, save_every=None)
        train["model"] = {**train["model"], **from_file}
        trained = run_job(c, train)
        spec = infer_spec(tiny, "qwen-image", **one)
        spec["model"] = from_file
        job = run_job(c, spec)
        folder = run_job(c, infer_spec(tiny, "qwen-image", **one))
    for j in (trained, job, folder):
        assert j["status"] == "SUCCEEDED", log(j)[-3000:]
    assert (run_dir(trained) / "outputs" / "lora.safetensors").is_file()
    first, later = events(trained, "runner.convert"), events(job, "runner.convert")
    assert [e["result"] for e in first] == ["miss"] and [e["result"] for e in later] == ["hit"]  # converted once
    assert pictures(job) and pictures(job) == pictures(folder)
