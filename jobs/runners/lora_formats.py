"""LoRA files in the names other tools use: read any of them, write ours in each.

| format    | Flux                                   | Wan 2.1                          | Qwen-Image                        |
|-----------|----------------------------------------|----------------------------------|-----------------------------------|
| comfy     | transformer.<diffusers module>         | diffusion_model.<native module>  | diffusion_model.<diffusers module>|
| diffusers | transformer.<diffusers module>         | transformer.<diffusers module>   | transformer.<diffusers module>    |
| kohya     | lora_unet_<BFL module, _>, fused qkv   | lora_unet_<native module, _>     | lora_unet_<diffusers module, _>   |

comfy and diffusers files hold `.lora_A.weight` / `.lora_B.weight` with alpha/rank folded into B
(comfy is what this trainer always wrote: ComfyUI and diffusers load it). kohya files hold
`.lora_down.weight` / `.lora_up.weight` / `.alpha` as kohya's sd-scripts and musubi-tuner write them.
Files of other tools may also name BFL modules with `diffusion_model.` (ComfyUI's own trainer).

In: `to_diffusers` hands the file to the family's diffusers converter (`<Pipeline>.lora_state_dict`,
which calls `lora_conversion_utils`) and gets `transformer.<module>.lora_A.weight` with every alpha
applied once (kohya: alpha/rank into A). One thing it cannot do: its Flux converter splits a single
block's fused `linear1` at Flux-dev's widths (3072, 12288); that split is done here with the model's.
Out: `lora.export_lora` writes comfy and diffusers names; `to_kohya` is our inverse of those
converters. A fused BFL module (qkv, linear1) gets the q/k/v(/mlp) downs stacked (rank n*r) and a
block-diagonal up, with alpha n*alpha: exact, and diffusers' converter recognises the
block-diagonal layout and splits it back bit for bit.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from jobs.runners.folders import LoraError, lora_format

__all__ = ["FORMATS", "to_diffusers", "to_kohya", "kohya_module", "bfl_layout"]

FORMATS = ("comfy", "diffusers", "kohya")

# Flux, diffusers module (inside a block) -> BFL module; fused BFL modules list their members in order
_FLUX_DOUBLE = {"attn.to_out.0": "img_attn.proj", "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
                "norm1.linear": "img_mod.lin", "attn.to_add_out": "txt_attn.proj",
                "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
                "norm1_context.linear": "txt_mod.lin"}
_FLUX_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                      "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_FLUX_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation.lin"}
_FLUX_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_FLUX_TOP = {"x_embedder": "img_in", "context_embedder": "txt_in",
             "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer"}
_LINEAR1 = re.compile(r"(?:lora_unet_|diffusion_model\.)single_blocks[._](\d+)[._]linear1\.(lora_down\.weight|lora_up\.weight|alpha)")
_BFL = re.compile(r"diffusion_model\.(double_blocks|single_blocks|img_in|txt_in|time_in|vector_in|guidance_in|final_layer)")


# ---------------------------------------------------------------------------------------------- in
def _alpha_scales(alpha: float | None, rank: int) -> tuple[float, float]:
    """diffusers' converters' split of alpha/rank between down and up (all into down unless below 1/2)."""
    scale_down, scale_up = (1.0, 1.0) if alpha is None else (alpha / rank, 1.0)
    while scale_down * 2 < scale_up:
        scale_down *= 2
        scale_up /= 2
    return scale_down, scale_up


def _split_linear1(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Pop the single blocks' fused linear1 LoRAs and split them at the model's widths, as diffusers'
    `_convert_to_ai_toolkit_cat` does at Flux-dev's: block-diagonal ups give each member its own rank."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key in [k for k in state if _LINEAR1.fullmatch(k)]:
        m = _LINEAR1.fullmatch(key)
        found.setdefault(int(m.group(1)), {})[m.group(2)] = state.pop(key)
    inner = model.config.num_attention_heads * model.config.attention_head_dim
    out: dict[str, torch.Tensor] = {}
    for i, parts in sorted(found.items()):
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        scale_down, scale_up = _alpha_scales(parts["alpha"].item() if "alpha" in parts else None, down.shape[0])
        down, up = down * scale_down, up * scale_up
        dims = [inner] * 3 + [up.shape[0] - 3 * inner]
        names = [f"transformer.single_transformer_blocks.{i}.{m}" for m in _FLUX_SINGLE_FUSED["linear1"]]
        rank = down.shape[0] // 4
        rows = torch.split(up, dims)
        sparse = down.shape[0] % 4 == 0 and all(
            not r[:, k * rank:(k + 1) * rank].any() for j, r in enumerate(rows) for k in range(4) if k != j)
        for j, name in enumerate(names):
            out[f"{name}.lora_A.weight"] = down[j * rank:(j + 1) * rank] if sparse else down
            out[f"{name}.lora_B.weight"] = rows[j][:, j * rank:(j + 1) * rank].contiguous() if sparse else rows[j]
    return out


def _fold_alphas(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`<module>.alpha` left in diffusers-named files: alpha/rank into A, as the converters do."""
    for key in [k for k in state if k.endswith(".alpha")]:
        alpha = state.pop(key)
        a_key = key[: -len(".alpha")] + ".lora_A.weight"
        if a_key in state:
            scale_down, scale_up = _alpha_scales(float(alpha), state[a_key].shape[0])
            state[a_key] = state[a_key] * scale_down
            b_key = a_key.replace(".lora_A.", ".lora_B.")
            state[b_key] = state[b_key] * scale_up
    return state


