"""P1, P2, P3, flux-dev-lora-8g and flux-dev-infer-8g: how to build each model and its inputs, and what one step of it is.

A workload builds one CPU master model; every variant runs on a deep copy of it, with the same
inputs, so outputs are comparable bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .models import (
    FLUX_DEV_WIDTHS,
    FLUX_LORA_TARGETS,
    FLUX_TINY,
    build_dit_lora,
    build_flux,
    build_flux_lora,
    build_linear_toy,
    tensor_bytes,
)

__all__ = ["Workload", "WORKLOADS", "get_workload"]


@dataclass
class Workload:
    """One benchmark problem.

    `h2d_crossings` / `d2h_crossings`: how many times the streamed bytes must cross PCIe per step
    at the least; the floor is max(resident time, crossed bytes / pinned H2D GB/s).
    """

    name: str
    title: str
    train: bool
    build: Callable[[], nn.Module]
    make_inputs: Callable[[torch.device], dict[str, torch.Tensor]]
    h2d_crossings: int
    d2h_crossings: int = 0
    # Trainable parameters streamed too (full fine-tune) vs kept resident (LoRA).
    streams_trainable: bool = False
    optimizer_offload: bool = False
    lr: float = 1e-4
    floor_note: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    # Our variants run under this per-process VRAM cap (torch.cuda.set_per_process_memory_fraction),
    # emulating a smaller card; resident runs uncapped. Paired rounds cannot hold both at once.
    vram_cap_bytes: int | None = None

    def streamed_bytes(self, model: nn.Module) -> int:
        """Bytes that must be streamed each time the model runs once (frozen weights, and trainable ones if streamed)."""
        if not self.train or self.streams_trainable:
            return tensor_bytes(model)
        return tensor_bytes(model, trainable=False) + sum(b.numel() * b.element_size() for b in model.buffers())

    def must_cross_bytes(self, model: nn.Module) -> int:
        return self.streamed_bytes(model) * (self.h2d_crossings + self.d2h_crossings)

    # -- one step ---------------------------------------------------------------------------
    def forward(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.name == "p1" or self.name.startswith("flux"):
            return model(**{k: v for k, v in inputs.items() if k != "target"}, return_dict=False)[0]
        return model(inputs["x"])

    def loss(self, model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.forward(model, inputs)
        return F.mse_loss(out.float(), inputs["target"].float())

    def make_optimizer(self, model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.lr, fused=True) if fused else torch.optim.AdamW(params, lr=self.lr)


# ---- P1: Flux inference -----------------------------------------------------------------------


def _flux_inputs(cfg: dict[str, Any], side: int, txt: int, target: bool = False) -> Callable:
    def make_inputs(device: torch.device) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        dt = torch.bfloat16
        img_ids = torch.zeros(side, side, 3)
        img_ids[..., 1] = torch.arange(side)[:, None]
        img_ids[..., 2] = torch.arange(side)[None, :]
        inputs = {
            "hidden_states": torch.randn(1, side * side, cfg["in_channels"], generator=g).to(dt),
            "encoder_hidden_states": torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(dt),
            "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(dt),
            "timestep": torch.tensor([0.5], dtype=dt),
            "img_ids": img_ids.reshape(-1, 3),
            "txt_ids": torch.zeros(txt, 3),
        }
        if target:
            inputs["target"] = torch.randn(1, side * side, cfg["in_channels"], generator=g).to(dt)
        return {k: v.to(device) for k, v in inputs.items()}

    return make_inputs


def _flux(tiny: bool) -> Workload:
    cfg = FLUX_TINY if tiny else FLUX_DEV_WIDTHS
    double, single = (1, 1) if tiny else (4, 8)
    side = 16 if tiny else 64  # 1024x1024 -> 128x128 latents -> 64x64 tokens of 2x2 patches
    txt = 16 if tiny else 512
    width = cfg["attention_head_dim"] * cfg["num_attention_heads"]
    make_inputs = _flux_inputs(cfg, side, txt)

    return Workload(
        name="p1",
        title=f"Flux inference, {double}+{single} blocks, width {width}, {side * side}+{txt} tokens, bf16",
        train=False,
        build=lambda: build_flux(cfg, double, single, torch.bfloat16),
        make_inputs=make_inputs,
        h2d_crossings=1,
        floor_note="every weight crosses once per forward",
        info={"double_blocks": double, "single_blocks": single, "width": width, "tokens": side * side + txt},
    )


# ---- P2: LoRA training with checkpointing -----------------------------------------------------


def _lora(tiny: bool, lora_dtype: torch.dtype = torch.bfloat16) -> Workload:
    # bf16 adapters by default: fp32 ones make peft cast every adapted input to fp32 and back,
    # which slows the resident step and so hides the copies behind a slower floor.
    depth, width, heads, rank, tokens = (2, 256, 4, 8, 64) if tiny else (24, 3072, 24, 32, 4096)

    def make_inputs(device: torch.device) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(2)
        x = torch.randn(1, tokens, width, generator=g).to(torch.bfloat16)
        target = torch.randn(1, tokens, width, generator=g).to(torch.bfloat16)
        return {"x": x.to(device), "target": target.to(device)}

    return Workload(
        name="p2",
        title=(
            f"LoRA r{rank} ({str(lora_dtype).removeprefix('torch.')}) training, {depth} blocks x {width}, "
            f"tokens (1,{tokens},{width}), bf16, checkpointed"
        ),
        train=True,
        build=lambda: build_dit_lora(depth, width, heads, rank, torch.bfloat16, lora_dtype),
        make_inputs=make_inputs,
        h2d_crossings=2,
        lr=1e-4,
        floor_note="frozen weights cross twice per step: forward, then the recompute that backward shares",
        info={"depth": depth, "width": width, "heads": heads, "lora_rank": rank, "lora_dtype": str(lora_dtype).removeprefix("torch."), "tokens": tokens},
    )


# ---- P3: full fine-tune with optimizer offload ------------------------------------------------


def _toy(tiny: bool) -> Workload:
    depth, width, batch = (10, 256, 32) if tiny else (10, 4096, 512)

    def make_inputs(device: torch.device) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return {
            "x": torch.randn(batch, width, generator=g).to(device),
            "target": torch.randn(batch, width, generator=g).to(device),
        }

    return Workload(
        name="p3",
        title=f"full fine-tune, {depth} x Linear({width}) + layer_norm, fp32, AdamW, batch {batch}, optimizer offloaded",
        train=True,
        build=lambda: build_linear_toy(depth, width, torch.float32),
        make_inputs=make_inputs,
        h2d_crossings=2,
        d2h_crossings=1,
        streams_trainable=True,
        optimizer_offload=True,
        lr=1e-5,
        floor_note=(
            "weights cross H2D twice (forward; backward, as autograd needs W^T) and grads D2H once; all three "
            "counted at the H2D rate, serially (conservative: a both-directions overlap would lower it)"
        ),
        info={"depth": depth, "width": width, "batch": batch},
    )


# ---- flux-dev-lora-8g: full Flux-dev dims, LoRA training on an 8 GiB card ----------------------


def _flux_dev_dims(tiny: bool) -> tuple[dict[str, Any], int, int, int, int, int]:
    """Flux-dev's widths, 19+38 blocks, 1024x1024 (64x64 tokens) and 512 text tokens (tiny: a toy of them):
    (config, double blocks, single blocks, token side, text tokens, width)."""
    cfg = FLUX_TINY if tiny else FLUX_DEV_WIDTHS
    double, single = (1, 2) if tiny else (19, 38)
    return (cfg, double, single, 16 if tiny else 64, 16 if tiny else 512,
            cfg["attention_head_dim"] * cfg["num_attention_heads"])


def _flux_dev_lora(tiny: bool, lora_dtype: torch.dtype = torch.bfloat16) -> Workload:
    cfg, double, single, side, txt, width = _flux_dev_dims(tiny)
    rank = 4 if tiny else 32
    return Workload(
        name="flux-dev-lora-8g",
        title=(f"Flux-dev dims LoRA r{rank}{'' if lora_dtype == torch.bfloat16 else ' (fp32 adapters)'} training, "
               f"{double}+{single} blocks, width {width}, {side * side}+{txt} tokens, bf16, checkpointed, ours under an "
               "8 GiB cap"),
        train=True,
        build=lambda: build_flux_lora(cfg, double, single, rank, torch.bfloat16, lora_dtype=lora_dtype),
        make_inputs=_flux_inputs(cfg, side, txt, target=True),
        h2d_crossings=2,
        lr=1e-4,
        floor_note="frozen weights cross twice per step: forward, then the recompute that backward shares",
        info={"double_blocks": double, "single_blocks": single, "width": width, "lora_rank": rank,
              "lora_dtype": str(lora_dtype).removeprefix("torch."), "lora_targets": ",".join(FLUX_LORA_TARGETS), "tokens": side * side + txt},
        vram_cap_bytes=None if tiny else 8 << 30,
    )


# ---- flux-dev-infer-8g: full Flux-dev dims, one denoising step's forward on an 8 GiB card ----------


def _flux_dev_infer(tiny: bool) -> Workload:
    cfg, double, single, side, txt, width = _flux_dev_dims(tiny)
    return Workload(
        name="flux-dev-infer-8g",
        title=(f"Flux-dev dims inference (one denoising step), {double}+{single} blocks, width {width}, "
               f"{side * side}+{txt} tokens, bf16, ours under an 8 GiB cap"),
        train=False,
        build=lambda: build_flux(cfg, double, single, torch.bfloat16),
        make_inputs=_flux_inputs(cfg, side, txt),
        h2d_crossings=1,
        floor_note="every weight crosses once per forward",
        info={"double_blocks": double, "single_blocks": single, "width": width, "tokens": side * side + txt},
        vram_cap_bytes=None if tiny else 8 << 30,
    )


WORKLOADS: dict[str, Callable[[bool], Workload]] = {"p1": _flux, "p2": _lora, "p3": _toy,
                                                    "flux-dev-lora-8g": _flux_dev_lora,
                                                    "flux-dev-infer-8g": _flux_dev_infer}


def get_workload(name: str, tiny: bool, *, lora_dtype: torch.dtype = torch.bfloat16) -> Workload:
    if name == "p2":
        return _lora(tiny, lora_dtype)
    if name == "flux-dev-lora-8g":
        return _flux_dev_lora(tiny, lora_dtype)
    return WORKLOADS[name](tiny)
