"""A transformer folder holding fp8 weights (a converted `model.transformer` fp8 file): which stay fp8.

`flux1-dev-fp8.safetensors` holds its matrices as float8_e4m3fn; ComfyUI's scaled fp8 files add a
`scale_weight` (one fp32) beside each (the value is `w8 * scale_weight`). jobs.runners.convert keeps
a block's fp8 weights and their scales as stored, and widens the few scaled weights outside the
blocks (`w8 * scale` in fp32). Here, on the model built on the meta device:

- with the engine loading the weights (`keep_as_stored`): each block weight the folder holds in fp8
  becomes an fp8 meta parameter and its module gets its `scale_weight` (a non-persistent buffer), which
  is what the engine's native-fp8 storage reads (offload_core.quant.adopt_native_fp8): the fp8 bytes
  go to the host store unchanged, cross as stored, and are widened where they compute (to the
  model's compute dtype, the product in fp32 rounded once); a block the planner keeps resident is
  widened once on the device. The other plain fp8 tensors are widened as they are read (exact);
- a model loaded whole (`from_pretrained`, no engine) got every fp8 weight widened: `apply_scales`
  multiplies the scaled ones by their scale, as the engine would (`w.mul_(scale)`: fp32 opmath,
  rounded once).

Host RAM then holds the fp8 bytes, not their widening.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

__all__ = ["Fp8Folder", "read_fp8_folder", "keep_as_stored", "apply_scales"]

FP8_CODES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SCALE = ".scale_weight"


@dataclass
class Fp8Folder:
    fp8: dict[str, tuple[torch.dtype, tuple[int, ...]]]  # weight name -> its fp8 dtype and shape
    scales: dict[str, torch.Tensor]  # weight name -> its scale (0-d fp32)


def _files(folder: Path) -> list[Path]:
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in dict.fromkeys(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())]
    return sorted(folder.glob("*.safetensors"))


def read_fp8_folder(folder: str | Path) -> Fp8Folder | None:
    """The fp8 weights of a transformer folder and their scales (None: it holds none)."""
    from safetensors import safe_open

    from jobs.runners.errors import CheckpointError
    from jobs.runners.folders import safetensors_header

    found = Fp8Folder({}, {})
    for f in _files(Path(folder)):
        header = safetensors_header(f, "model.path", CheckpointError)  # a damaged file: setup_failed, by name
        for name, info in header.items():
            if name != "__metadata__" and info.get("dtype") in FP8_CODES:
                found.fp8[name] = (FP8_CODES[info["dtype"]], tuple(int(s) for s in info["shape"]))
        scales = [n for n in header if n.endswith(SCALE)]
        if scales:
            with safe_open(str(f), framework="pt") as st:
                for n in scales:
                    found.scales[n.removesuffix(SCALE) + ".weight"] = st.get_tensor(n).float().reshape(())
    return found if found.fp8 else None


def _base_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "base_layer")  # peft's LoRA wrapping removed


def _block_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The model's block lists (a ModuleList of two blocks or more at the top: what the engine streams)."""
    return tuple(f"{n}." for n, m in model.named_children() if isinstance(m, nn.ModuleList) and len(m) >= 2)


def keep_as_stored(model: nn.Module, found: Fp8Folder) -> tuple[int, int]:
    """Make the block weights `found` holds in fp8 fp8 meta parameters with their scales (see
    the module docstring); returns how many and their bytes. The model is on the meta device."""
    blocks = _block_prefixes(model)
    count = nbytes = 0
    for mname, m in model.named_modules():
        w = m._parameters.get("weight")
        if w is None or w.device.type != "meta":  # (inference leaves requires_grad on: the engine freezes all)
            continue
        name = _base_name(f"{mname}.weight")
        if name not in found.fp8 or not name.startswith(blocks):
            continue
        dtype, shape = found.fp8[name]
        if tuple(w.shape) != shape:
            continue  # the loader names the mismatch
        m._parameters["weight"] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                               requires_grad=w.requires_grad)
        if name in found.scales:
            m.register_buffer("scale_weight", found.scales[name].clone(), persistent=False)
        count += 1
        nbytes += w.numel() * dtype.itemsize
    return count, nbytes


def apply_scales(model: nn.Module, found: Fp8Folder) -> int:
    """Multiply each widened weight of a model loaded whole by its file scale; returns how many."""
    params = {_base_name(n): p for n, p in model.named_parameters()}
    done = 0
    with torch.no_grad():
        for name, scale in found.scales.items():
            if name in params:
                params[name].mul_(scale.item())
                done += 1
    return done
