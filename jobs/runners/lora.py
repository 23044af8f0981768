"""LoRA: inject with peft, save with each ecosystem's key names, check a file's family.

Saved files load where users load them:
- Flux:       transformer.<diffusers module>.lora_A.weight / .lora_B.weight (diffusers, ComfyUI)
- Qwen-Image: diffusion_model.<diffusers module>.lora_A.weight ... (ComfyUI's names are diffusers')
- Wan 2.1:    diffusion_model.<native Wan module>.lora_A.weight, e.g. blocks.0.self_attn.q

alpha/rank is folded into lora_B, so there are no `.alpha` tensors and every loader applies the
same scale (1). Rank and alpha go into the safetensors header, next to the family and base model.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file

from jobs.runners.families import FamilyAdapter
from jobs.runners.folders import LoraError, lora_family, read_lora_header

__all__ = ["LoraError", "inject_lora", "base_weights_on_host", "trainable_state", "load_trainable_state", "export_lora", "lora_family",
           "read_lora_header", "load_lora_file"]


def inject_lora(model: torch.nn.Module, rank: int, alpha: float, targets: list[str]) -> list[str]:
    """Freeze the model and add a peft LoRA adapter; returns the adapted module names."""
    from peft import LoraConfig

    model.requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=True, target_modules=list(targets))
    try:
        model.add_adapter(cfg)
    except ValueError as exc:
        raise LoraError(f"train.lora_target_modules: {exc}".split("\n")[0]) from None
    adapted = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n})
    if not adapted:
        raise LoraError(f"train.lora_target_modules: none of {', '.join(targets)} names a module of this model")
    _initialise_on_meta(model, cfg.init_lora_weights)
    for n, p in model.named_parameters():  # LoRA weights train in fp32 whatever the base dtype
        if ".lora_" in n:
            p.data = p.data.float()
    return adapted


def _initialise_on_meta(model: torch.nn.Module, init: Any) -> None:
    """A model built on the meta device (its weights read later by the engine) gets its LoRA on the
    meta device too (peft follows the base layer): give those tensors memory and peft's own init."""
    from peft.tuners.lora import LoraLayer

    for m in model.modules():
        if not isinstance(m, LoraLayer):
            continue
        for name in list(m.lora_A.keys()):
            parts = (m.lora_A[name], m.lora_B[name])
            if any(p.device.type == "meta" for part in parts for p in part.parameters()):
                for part in parts:
                    part.to_empty(device="cpu")
                m.reset_lora_parameters(name, init)


@contextmanager
def base_weights_on_host(model: torch.nn.Module) -> Iterator[None]:
    """Inside, every LoRA-wrapped base weight is a CPU tensor holding its value, and the adapters are
    on the CPU: peft's merge (`fuse_lora`) runs there, as on a model loaded into RAM. With the engine
    streaming the weights, those values are its host masters (`state_dict()`); on leaving they are
    written back through `load_state_dict`, which drops the device copies."""
    from peft.tuners.lora import LoraLayer

    state = model.state_dict()
    swapped = []
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        base = m.get_base_layer()
        key = f"{name}.base_layer.weight"
        host = state[key].to("cpu")
        swapped.append((base, base._parameters["weight"], key, host))
        base._parameters["weight"] = torch.nn.Parameter(host, requires_grad=False)
        m.lora_A.to("cpu")
        m.lora_B.to("cpu")
    try:
        yield
    finally:
        for base, orig, _, _ in swapped:
            base._parameters["weight"] = orig
    model.load_state_dict({key: host for _, _, key, host in swapped}, strict=False)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters by name, as the model holds them (what checkpoints keep)."""
    return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in state]
    if missing:
        raise LoraError(f"checkpoint lacks {len(missing)} trainable tensors (e.g. {missing[0]}); "
                        "was it made with other lora_target_modules or lora_rank?")
    with torch.no_grad():
        for n, v in state.items():
            if n not in params or params[n].shape != v.shape:
                raise LoraError(f"checkpoint tensor {n} {tuple(v.shape)} does not fit this model")
            params[n].copy_(v)


def _lora_parts(name: str) -> tuple[str, str] | None:
    """`<module>.lora_A.default.weight` -> (module, "A"); None for a tensor that is no LoRA matrix."""
    if ".lora_A." not in name and ".lora_B." not in name:
        return None
    module, _, rest = name.partition(".lora_")
    return module, rest.split(".", 1)[0]


def load_lora_file(model: torch.nn.Module, family: FamilyAdapter, path: str | Path, *, rank: int,
                   alpha: float) -> int:
    """Start the model's LoRA from a file `export_lora` wrote (same family and rank); returns the tensors set."""
    from safetensors.torch import load_file

    meta, _ = read_lora_header(path)
    if meta.get("offload_jobs.family") != family.name or meta.get("alpha_folded") != "true":
        raise LoraError(f"train.init_lora: {path} is not a {family.name} LoRA written by offload-jobs "
                        "(other formats are not read yet)")
    if meta.get("lora_rank") != str(rank):
        raise LoraError(f"train.init_lora: {path} has rank {meta.get('lora_rank')}; set train.lora_rank to it")
    saved = load_file(str(path))
    scale = alpha / rank  # export_lora folded its own alpha/rank into B; this job's scale comes back out
    count = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = _lora_parts(name)
            if parts is None:
                continue
            key = f"{family.lora_key(parts[0])}.lora_{parts[1]}.weight"
            if key not in saved or saved[key].shape != p.shape:
                raise LoraError(f"train.init_lora: {path} has no {key} of shape {tuple(p.shape)}; was it trained "
                                "with other lora_target_modules?")
            p.copy_(saved[key] / scale if parts[1] == "B" else saved[key])
            count += 1
    return count


def export_lora(model: torch.nn.Module, family: FamilyAdapter, path: str | Path, *, rank: int, alpha: float,
                metadata: dict[str, Any] | None = None,
                state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Write the adapter as one .safetensors in the family's convention; returns what was written.
    `state` (names as the model's parameters) writes those values instead of the model's (an EMA)."""
    scale = alpha / rank
    out: dict[str, torch.Tensor] = {}
    unnamed = []
    for name, p in (state or dict(model.named_parameters())).items():
        parts = _lora_parts(name)
        if parts is None:
            continue
        module, which = parts
        key = family.lora_key(module)
        if key is None:
            unnamed.append(module)
            continue
        value = p.detach().float().cpu()
        if which == "B":
            value = value * scale
        out[f"{key}.lora_{which}.weight"] = value.contiguous()
    if unnamed:
        raise LoraError(f"train.lora_target_modules: {unnamed[0]} has no {family.name} name outside diffusers; "
                        f"target attention/MLP projections only")
    meta = {"format": "pt", "offload_jobs.family": family.name, "lora_rank": str(rank), "lora_alpha": str(alpha),
            "alpha_folded": "true", "ss_network_dim": str(rank), "ss_network_alpha": str(alpha)}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(out, str(tmp), metadata=meta)
    tmp.replace(path)
    return out


def describe(meta: dict[str, str]) -> str:
    return json.dumps({k: meta[k] for k in sorted(meta) if k.startswith(("offload_jobs.", "lora_"))})
