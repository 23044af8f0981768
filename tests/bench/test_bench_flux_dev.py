"""The Flux-dev-dims workloads in tiny mode: the inference one streams bitwise what resident computes,
and --lora-dtype fp32 gives flux-dev-lora-8g the train runner's fp32 adapters.

No timing is asserted: performance lives in bench/, measured on the GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from bench.workloads import get_workload

ROOT = Path(__file__).resolve().parents[2]


def test_flux_dev_infer_streams_what_resident_computes(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "bench", "--tiny", "--device", "cpu", "--workloads", "flux-dev-infer-8g",
           "--only", "resident,ours", "--warmup", "1", "--repeats", "1", "--no-profile", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    ours = next(r for r in result["rows"] if r["variant"] == "ours")
    assert ours["status"] == "ok" and ours["bitwise_equal"] is True, ours
    meta = result["workloads"]["flux-dev-infer-8g"]
    assert meta["train"] is False and meta["h2d_crossings"] == 1  # the floor: every weight once per forward
    assert get_workload("flux-dev-infer-8g", tiny=False).vram_cap_bytes == 8 << 30


def test_flux_dev_lora_takes_the_runners_fp32_adapters() -> None:
    for lora_dtype in (torch.bfloat16, torch.float32):
        wl = get_workload("flux-dev-lora-8g", tiny=True, lora_dtype=lora_dtype)
        model = wl.build()
        lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
        base = {p.dtype for n, p in model.named_parameters() if "lora_" not in n}
        assert lora == {lora_dtype} and base == {torch.bfloat16}, (lora, base)
        assert wl.info["lora_dtype"] == str(lora_dtype).removeprefix("torch.")
