"""Models, shard directories and a hand-driven use loop for the disk-tier tests (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_core.disk.bind import bind_units
from offload_core.disk.format import ShardIndex, load_index
from offload_core.disk.diskstore import DiskStore
from offload_core.disk.write import shard_model
from offload_core.quant import widen
from offload_core.units import Unit, UnitPlan, discover_units


class Stack(nn.Module):
    """n equal blocks (two Linears each) and a head: the cyclic access of a DiT, small."""

    def __init__(self, n: int = 40, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d)) for _ in range(n)])
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def sharded_stack(tmp: Path, n: int = 40, d: int = 64, seed: int = 0) -> tuple[Stack, UnitPlan, ShardIndex]:
    torch.manual_seed(seed)
    model = Stack(n, d).requires_grad_(False)
    plan = discover_units(model, "block")
    shard_model(model, plan.units, tmp, plan.block_lists)
    return model, plan, load_index(tmp)


def block_units(plan: UnitPlan) -> list[Unit]:
    return [u for u in plan.units if not u.stray]


def open_store(model: nn.Module, units: list[Unit], index: ShardIndex, fraction: float = 0.0, **kw: Any) -> DiskStore:
    entries = bind_units(units, index, model)
    streamed = sum(entries[u.uid].read_nbytes for u in units)
    return DiskStore(units, index, entries, cache_bytes=int(fraction * streamed), **kw)


def one_pass(store: DiskStore, units: list[Unit]) -> None:
    for u in units:
        store.acquire(u.uid)
        store.release(u.uid)


def typed(slab: torch.Tensor, u: Unit, i: int) -> torch.Tensor:
    ts = u.tensors[i]
    raw = slab[ts.store_offset: ts.store_offset + ts.store_nbytes]
    return raw.view(ts.store_dtype or ts.dtype).view(ts.shape)


def bind_from_store(store: DiskStore, units: list[Unit]) -> None:
    """What the engine does per use, by hand: each unit's tensors become (widened) copies of its slab."""
    for u in units:
        slab = store.acquire(u.uid)
        for i, ts in enumerate(u.tensors):
            v = typed(slab, u, i)
            v = widen(v, ts.scale, ts.dtype) if ts.store_dtype is not None else v.clone()
            table = ts.module._parameters if ts.is_param else ts.module._buffers
            old = table[ts.attr]
            table[ts.attr] = nn.Parameter(v, requires_grad=old.requires_grad) if ts.is_param else v
        store.release(u.uid)


def tiny_flux(**kw: Any) -> nn.Module:
    from diffusers import FluxTransformer2DModel

    args = dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
                axes_dims_rope=(4, 4, 8))
    return FluxTransformer2DModel(**{**args, **kw})


def flux_inputs(dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 64, 4, generator=g).to(dtype),
            "encoder_hidden_states": torch.randn(1, 12, 32, generator=g).to(dtype),
            "pooled_projections": torch.randn(1, 32, generator=g).to(dtype),
            "timestep": torch.tensor([0.5], dtype=dtype),
            "img_ids": torch.randn(64, 3, generator=g), "txt_ids": torch.zeros(12, 3)}


def flux_lora_on_meta(src: Path) -> nn.Module:
    """The Flux config at ``src`` on the meta device (its weights come from shards), with a rank-4 LoRA on
    to_q/to_v (seeded) as the only trainable parameters, and gradient checkpointing: a LoRA step's model."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(src))
    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q", "to_v"]))
    g = torch.Generator().manual_seed(3)
    model.load_state_dict({n: torch.randn(p.shape, generator=g) * 0.01 for n, p in model.named_parameters()
                           if "lora" in n}, strict=False, assign=True)
    for n, p in model.named_parameters():
        p.requires_grad_("lora" in n)
    model.enable_gradient_checkpointing()
    return model


def offload_flux_lora(src: Path, shards: Path, fraction: float = 0.466, **kw: Any) -> tuple[nn.Module, Any]:
    """``flux_lora_on_meta(src)`` streamed on the CPU from ``shards`` by block, two disk workers, through a RAM
    cache of ``fraction`` of the blocks' bytes (0.466: under half, as Flux-dev's 16 GiB job has): the model
    and its handle (``kw``: more engine options)."""
    from offload_core import enable_offload
    from offload_core.disk.integrate import max_memory_for

    model = flux_lora_on_meta(src)
    index = load_index(shards)
    blocks = [n for n in index.units if "blocks." in n]
    handle = enable_offload(model, target_device="cpu", lazy_load=True, shard_dir=str(shards), num_disk_workers=2,
                            max_memory=max_memory_for(index, blocks, fraction, 2), offload_granularity="block",
                            disk_direct=False, **kw)
    return model, handle
