"""The benchmark's models: Flux at real widths, a plain DiT stack for LoRA, DiffSynth's linear toy.

Every model is built on the meta device and then filled with random values straight into the
storage dtype, so a 5 GB model builds in seconds and never holds an fp32 copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["DiTBlock", "DiTStack", "LinearToy", "build_flux", "build_flux_lora", "fill_random_", "tensor_bytes"]

# Pool of random values that every tensor copies from at its own random offsets: memcpy speed,
# yet no two tensors (and no two blocks) hold the same values, so a unit mix-up shows in outputs.
_POOL = 1 << 22
_SLACK = 1 << 20


def fill_random_(module: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill every float parameter and buffer in place: weights ~ N(0, std), norm scales ~ 1 + N(0, std)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(_POOL + _SLACK, generator=gen) * std
    with torch.no_grad():
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point() or t.device.type == "meta":
                continue
            flat = t.view(-1)
            n = flat.numel()
            for start in range(0, n, _POOL):
                length = min(_POOL, n - start)
                off = int(torch.randint(0, _SLACK, (1,), generator=gen))
                flat[start : start + length].copy_(pool[off : off + length])
            if t.dim() == 1 and "norm" in name and name.endswith("weight"):
                flat.add_(1.0)
    return module


def tensor_bytes(module: nn.Module, *, trainable: bool | None = None) -> int:
    """Bytes of parameters (and buffers when trainable is None), optionally only (non-)trainable ones."""
    total = 0
    for p in module.parameters():
        if trainable is None or p.requires_grad == trainable:
            total += p.numel() * p.element_size()
    if trainable is None:
        total += sum(b.numel() * b.element_size() for b in module.buffers())
    return total


def _materialize(model: nn.Module, dtype: torch.dtype, seed: int) -> nn.Module:
    model.to(dtype)  # cast on meta: free, and to_empty then allocates the final dtype only
    model.to_empty(device="cpu")
    fill_random_(model, seed=seed)
    return model


# ---- P1: Flux ---------------------------------------------------------------------------------

FLUX_DEV_WIDTHS: dict[str, Any] = dict(
    patch_size=1,
    in_channels=64,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
FLUX_TINY: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(8, 12, 12),
)


def build_flux(config: dict[str, Any], num_layers: int, num_single_layers: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # its fp32-modules notice on .to(bf16) is noise here

    with init_empty_weights():
        model = FluxTransformer2DModel(num_layers=num_layers, num_single_layers=num_single_layers, **config)
    return _materialize(model, dtype, seed).eval().requires_grad_(False)


# Attention and MLP projections of Flux's double and single blocks (and the final projection).
FLUX_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]


def build_flux_lora(config: dict[str, Any], num_layers: int, num_single_layers: int, rank: int, dtype: torch.dtype,
                    seed: int = 0, lora_dtype: torch.dtype | None = None) -> nn.Module:
    """Flux with peft LoRA (weights in ``lora_dtype``, default ``dtype``; B nonzero) on FLUX_LORA_TARGETS,
    gradient checkpointing on. fp32 adapters on a narrower model are the train runner's LoRA: fp32
    weights (and so an fp32 optimizer state) computing in the model's dtype (_as_the_runner_trains)."""
    from peft import LoraConfig

    model = build_flux(config, num_layers, num_single_layers, dtype, seed)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=FLUX_LORA_TARGETS))
    _fill_lora_(model, lora_dtype or dtype, seed + 1)
    _as_the_runner_trains(model, lora_dtype or dtype, dtype)
    model.enable_gradient_checkpointing()
    return model.train()


def _as_the_runner_trains(model: nn.Module, lora_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """fp32 adapters on a bf16 model compute as the train runner's do (jobs/runners/lora.py,
    compute_in_input_dtype: the weights cast to the activations' dtype, not the activations to fp32)."""
    if lora_dtype == torch.float32 and dtype != torch.float32:
        from jobs.runners.lora import compute_in_input_dtype

        compute_in_input_dtype(model)


# ---- P2: a plain DiT stack --------------------------------------------------------------------


class DiTBlock(nn.Module):
    """LayerNorm -> multi-head attention (q, k, v, o) -> LayerNorm -> GELU MLP, both residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width * mlp_ratio)
        self.fc2 = nn.Linear(width * mlp_ratio, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = self.norm1(x)
        q, k, v = (lin(h).view(b, n, self.heads, c // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class DiTStack(nn.Module):
    """A ModuleList of DiT blocks, each checkpointed (non-reentrant) while training."""

    def __init__(self, depth: int, width: int, heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(width, heads) for _ in range(depth))
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


LORA_TARGETS = ["q", "k", "v", "o", "fc1", "fc2"]


def build_dit_lora(
    depth: int, width: int, heads: int, rank: int, dtype: torch.dtype, lora_dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """Frozen base in `dtype` plus peft LoRA on every block linear, its weights in `lora_dtype`."""
    from peft import LoraConfig, inject_adapter_in_model

    with torch.device("meta"):
        model = DiTStack(depth, width, heads)
    _materialize(model, dtype, seed).requires_grad_(False)
    cfg = LoraConfig(r=rank, lora_alpha=rank, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    inject_adapter_in_model(cfg, model)
    _fill_lora_(model, lora_dtype, seed + 1)
    _as_the_runner_trains(model, lora_dtype, dtype)
    return model.train()


def _fill_lora_(model: nn.Module, dtype: torch.dtype, seed: int) -> None:
    """Every LoRA weight random in ``dtype`` and trainable (B nonzero too, so LoRA shapes the first loss)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = (torch.randn(p.shape, generator=gen) * 0.01).to(dtype)
                p.requires_grad_(True)


# ---- P3: DiffSynth's linear toy ---------------------------------------------------------------


class LinearToy(nn.Module):
    """depth x (Linear(width, width) then layer_norm), as in DiffSynth-Studio's offload example."""

    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.layer_norm(layer(x), (x.shape[-1],))
        return x


def build_linear_toy(depth: int, width: int, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    with torch.device("meta"):
        model = LinearToy(depth, width)
    return _materialize(model, dtype, seed).train()
