"""LoRA: inject with peft, save with each ecosystem's key names, read any common format.

Saved files (train.lora_format comfy, the default) load where users load them:
- Flux:       transformer.<diffusers module>.lora_A.weight / .lora_B.weight (diffusers, ComfyUI)
- Qwen-Image: diffusion_model.<diffusers module>.lora_A.weight ... (ComfyUI's names are diffusers')
- Wan 2.1:    diffusion_model.<native Wan module>.lora_A.weight, e.g. blocks.0.self_attn.q

alpha/rank is folded into lora_B, so there are no `.alpha` tensors and every loader applies the
same scale (1). Rank and alpha go into the safetensors header, next to the family and base model.
lora_format diffusers and kohya write the other names (jobs/runners/lora_formats.py), and
`read_lora` reads all of them (and musubi-tuner's, and ComfyUI's BFL-named Flux files).
"""

from __future__ import annotations

import json
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from jobs.runners.families import FamilyAdapter
from jobs.runners.folders import LoraError, check_lora_family, lora_family, lora_format, read_lora_header
from jobs.runners.lora_formats import FORMATS, bfl_layout, kohya_module, to_diffusers, to_kohya

__all__ = ["LoraError", "inject_lora", "base_weights_on_host", "trainable_state", "load_trainable_state", "export_lora", "lora_family",
           "read_lora_header", "load_lora_file", "read_lora", "check_lora_format"]


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
    compute_in_input_dtype(model)
    return adapted


def compute_in_input_dtype(model: torch.nn.Module) -> int:
    """LoRA layers compute in their input's dtype (the model's, bf16) with their fp32 weights cast to it,
    as autocast does for a linear; returns how many layers were switched.

    peft casts every adapted input to the adapter's dtype (fp32) and the sum back: at Flux-dev dims
    (418 adapted linears, 4608 tokens) that is several passes over every adapted activation in fp32,
    forward, recompute and backward (a Flux-dev train job ran at 1.30x the engine bench's step with
    bf16 adapters, H100, 8 GiB cap, before this). Here the small weights are cast instead: the
    weights, the optimizer's state and the saved files stay fp32; the gradients reach them through
    the cast. With an fp32 model this is peft's arithmetic, op for op. Other cases (merged, disabled,
    per-sample adapters, DoRA and the other variants, extra forward arguments) run peft's forward.
    """
    from peft.tuners.lora import Linear as LoraLinear

    n = 0
    for m in model.modules():
        if type(m) is LoraLinear:  # exactly peft's: a subclass may compute otherwise
            m.forward = types.MethodType(_input_dtype_forward, m)
            n += 1
    return n


