"""The names a text encoder or VAE file spells its tensors with, mapped to the module's (ours, by rule).

- Qwen2.5-VL (Qwen-Image's text encoder): ComfyUI's `qwen_2.5_vl_7b*.safetensors` and transformers
  < 4.52 write `model.embed_tokens` / `model.layers.N` / `model.norm` / `visual.` / `lm_head`;
  transformers >= 4.52 builds `model.language_model.*` / `model.visual.*` / `lm_head`. Either file
  goes into either module: each name is tried in both spellings and the module's is kept.
- Wan 2.1's VAE in its native names (Wan-AI's WanVAE, ComfyUI's `wan_2.1_vae` and `qwen_image_vae`)
  to diffusers' AutoencoderKLWan / AutoencoderKLQwenImage. diffusers' `convert_wan_vae_to_diffusers`
  numbers the decoder's blocks for the released widths only (4 levels of 3 residual blocks); here the
  numbering comes from the module's config, so any size converts (the tests' tiny one included).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

__all__ = ["qwen_spellings", "wan_vae_to_diffusers", "QWEN_BLOCK_RE"]

# the decoder layers of a Qwen2.5-VL file, in either spelling (the units the engine streams)
QWEN_BLOCK_RE = re.compile(r"^model\.(language_model\.)?layers\.\d+\.")
_OLD_LM = re.compile(r"^model\.(?=(embed_tokens|layers|norm)\.)")


def qwen_spellings(name: str) -> Iterator[str]:
    """`name`, then the same tensor in the other transformers spelling."""
    yield name
    if _OLD_LM.match(name):
        yield "model.language_model." + name[len("model."):]
    elif name.startswith("model.language_model."):
        yield "model." + name[len("model.language_model."):]
    elif name.startswith("visual."):
        yield "model." + name
    elif name.startswith("model.visual."):
        yield name[len("model."):]


_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.": "conv1.", "residual.3.gamma": "norm2.gamma",
             "residual.6.": "conv2.", "shortcut.": "conv_shortcut."}
_TOP = {"conv1.": "quant_conv.", "conv2.": "post_quant_conv."}
_PART = {"conv1.": "conv_in.", "head.0.": "norm_out.", "head.2.": "conv_out.", "middle.0.": "mid_block.resnets.0.",
         "middle.1.": "mid_block.attentions.0.", "middle.2.": "mid_block.resnets.1."}


def _residual(rest: str) -> str:
    for a, b in _RESIDUAL.items():
        if rest.startswith(a):
            return b + rest[len(a):]
    return rest


def _wan_vae_name(name: str, per_level: int) -> str:
    for a, b in _TOP.items():
        if name.startswith(a):
            return b + name[len(a):]
    part, _, rest = name.partition(".")
    if part not in ("encoder", "decoder"):
        return name
    for a, b in _PART.items():
        if rest.startswith(a):
            return f"{part}.{b}{_residual(rest[len(a):])}"
    m = re.match(r"(down|up)samples\.(\d+)\.(.*)", rest)
    if m is None:
        return name
    kind, index, inner = m.group(1), int(m.group(2)), m.group(3)
    if kind == "down":  # the encoder's list is flat in both layouts: the same numbers
        return f"encoder.down_blocks.{index}.{_residual(inner)}"
    # the decoder's: per level `per_level` residual blocks then one upsampler (none after the last level)
    level, at = divmod(index, per_level + 1)
    if at == per_level:
        return f"decoder.up_blocks.{level}.upsamplers.0.{inner}"
    return f"decoder.up_blocks.{level}.resnets.{at}.{_residual(inner)}"


def wan_vae_to_diffusers(state: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """A Wan 2.1 VAE state dict in native names, renamed for diffusers' module of `config` (tensors untouched)."""
    per_level = int(config["num_res_blocks"]) + 1
    return {_wan_vae_name(k, per_level): v for k, v in state.items()}
