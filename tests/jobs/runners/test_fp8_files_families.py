"""fp8 transformer files of Wan (Comfy-Org's native names) and Qwen-Image (ComfyUI's prefixed diffusers
names), plain e4m3fn and scaled (`scale_weight` beside each weight, a `scaled_fp8` marker): converted
into the model cache with their block weights fp8 as stored, streamed by the engine and widened on the
device, computing bitwise what the same file holding the widened weights computes (Flux's fp8 files:
test_fp8_transformer_files.py, through the worker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from single_file_helpers import COMFY, diffusers_state, write_wan_native

FP8 = torch.float8_e4m3fn
BLOCKS = {"wan": "blocks.", "qwen-image": COMFY + "transformer_blocks."}


def _write(sd: dict[str, torch.Tensor], dst: Path) -> Path:
    from safetensors.torch import save_file

    save_file(sd, str(dst))
    return dst


def fp8_pair(src: dict[str, torch.Tensor], blocks: str, root: Path, scaled: bool) -> tuple[Path, Path]:
    """(the fp8 file, the same file holding its weights widened back to their dtype)."""
    fp8, wide = {}, {}
    for i, (k, v) in enumerate(src.items()):
        fp8[k] = wide[k] = v
        if k.startswith(blocks) and k.endswith(".weight") and v.dim() >= 2:
            s = float(v.abs().max()) / 448.0 * (1.0 + 0.01 * i) if scaled else None  # unequal: a mixed-up scale shows
            fp8[k] = (v / s if s else v).to(FP8)
            wide[k] = (fp8[k].float() * s if s else fp8[k].float()).to(v.dtype)
            if s:
                fp8[k.removesuffix(".weight") + ".scale_weight"] = torch.tensor(s, dtype=torch.float32)
    if scaled:
        fp8["scaled_fp8"] = torch.empty(0, dtype=FP8)
    kind = "scaled" if scaled else "plain"
    return _write(fp8, root / f"fp8-{kind}.safetensors"), _write(wide, root / f"wide-{kind}.safetensors")


def _source(tiny: dict[str, Path], family: str, root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if family == "wan":
        return load_file(str(write_wan_native(tiny["wan"] / "transformer", root / "wan-native.safetensors")))
    return {COMFY + k: v for k, v in diffusers_state(tiny["qwen-image"] / "transformer").items()}


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("family", ["wan", "qwen-image"])
def test_an_fp8_file_streams_as_stored_and_computes_the_widened_file(tiny: dict[str, Path], tmp_path: Path,
                                                                     family: str, scaled: bool) -> None:
    from test_loading import _out

    from jobs.runners.convert import converted_transformer
    from jobs.runners.families import get_adapter
    from jobs.runners.load import load_transformer
    from jobs.runners.single_file import detect_checkpoint

    f, wide = fp8_pair(_source(tiny, family, tmp_path), BLOCKS[family], tmp_path, scaled)
    det = detect_checkpoint(f)
    assert det.family == family
    outs, kept = [], []
    for src in (f, wide):
        got = converted_transformer(detect_checkpoint(src), tiny[family], tmp_path / "cache", say=lambda _: None)
        loaded = load_transformer(tiny[family], get_adapter(family), torch.float32, torch.device("cpu"),
                                  offload={"offload_granularity": "block"}, transformer_dir=got.path)
        try:
            kept.append(sum(ts.store_dtype == FP8 for u in loaded.handle.engine.streamed for ts in u.tensors))
            outs.append(_out(family, loaded.model, torch.float32))
        finally:
            loaded.handle.remove()
    assert kept[0] > 0 and kept[1] == 0  # the fp8 file's block weights stay fp8 in the host store
    assert torch.equal(outs[0], outs[1])