def _input_dtype_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft LoRA Linear's forward in the input's dtype (compute_in_input_dtype)."""
    # DoRA and the other variants: peft's lora_variant (>= 0.16), use_dora before it
    variant = getattr(self, "lora_variant", None) or any((getattr(self, "use_dora", None) or {}).values())
    if args or kwargs or self.disable_adapters or self.merged or variant:
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    out_dtype, dtype = result.dtype, x.dtype
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        a, b = self.lora_A[name], self.lora_B[name]
        h = F.linear(self.lora_dropout[name](x), a.weight.to(dtype), None if a.bias is None else a.bias.to(dtype))
        result = result + F.linear(h, b.weight.to(dtype), None if b.bias is None else b.bias.to(dtype)) * self.scaling[name]
    return result.to(out_dtype)


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


def read_lora(path: str | Path, family: FamilyAdapter, model: torch.nn.Module, where: str) -> tuple[dict[str, torch.Tensor], str, int]:
    """Any LoRA file (comfy, diffusers/peft, kohya, musubi-tuner names) -> (its tensors as
    `transformer.<diffusers module>.lora_A/B.weight` with alpha/rank applied, its format, the
    tensors it holds for other models, e.g. a text encoder, which a transformer job does not use)."""
    from safetensors.torch import load_file

    meta, keys = read_lora_header(path)
    check_lora_family(path, family.name, where, "this model")
    fmt = lora_format(keys)
    if fmt is None:
        raise LoraError(f"{where}: {path} has no LoRA names this loader knows (e.g. {keys[0] if keys else 'no tensors'}); "
                        "expected transformer., diffusion_model. or lora_unet_ keys")
    state, other = to_diffusers(load_file(str(path)), family.name, model, where, path)
    return state, fmt, other["other_model_tensors"]


def load_lora_file(model: torch.nn.Module, family: FamilyAdapter, path: str | Path, *, rank: int,
                   alpha: float) -> dict[str, Any]:
    """Start the model's LoRA (rank `rank`, scale alpha/rank) from a LoRA file in any format this
    loader reads; every LoRA tensor of the model must be in it and every module of the file in the
    model. Returns what was applied: {"format", "tensors", "modules"}."""
    where = "train.init_lora"
    state, fmt, _ = read_lora(path, family, model, where)
    scale = alpha / rank  # the file's scale is in its B (or A); this job's comes back out of B
    params = {n: p for n, p in model.named_parameters() if _lora_parts(n) is not None}
    used = set()
    with torch.no_grad():
        for name, p in params.items():
            module, which = _lora_parts(name)
            key = f"transformer.{module}.lora_{which}.weight"
            if key not in state:
                raise LoraError(f"{where}: {path} ({fmt}) has no LoRA for {module}; was it trained with other "
                                "lora_target_modules?")
            if state[key].shape != p.shape:
                raise LoraError(_shape_error(where, path, fmt, module, which, tuple(state[key].shape), tuple(p.shape)))
            p.copy_(state[key] / scale if which == "B" else state[key])
            used.add(key)
    extra = sorted(k for k in state if k not in used and k.endswith(".weight"))
    if extra:
        raise LoraError(f"{where}: {path} ({fmt}) has {len(extra)} tensors this job's LoRA lacks (e.g. {extra[0]}); "
                        "set train.lora_target_modules to the modules it was trained on")
    return {"format": fmt, "tensors": len(used), "modules": len(used) // 2}


def _shape_error(where: str, path: Any, fmt: str, module: str, which: str, got: tuple, want: tuple) -> str:
    rank_dim = 0 if which == "A" else 1  # A is (rank, in), B (out, rank)
    if got[1 - rank_dim] == want[1 - rank_dim]:
        return f"{where}: {path} ({fmt}) has rank {got[rank_dim]} at {module}; set train.lora_rank to it"
    return f"{where}: {path} ({fmt}): {module}'s lora_{which} is {got}, this model's {want} (a LoRA of another model size?)"


def check_lora_format(modules: list[str], family: FamilyAdapter, fmt: str) -> None:
    """At setup, before any step: every adapted module has a name in `fmt` (found now, not at the end)."""
    if fmt not in FORMATS:
        raise LoraError(f"train.lora_format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "diffusers":
        return
    if fmt == "comfy":
        unnamed = [m for m in modules if family.lora_key(m) is None]
        if unnamed:
            raise LoraError(f"train.lora_target_modules: {unnamed[0]} has no {family.name} name outside diffusers; "
                            f"target attention/MLP projections only")
        return
    if family.name not in ("flux", "wan", "qwen-image"):
        raise LoraError(f"train.lora_format: kohya is written for flux, wan and qwen-image, not {family.name}")
    native = _native_names(modules, family)
    unnamed = [m for m in modules if kohya_module(m, family.name, native[m]) is None]
    if unnamed:
        raise LoraError(f"train.lora_format: kohya: {unnamed[0]} has no {family.name} kohya/musubi-tuner name; "
                        "target the blocks' attention/MLP projections, or use lora_format comfy")
    if family.name == "flux":  # a fused BFL module needs all its members
        fused: dict[str, set[int]] = {}
        for m in modules:
            bfl, index, n = bfl_layout(m)
            if n > 1:
                fused.setdefault(bfl, set()).add(index)
        partial = [b for b, got in fused.items() if len(got) != (4 if b.endswith("linear1") else 3)]
        if partial:
            raise LoraError(f"train.lora_format: kohya: Flux's {partial[0]} is one fused module: target all of its "
                            "parts (to_q, to_k, to_v and, in single blocks, proj_mlp) or use lora_format comfy")
    if family.name == "wan":  # musubi-tuner's reader (and diffusers') wants every projection of a block
        need = {"self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"}
        blocks: dict[str, set[str]] = {}
        for n in native.values():
            _, i, rest = n.split(".", 2)
            blocks.setdefault(i, set()).add(rest)
        short = [(i, sorted(need - got)) for i, got in blocks.items() if need - got]
        if short:
            raise LoraError(f"train.lora_format: kohya (musubi-tuner) Wan files hold every attention and FFN projection "
                            f"of a block; block {short[0][0]} lacks {', '.join(short[0][1])} (set lora_target_modules)")


def _native_names(modules: list[str], family: FamilyAdapter) -> dict[str, str | None]:
    """Each module's name in the family's own convention (our comfy names without their prefix)."""
    out = {}
    for m in modules:
        key = family.lora_key(m)
        out[m] = None if key is None else key.removeprefix(family.lora_prefix)
    return out


def export_lora(model: torch.nn.Module, family: FamilyAdapter, path: str | Path, *, rank: int, alpha: float,
                metadata: dict[str, Any] | None = None, state: dict[str, torch.Tensor] | None = None,
                fmt: str = "comfy") -> dict[str, torch.Tensor]:
    """Write the adapter as one .safetensors in the names of `fmt` (see lora_formats); returns what was
    written. `state` (names as the model's parameters) writes those values instead of the model's (an EMA)."""
    scale = alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, p in (state or dict(model.named_parameters())).items():
        parts = _lora_parts(name)
        if parts is not None:
            pairs.setdefault(parts[0], {})[parts[1]] = p.detach().float().cpu()
    check_lora_format(sorted(pairs), family, fmt)
    out: dict[str, torch.Tensor] = {}
    if fmt == "kohya":  # B as trained and the alpha beside it, as kohya's trainers write them
        out = to_kohya({m: (ab["A"], ab["B"]) for m, ab in pairs.items()}, family.name, rank=rank,
                       alpha=alpha, native=_native_names(sorted(pairs), family))
    else:  # alpha/rank folded into B: every loader applies the same scale (1)
        for module, ab in pairs.items():
            key = family.lora_key(module) if fmt == "comfy" else f"transformer.{module}"
            out[f"{key}.lora_A.weight"] = ab["A"].contiguous()
            out[f"{key}.lora_B.weight"] = (ab["B"] * scale).contiguous()
    meta = {"format": "pt", "offload_jobs.family": family.name, "offload_jobs.lora_format": fmt,
            "lora_rank": str(rank), "lora_alpha": str(alpha), "alpha_folded": str(fmt != "kohya").lower(),
            "ss_network_dim": str(rank), "ss_network_alpha": str(alpha)}
    meta.update({k: str(v) for k, v in (metadata or {}).items()})
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(out, str(tmp), metadata=meta)
    tmp.replace(path)
    return out


def describe(meta: dict[str, str]) -> str:
    return json.dumps({k: meta[k] for k in sorted(meta) if k.startswith(("offload_jobs.", "lora_"))})
