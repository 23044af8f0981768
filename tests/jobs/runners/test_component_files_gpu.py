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
