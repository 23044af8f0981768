"""Text encoder and VAE files made by the tests from a tiny pipeline's folders: the same tensors as single
files under ComfyUI's prefixes, the VAE in the BFL/LDM layout (the INVERSE of diffusers'
convert_ldm_vae_checkpoint, ours), and fp8 copies (plain e4m3fn, and ComfyUI's scaled layout with a
`scale_weight` per weight and the `scaled_fp8` marker)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

CLIP_PREFIX = "text_model."  # older transformers' (and ComfyUI's clip_l) names
T5_PREFIX = "text_encoders.t5xxl.transformer."  # a whole ComfyUI checkpoint's
_RESNET = {"conv_shortcut": "nin_shortcut"}
_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def with_files(spec: dict, text_encoders: list[Path], vae: Path | None = None) -> dict:
    """An infer/train spec with `model.text_encoders` (and `model.vae`) set to these files."""
    spec["model"]["text_encoders"] = [str(p) for p in text_encoders]
    if vae is not None:
        spec["model"]["vae"] = str(vae)
    return spec


def component_state(folder: Path) -> dict[str, torch.Tensor]:
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def write_file(tensors: dict[str, torch.Tensor], dst: Path, prefix: str = "") -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()}, str(dst))
    return dst


def to_ldm_vae(sd: dict[str, torch.Tensor], up_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKL state dict in the LDM/BFL names (ae.safetensors'); every tensor used once."""
    out = {}
    for k, v in sd.items():
        n = k
        n = re.sub(r"down_blocks\.(\d+)\.resnets\.(\d+)\.", r"down.\1.block.\2.", n)
        n = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", n)
        n = re.sub(r"up_blocks\.(\d+)\.resnets\.(\d+)\.", lambda m: f"up.{up_blocks - 1 - int(m.group(1))}.block.{m.group(2)}.", n)
        n = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{up_blocks - 1 - int(m.group(1))}.upsample.", n)
        n = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m.group(1)) + 1}.", n)
        for a, b in _RESNET.items():
            n = n.replace(f".{a}.", f".{b}.")
        if ".mid_block.attentions.0." in n:
            n = n.replace(".mid_block.attentions.0.", ".mid.attn_1.")
            for a, b in _ATTN.items():
                n = n.replace(f".attn_1.{a}.", f".attn_1.{b}.")
            if v.ndim == 2:  # LDM's attention is 1x1 convolutions
                v = v[:, :, None, None]
        n = n.replace("conv_norm_out", "norm_out")
        assert n not in out, n
        out[n] = v
    return out


def fp8(sd: dict[str, torch.Tensor], scaled: bool) -> dict[str, torch.Tensor]:
    """Every 2-D weight in float8_e4m3fn (scaled: divided by a per-tensor scale kept as `scale_weight`)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2 and "embed" not in k and "shared" not in k:
            if scaled:
                scale = (v.abs().max() / 448.0).clamp(min=1e-12).float()
                out[k] = (v / scale).to(torch.float8_e4m3fn)
                out[k.removesuffix("weight") + "scale_weight"] = scale.reshape(())
            else:
                out[k] = v.to(torch.float8_e4m3fn)
        else:
            out[k] = v
    if scaled:
        out["scaled_fp8"] = torch.zeros(2, dtype=torch.float8_e4m3fn)
    return out


def widened(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What an fp8 file means in `dtype`: weight * scale_weight, taken in fp32 and rounded once (ours, written
    out here from the definition rather than imported from the loader)."""
    sd = dict(sd)
    sd.pop("scaled_fp8", None)
    scales = {k.removesuffix("scale_weight") + "weight": sd.pop(k) for k in [k for k in sd if k.endswith(".scale_weight")]}
    return {k: ((v.float() * scales[k].float()).to(dtype) if k in scales else v.to(dtype))
            if v.dtype == torch.float8_e4m3fn else v for k, v in sd.items()}


QWEN_PREFIX = "text_encoders.qwen25_7b.transformer."  # a whole ComfyUI checkpoint's Qwen2.5-VL
_WAN_RESIDUAL = {"norm1.gamma": "residual.0.gamma", "conv1.": "residual.2.", "norm2.gamma": "residual.3.gamma",
                 "conv2.": "residual.6.", "conv_shortcut.": "shortcut."}


def _wan_residual(rest: str) -> str:
    for a, b in _WAN_RESIDUAL.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest


def to_wan_native_vae(sd: dict[str, torch.Tensor], num_res_blocks: int) -> dict[str, torch.Tensor]:
    """A diffusers AutoencoderKLWan / AutoencoderKLQwenImage state dict in Wan-AI's native names (ComfyUI's
    `wan_2.1_vae` / `qwen_image_vae`): the INVERSE of the loader's renaming, written from Wan's module
    layout (its decoder's `upsamples` list: per level num_res_blocks + 1 residual blocks, then a resample)."""
    per = num_res_blocks + 1
    out = {}
    for k, v in sd.items():
        part, _, rest = k.partition(".")
        n = {"quant_conv": "conv1", "post_quant_conv": "conv2"}.get(part, part) + "." + rest
        if part in ("encoder", "decoder"):
            for a, b in (("conv_in.", "conv1."), ("norm_out.", "head.0."), ("conv_out.", "head.2.")):
                if rest.startswith(a):
                    rest = b + rest[len(a):]
            if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", rest):
                rest = f"middle.{2 * int(m.group(1))}.{_wan_residual(m.group(2))}"
            elif rest.startswith("mid_block.attentions.0."):
                rest = "middle.1." + rest[len("mid_block.attentions.0."):]
            elif m := re.match(r"down_blocks\.(\d+)\.(.*)", rest):
                rest = f"downsamples.{m.group(1)}.{_wan_residual(m.group(2))}"
            elif m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", rest):
                rest = f"upsamples.{int(m.group(1)) * (per + 1) + int(m.group(2))}.{_wan_residual(m.group(3))}"
            elif m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", rest):
                rest = f"upsamples.{int(m.group(1)) * (per + 1) + per}.{m.group(2)}"
            n = f"{part}.{rest}"
        assert n not in out, n
        out[n] = v
    return out
