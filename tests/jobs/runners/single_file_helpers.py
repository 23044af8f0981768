"""Single-file Flux checkpoints made by the tests: a diffusers transformer written back in the BFL
(original) layout with the INVERSE of diffusers' converter (ours: q, k, v fused into qkv, names
renamed), and in ComfyUI's layout (the same names under `model.diffusion_model.`)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

COMFY = "model.diffusion_model."

# diffusers name (without the block prefix) -> BFL name
_NON_BLOCK = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear",
}
_DOUBLE = {
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin", "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
}
_DOUBLE_NORMS = {"attn.norm_q.weight": "img_attn.norm.query_norm.scale", "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
                 "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
                 "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale"}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2"}
_SINGLE_NORMS = {"attn.norm_q.weight": "norm.query_norm.scale", "attn.norm_k.weight": "norm.key_norm.scale"}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def to_bfl(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux transformer state dict in the BFL layout; every tensor is used exactly once."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}
    for d, b in _NON_BLOCK.items():
        for suffix in ("weight", "bias"):
            if f"{d}.{suffix}" in sd:
                out[f"{b}.{suffix}"] = sd.pop(f"{d}.{suffix}")
    for suffix in ("weight", "bias"):  # diffusers swapped (shift, scale) to (scale, shift): back
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = _swap_halves(sd.pop(f"norm_out.linear.{suffix}"))
    doubles = sorted({int(m.group(1)) for k in sd if (m := re.match(r"transformer_blocks\.(\d+)\.", k))})
    for i in doubles:
        p, q = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for d, b in _DOUBLE.items():
            for suffix in ("weight", "bias"):
                out[f"{q}{b}.{suffix}"] = sd.pop(f"{p}{d}.{suffix}")
        for d, b in _DOUBLE_NORMS.items():
            out[q + b] = sd.pop(p + d)
        for suffix in ("weight", "bias"):
            out[f"{q}img_attn.qkv.{suffix}"] = torch.cat([sd.pop(f"{p}attn.to_{x}.{suffix}") for x in "qkv"])
            out[f"{q}txt_attn.qkv.{suffix}"] = torch.cat([sd.pop(f"{p}attn.add_{x}_proj.{suffix}") for x in "qkv"])
    singles = sorted({int(m.group(1)) for k in sd if (m := re.match(r"single_transformer_blocks\.(\d+)\.", k))})
    for i in singles:
        p, q = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for d, b in _SINGLE.items():
            for suffix in ("weight", "bias"):
                out[f"{q}{b}.{suffix}"] = sd.pop(f"{p}{d}.{suffix}")
        for d, b in _SINGLE_NORMS.items():
            out[q + b] = sd.pop(p + d)
        for suffix in ("weight", "bias"):
            parts = [sd.pop(f"{p}attn.to_{x}.{suffix}") for x in "qkv"] + [sd.pop(f"{p}proj_mlp.{suffix}")]
            out[f"{q}linear1.{suffix}"] = torch.cat(parts)
    assert not sd, f"the inverse left {sorted(sd)[:5]}"
    return {k: v.contiguous() for k, v in out.items()}


def diffusers_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def write_bfl(transformer_dir: Path, dst: Path, prefix: str = "", extra: dict[str, torch.Tensor] | None = None) -> Path:
    """`transformer_dir`'s weights as one BFL-layout file (under `prefix`: COMFY for ComfyUI's)."""
    from safetensors.torch import save_file

    bfl = {prefix + k: v for k, v in to_bfl(diffusers_state(transformer_dir)).items()}
    bfl.update(extra or {})
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(bfl, str(dst))
    return dst


# Wan 2.1: diffusers name part -> the native (Wan-AI / Comfy-Org) one, applied in this order
_WAN_NATIVE = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    (".attn1.", ".self_attn."), (".attn2.", ".cross_attn."), (".to_out.0.", ".o."), (".to_q.", ".q."),
    (".to_k.", ".k."), (".to_v.", ".v."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), (".norm2.", ".norm3."),
]


def to_wan_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Wan 2.1 transformer state dict in the native names (the inverse of diffusers' renames)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k == "scale_shift_table":
            n = "head.modulation"
        elif k.startswith("proj_out."):
            n = "head.head." + k.split(".", 1)[1]
        else:
            n = re.sub(r"^(blocks\.\d+\.)scale_shift_table$", r"\1modulation", k)
            for a, b in _WAN_NATIVE:
                n = n.replace(a, b)
        assert n not in out, n
        out[n] = v.contiguous()
    return out


def write_wan_native(transformer_dir: Path, dst: Path, prefix: str = "") -> Path:
    from safetensors.torch import save_file

    native = {prefix + k: v for k, v in to_wan_native(diffusers_state(transformer_dir)).items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    save_file(native, str(dst))
    return dst
