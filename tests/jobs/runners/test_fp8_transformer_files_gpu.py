"""fp8 `model.transformer` files on a GPU, in bfloat16: a converted ComfyUI scaled-fp8 Flux streams its
block weights as stored and widens them on the device; with every block resident (cpu_offload off) they
are widened once there. Its output is bitwise the fp8-widened folder's on the same engine (the lead runs
this on the H200: `pytest -m gpu tests/jobs/runners/test_fp8_transformer_files_gpu.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_fp8_transformer_files import engine_outputs, fp8_files  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("resident", [False, True])
def test_an_fp8_file_streams_as_stored_on_the_gpu(tiny: dict[str, Path], fp8_files, tmp_path: Path,  # noqa: F811
                                                  resident: bool) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    mine, ref, kept = engine_outputs(tiny, fp8_files, tmp_path, torch.device("cuda"), torch.bfloat16, resident)
    assert kept == (0 if resident else 40) and torch.equal(mine, ref)
