"""fp8 text-encoder files on a GPU, in bfloat16: the T5/UMT5 block weights stay fp8, the engine streams
them to the device and widens them there; the output is bitwise the fp8-widened encoder's, resident on the
same device (the lead runs this on the H200: `pytest -m gpu tests/jobs/runners/test_component_files_gpu.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from component_file_helpers import component_state, fp8, widened, write_file

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family,attr,scaled", [("flux", "text_encoder_2", False), ("wan", "text_encoder", True)])
def test_an_fp8_encoder_streams_as_stored_and_computes_the_widened_output(tiny: dict[str, Path], tmp_path: Path,
                                                                         family: str, attr: str, scaled: bool) -> None:
    from safetensors.torch import load_file

    from jobs.runners.component_load import load_part
    from jobs.runners.load import component_offload

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    path = write_file(fp8(component_state(tiny[family] / attr), scaled), tmp_path / "enc_fp8.safetensors")
    module, info = load_part(path, attr, tiny[family], dtype)
    assert info["fp8_kept"] == info["fp8_params"] > 0
    ref = type(module).from_pretrained(str(tiny[family] / attr), dtype=dtype).eval().requires_grad_(False)
    ref.load_state_dict(widened(load_file(str(path)), dtype), strict=False)
    ids = torch.tensor([[1, 5, 9, 2, 0]], device=cuda)
    with torch.no_grad(), component_offload(module, cuda):
        mine = module(ids)[0]
    ref.to(cuda)
    with torch.no_grad():
        theirs = ref(ids)[0]
    assert mine.dtype == theirs.dtype == dtype and torch.equal(mine, theirs)
    assert all(p.dtype != torch.float8_e4m3fn or p.device.type == "cpu" for p in module.parameters())  # given back


def _qwen_hidden(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    from jobs.runners.load import component_offload

    ids = torch.tensor([[1, 5, 9, 2, 7, 3]], device=device)
    with torch.no_grad(), component_offload(module, device):
        return module(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True).hidden_states[-1]


def test_a_scaled_fp8_qwen_encoder_streams_as_stored_and_computes_the_widened_output(tiny: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    """Qwen2.5-VL (ComfyUI's `qwen_2.5_vl_7b_fp8_scaled`): its decoder layers stay fp8 and stream; the reference
    is a folder holding the widened weights (from_pretrained maps ComfyUI's names to transformers' own)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from jobs.runners.component_load import load_part

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    base = tiny["qwen-image"]
    path = write_file(fp8(component_state(base / "text_encoder"), scaled=True), tmp_path / "qwen_fp8_scaled.safetensors")
    module, info = load_part(path, "text_encoder", base, dtype)
    assert 0 < info["fp8_kept"] < info["fp8_params"]
    folder = tmp_path / "widened"
    shutil.copytree(base / "text_encoder", folder)
    save_file(widened(load_file(str(path)), dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    ref = type(module).from_pretrained(str(folder), dtype=dtype).eval().requires_grad_(False).to(cuda)
    mine, theirs = _qwen_hidden(module, cuda), _qwen_hidden(ref, cuda)
    assert mine.dtype == theirs.dtype == dtype and torch.equal(mine, theirs)
    assert all(p.dtype != torch.float8_e4m3fn or p.device.type == "cpu" for p in module.parameters())


def test_a_qwen_encoder_without_head_or_tower_runs_on_the_gpu(tiny: dict[str, Path], tmp_path: Path) -> None:
    """What the loader leaves out (no lm_head: it shares the embedding; no vision tower) moves to the device
    and back like a whole module, and computes the base's hidden states bitwise."""
    from jobs.runners.component_load import load_part

    cuda, dtype = torch.device("cuda"), torch.bfloat16
    base = tiny["qwen-image"]
    sd = {k: v for k, v in component_state(base / "text_encoder").items() if not k.startswith(("lm_head.", "visual."))}
    module, info = load_part(write_file(sd, tmp_path / "qwen_lm_only.safetensors"), "text_encoder", base, dtype)
    assert len(info["left_out"]) == 2
    ref = type(module).from_pretrained(str(base / "text_encoder"), dtype=dtype).eval().requires_grad_(False).to(cuda)
    assert torch.equal(_qwen_hidden(module, cuda), _qwen_hidden(ref, cuda))
    assert all(p.device.type == "cpu" for p in module.parameters())  # given back