def _flux_in(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if any(_BFL.match(k) for k in state):  # BFL names in peft's A/B (ComfyUI's trainer, ai-toolkit)
        state = {k.replace(".lora_A.weight", ".lora_down.weight").replace(".lora_B.weight", ".lora_up.weight"): v
                 for k, v in state.items()}
    elif any(k.startswith("diffusion_model.") for k in state):  # diffusers names under ComfyUI's prefix
        state = {"transformer." + k.removeprefix("diffusion_model."): v for k, v in state.items()}
    linear1 = _split_linear1(state, model) if any(".lora_down.weight" in k for k in state) else {}
    from diffusers import FluxPipeline

    got = FluxPipeline.lora_state_dict(state, return_alphas=True) if state else ({}, {})
    converted, alphas = got[0], got[1] or {}
    converted = {**dict(converted), **{k if k.endswith(".alpha") else k + ".alpha": v for k, v in alphas.items()}}
    # the kohya converter names top-level modules without the prefix the others carry
    converted = {k if k.startswith(("transformer.", "text_encoder")) else "transformer." + k: v
                 for k, v in converted.items()}
    return {**converted, **linear1}


def to_diffusers(state: dict[str, torch.Tensor], family: str, model: torch.nn.Module,
                 where: str, path: Any) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """A LoRA file's tensors in any format -> (`transformer.<module>.lora_A/B.weight` with alphas
    applied, {"text_encoder": n} tensors for other models that this job cannot use)."""
    from jobs.runners.families import get_adapter

    state = dict(state)
    try:
        if family == "flux":
            out = _flux_in(state, model)
        else:
            pipe_cls, _ = get_adapter(family).classes()
            got = pipe_cls.lora_state_dict(state)
            out = dict(got[0] if isinstance(got, tuple) else got)
    except LoraError:
        raise
    except Exception as exc:  # diffusers' converters raise bare ValueError / KeyError / AssertionError on foreign keys
        fmt = lora_format(list(state)) or "unknown"
        raise LoraError(f"{where}: {path} ({fmt} names, e.g. {next(iter(state), '')}) is not a {family} LoRA "
                        f"diffusers' converter can read ({type(exc).__name__}: {str(exc)[:200]})") from None
    out = _fold_alphas(out)
    others = [k for k in out if not k.startswith("transformer.")]
    return {k: v for k, v in out.items() if k.startswith("transformer.")}, {"other_model_tensors": len(others)}


# ---------------------------------------------------------------------------------------------- out
def bfl_layout(module: str) -> tuple[str, int, int] | None:
    """A Flux diffusers module -> (BFL module, member index, members) for the kohya/ComfyUI names."""
    m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if m is None:
        if module in _FLUX_TOP:
            return _FLUX_TOP[module], 0, 1
        return {"proj_out": ("final_layer.linear", 0, 1),
                "norm_out.linear": ("final_layer.adaLN_modulation.1", 0, 1)}.get(module)
    double = m.group(1) == "transformer_blocks"
    where = f"{'double' if double else 'single'}_blocks.{m.group(2)}"
    plain, fused = (_FLUX_DOUBLE, _FLUX_DOUBLE_FUSED) if double else (_FLUX_SINGLE, _FLUX_SINGLE_FUSED)
    if m.group(3) in plain:
        return f"{where}.{plain[m.group(3)]}", 0, 1
    for bfl, members in fused.items():
        if m.group(3) in members:
            return f"{where}.{bfl}", members.index(m.group(3)), len(members)
    return None


def kohya_module(module: str, family: str, native: str | None) -> str | None:
    """The kohya/musubi-tuner module name (`lora_unet_...`) of a diffusers module; None if it has none."""
    if family == "flux":
        got = bfl_layout(module)
        return None if got is None else "lora_unet_" + got[0].replace(".", "_")
    if family == "wan":  # musubi-tuner: Wan's native names, flattened; its converter reads blocks only
        return None if native is None or not native.startswith("blocks.") else "lora_unet_" + native.replace(".", "_")
    if family == "qwen-image":
        return "lora_unet_" + module.replace(".", "_")
    return None


def _swap_halves(w: torch.Tensor) -> torch.Tensor:
    """BFL's final adaLN is (shift, scale), diffusers' norm_out (scale, shift): the swap is its own inverse."""
    a, b = w.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def to_kohya(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], family: str, *, rank: int, alpha: float,
             native: dict[str, str | None], prefix: str = "lora_unet_") -> dict[str, torch.Tensor]:
    """{diffusers module: (A, B as trained)} -> a kohya file's tensors; `prefix` "diffusion_model."
    writes Flux's BFL names with dots, as ComfyUI's trainer does. `native`: Wan's names of the modules."""
    groups: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    sizes: dict[str, int] = {}
    out: dict[str, torch.Tensor] = {}
    for module, (a, b) in pairs.items():
        if family == "flux":
            bfl, index, n = bfl_layout(module) or (None, 0, 1)
            if bfl is None:
                raise LoraError(f"train.lora_format: kohya: {module} has no BFL (Flux original) name")
            name = prefix + (bfl if prefix.endswith(".") else bfl.replace(".", "_"))
        else:
            name, index, n = kohya_module(module, family, native.get(module)), 0, 1
            if name is None:
                raise LoraError(f"train.lora_format: kohya: {module} has no {family} kohya/musubi-tuner name")
        groups.setdefault(name, {})[index] = (a, b)
        sizes[name] = n
    for name, members in groups.items():
        n = sizes[name]
        if n == 1:
            a, b = members[0]
            if name.endswith(("final_layer_adaLN_modulation_1", "final_layer.adaLN_modulation.1")):
                b = _swap_halves(b)
            if "final_layer" in name:  # diffusers' converter reads no alpha there: fold it into up
                b, file_alpha = b * (alpha / rank), float(rank)
            else:
                file_alpha = alpha
            out.update({f"{name}.lora_down.weight": a.contiguous(), f"{name}.lora_up.weight": b.contiguous(),
                        f"{name}.alpha": torch.tensor(file_alpha)})
            continue
        # a fused module: the members' downs stacked, their ups on the diagonal (rank n*r, alpha n*alpha)
        if len(members) != n:
            raise LoraError(f"train.lora_format: kohya: {name} fuses {n} modules; train all of them "
                            "(lora_target_modules) or use another lora_format")
        downs = [members[j][0] for j in range(n)]
        ups = [members[j][1] for j in range(n)]
        up = torch.zeros(sum(u.shape[0] for u in ups), n * rank, dtype=ups[0].dtype)
        row = 0
        for j, u in enumerate(ups):
            up[row:row + u.shape[0], j * rank:(j + 1) * rank] = u
            row += u.shape[0]
        out.update({f"{name}.lora_down.weight": torch.cat(downs).contiguous(), f"{name}.lora_up.weight": up,
                    f"{name}.alpha": torch.tensor(float(n * alpha))})
    return out
