"""Tiny seeded models, tricky module trees and their inputs for the offload_core tests.

Every builder is deterministic: the same name gives bitwise the same weights, so a resident model
and its deepcopy (the one the engine gets) start identical. A `Case` bundles a builder, a seeded
input maker, the forward call and the loss, so the test files stay short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH = 32
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def _ckpt(module: nn.Module, enabled: bool, *args: torch.Tensor, reentrant: bool = False) -> torch.Tensor:
    # Non-reentrant checkpointing, as diffusers does, unless asked; only while grad is on.
    if enabled and torch.is_grad_enabled():
        return checkpoint(module, *args, use_reentrant=reentrant)
    return module(*args)


class CheckpointMixin:
    gradient_checkpointing: bool = False
    checkpoint_reentrant: bool = False  # torch's older default (use_reentrant=True): recomputes inside backward

    def enable_gradient_checkpointing(self) -> None:
        self.gradient_checkpointing = True


# ---------------------------------------------------------------- the toy model (DiffSynth's example)
class ToyLayer(nn.Module):
    """Linear followed by layer_norm without weights, as in DiffSynth-Studio's offload example."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return F.layer_norm(x, x.shape[-1:])


class ToyModel(CheckpointMixin, nn.Module):
    """DiffSynth's 10 x Linear(4096) + layer_norm, scaled down to width 64."""

    def __init__(self, width: int = 64, num_layers: int = 10) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ToyLayer(width) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = _ckpt(layer, self.gradient_checkpointing, x)
        return x


# ---------------------------------------------------------------- tricky trees
class MLPBlock(nn.Module):
    def __init__(self, dim: int = WIDTH, hidden: int = 2 * WIDTH) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TiedTree(CheckpointMixin, nn.Module):
    """Tied weights: embedding <-> head (LM style), and one Linear shared by blocks 0 and 2."""

    def __init__(self, vocab: int = 40, dim: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.adapter_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(3))
        self.blocks[2].fc1.weight = self.blocks[0].fc1.weight  # shared across two block units
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied across two top-level children

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(self.embed(ids))
        for block in self.blocks:
            x = _ckpt(block, self.gradient_checkpointing, x)
        return self.head(self.norm(x))


class CalledTwiceTree(CheckpointMixin, nn.Module):
    """A standalone module and a ModuleList item each run twice in one forward, out of order."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.adapter_in = nn.Linear(dim, dim)
        self.shared = MLPBlock(dim)
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.adapter_in(x))
        for i in (0, 1, 0, 2):
            x = _ckpt(self.blocks[i], self.gradient_checkpointing, x)
        return self.head(self.shared(x))


class BNBlock(nn.Module):
    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.bn = nn.BatchNorm1d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.bn(self.fc(x)))


class BatchNormTree(CheckpointMixin, nn.Module):
    """BatchNorm layers whose running stats change in training mode (in blocks and at the top as `bn`)."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.adapter_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(BNBlock(dim) for _ in range(3))
        self.bn = nn.BatchNorm1d(dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(x)
        for block in self.blocks:
            x = _ckpt(block, self.gradient_checkpointing, x, reentrant=self.checkpoint_reentrant)
        return self.head(self.bn(x))


class GatedBlock(nn.Module):
    """A non-leaf module that holds a parameter and a buffer of its own next to its children."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.gate = nn.Parameter(torch.randn(dim) * 0.1 + 1.0)
        self.register_buffer("shift", torch.randn(dim) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * self.fc2(F.gelu(self.fc1(x))) + self.shift


class OrphanParamTree(CheckpointMixin, nn.Module):
    """Parameters held directly by non-leaf modules: the root's `pos` and each block's `gate`."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(dim) * 0.1)
        self.adapter_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(GatedBlock(dim) for _ in range(3))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(x) + self.pos
        for block in self.blocks:
            x = _ckpt(block, self.gradient_checkpointing, x)
        return self.head(x)


class AttnBlock(nn.Module):
    def __init__(self, dim: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm(x)
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in (self.q(h), self.k(h), self.v(h)))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        return x + self.out(a)


class ConvBlock(nn.Module):
    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1)
        self.norm = nn.GroupNorm(4, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.conv(x.transpose(1, 2))).transpose(1, 2)


class HeteroTree(CheckpointMixin, nn.Module):
    """One ModuleList whose items differ in type and size, including one without weights."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.adapter_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([
            MLPBlock(dim, hidden=dim),
            AttnBlock(dim),
            nn.GELU(),
            MLPBlock(dim, hidden=8 * dim),  # the largest unit: slots must fit it
            ConvBlock(dim),
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim)),
        ])
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(x)
        for block in self.blocks:
            x = _ckpt(block, self.gradient_checkpointing, x)
        return self.head(x)


class MHATree(CheckpointMixin, nn.Module):
    """nn.MultiheadAttention: in_proj_weight sits on the non-leaf module, and out_proj's weight is
    read by its parent without out_proj's forward ever running."""

    def __init__(self, dim: int = WIDTH) -> None:
        super().__init__()
        self.adapter_in = nn.Linear(dim, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, 2, batch_first=True) for _ in range(2))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.adapter_in(x)
        for attn in self.attn:
            x = x + _ckpt(_MHACall(attn), self.gradient_checkpointing, x)
        return self.head(x)


class _MHACall(nn.Module):
    def __init__(self, attn: nn.MultiheadAttention) -> None:
        super().__init__()
        self.__dict__["attn"] = attn  # not registered: keeps the tree unchanged

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


# ---------------------------------------------------------------- DiT stacks for the GPU tests
class DiTBlock(nn.Module):
    """A transformer block at GPU-test widths: LayerNorm, attention (q, k, v, out), GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.ff_in = nn.Linear(d, 4 * d)
        self.ff_out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, n, self.heads, d // self.heads).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.to_out(a)
        return x + self.ff_out(F.gelu(self.ff_in(self.norm2(x))))


class DiT(nn.Module):
    """DiT blocks in a ModuleList, each checkpointed when ``ckpt`` (non-reentrant, or ``"reentrant"``)."""

    def __init__(self, d: int, heads: int, depth: int, ckpt: bool | str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DiTBlock(d, heads) for _ in range(depth))
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt == "reentrant" and torch.is_grad_enabled() and not x.requires_grad:
            # a reentrant checkpoint passes gradients only through inputs that need them (what
            # transformers' enable_input_require_grads() arranges for LoRA)
            x = x.detach().requires_grad_()
        for blk in self.blocks:
            x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else blk(x)
        return x


def add_dit_lora(model: nn.Module, r: int) -> None:
    """peft LoRA of rank r on every DiT linear; the base frozen."""
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    cfg = LoraConfig(r=r, lora_alpha=r, init_lora_weights="gaussian",
                     target_modules=["to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out"])
    inject_adapter_in_model(cfg, model)



# ---------------------------------------------------------------- diffusers models (RECIPES.md)
def _flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                  guidance_embeds=False, axes_dims_rope=(4, 4, 8))


def _flux_inputs() -> dict[str, Any]:
    return dict(hidden_states=torch.randn(1, 64, 4), encoder_hidden_states=torch.randn(1, 12, 32),
                pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]), img_ids=torch.randn(64, 3),
                txt_ids=torch.zeros(12, 3))


def _sd3() -> nn.Module:
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8,
                                 num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96)


def _sd3_inputs() -> dict[str, Any]:
    return dict(hidden_states=torch.randn(1, 4, 16, 16), encoder_hidden_states=torch.randn(1, 12, 32),
                pooled_projections=torch.randn(1, 64), timestep=torch.tensor([10]))


def _wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _wan_inputs() -> dict[str, Any]:
    return dict(hidden_states=torch.randn(1, 4, 2, 16, 16), encoder_hidden_states=torch.randn(1, 12, 16),
                timestep=torch.tensor([10]))


def _qwen() -> nn.Module:
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=3, joint_attention_dim=16,
                                       guidance_embeds=False, axes_dims_rope=(8, 4, 4))


def _qwen_inputs() -> dict[str, Any]:
    return dict(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 7, 16),
                encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.long), timestep=torch.tensor([1.0]),
                img_shapes=[(1, 4, 4)])


def _vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
                         latent_channels=4, norm_num_groups=32, sample_size=32)


def _add_lora(model: nn.Module) -> None:
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=LORA_TARGETS))


# ---------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    factory: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, Any]]  # draws from torch's global RNG; seed before calling
    diffusers: bool = False
    # Parameter-name prefixes left trainable in "adapter" mode (custom models; diffusers use peft LoRA).
    trainable: tuple[str, ...] = ()

    def build(self, mode: str = "frozen", checkpointing: bool = False, seed: int = 0) -> nn.Module:
        """mode: "frozen" (inference), "adapter" (frozen base + LoRA/adapter) or "full" (all trainable)."""
        torch.manual_seed(seed)
        model = self.factory()
        if mode == "frozen":
            model.requires_grad_(False)
            model.eval()
        elif mode == "adapter":
            if self.diffusers:
                _add_lora(model)
            else:
                for name, p in model.named_parameters():
                    p.requires_grad_(name.startswith(self.trainable))
            model.train()
        elif mode == "full":
            model.requires_grad_(True)
            model.train()
        else:
            raise ValueError(mode)
        if checkpointing:
            model.enable_gradient_checkpointing()
        return model

    def make_inputs(self, seed: int) -> dict[str, Any]:
        torch.manual_seed(seed)
        return self.inputs()

    def forward(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if self.diffusers:
            return model(**inputs, return_dict=False)[0]
        return model(**inputs)

    def loss(self, out: torch.Tensor, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + 7919)
        if self.name == "tied":
            target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
            return F.cross_entropy(out.flatten(0, -2), target.flatten())
        target = torch.randn(out.shape, generator=g)
        return F.mse_loss(out.float(), target)


def _x(*shape: int) -> Callable[[], dict[str, Any]]:
    return lambda: {"x": torch.randn(*shape)}


_ADAPTER = ("adapter_in.",)
CASES: dict[str, Case] = {c.name: c for c in [
    Case("toy", ToyModel, _x(4, 64), trainable=tuple(f"layers.{i}." for i in range(1, 10, 2))),
    Case("flux", _flux, _flux_inputs, diffusers=True),
    Case("sd3", _sd3, _sd3_inputs, diffusers=True),
    Case("wan", _wan, _wan_inputs, diffusers=True),
    Case("qwen", _qwen, _qwen_inputs, diffusers=True),
    Case("vae", _vae, lambda: {"sample": torch.randn(1, 3, 32, 32)}, diffusers=True),
    Case("tied", TiedTree, lambda: {"ids": torch.randint(0, 40, (2, 8))}, trainable=_ADAPTER),
    Case("called_twice", CalledTwiceTree, _x(2, 8, WIDTH), trainable=_ADAPTER),
    Case("batchnorm", BatchNormTree, _x(16, WIDTH), trainable=_ADAPTER),
    Case("orphan_param", OrphanParamTree, _x(2, 8, WIDTH), trainable=_ADAPTER),
    Case("hetero", HeteroTree, _x(2, 8, WIDTH), trainable=_ADAPTER),
    Case("mha", MHATree, _x(2, 8, WIDTH), trainable=_ADAPTER),
]}

DIFFUSERS_TRAINABLE = ["flux", "sd3", "wan", "qwen"]
TREES = ["tied", "called_twice", "batchnorm", "orphan_param", "hetero"]


def inductor_reason() -> str | None:
    """Why torch.compile cannot run on this CPU (no C compiler, a broken toolchain), or None."""
    try:
        torch.compile(lambda x: x * 2 + 1, dynamic=False)(torch.ones(4))
    except Exception as exc:  # what inductor raises here varies with the toolchain
        return f"inductor cannot compile on this CPU: {type(exc).__name__}: {str(exc)[:200]}"
    return None


# ---------------------------------------------------------------- running a case
@dataclass
class Trace:
    """What one training run produced, step by step, for bitwise comparison."""

    outputs: list[torch.Tensor]
    losses: list[torch.Tensor]
    grads: list[dict[str, torch.Tensor | None]]
    h2d_bytes: list[int]  # the engine's cumulative counter after each step (empty when resident)


def make_optimizer(model: nn.Module, lr: float = 1e-3, fused: bool = False) -> torch.optim.Optimizer:
    # On model.parameters(), before the engine is installed, as DiffSynth users do. fused: torch's
    # fused kernel (what optimizer offload steps streamed parameters with by default).
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=fused or None)


def trainable_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (None if p.grad is None else p.grad.detach().clone())
            for n, p in model.named_parameters() if p.requires_grad}


def train(case: Case, model: nn.Module, optimizer: torch.optim.Optimizer, *, steps: int, accum: int = 1,
          after_backward: Callable[[], None] | None = None, stats: Callable[[], dict] | None = None,
          check: Callable[[nn.Module], None] | None = None) -> Trace:
    """DiffSynth order: backward (x accum), after_backward, step, zero_grad; seeded inputs per micro-step."""
    trace = Trace([], [], [], [])
    for step in range(steps):
        step_loss = None
        for micro in range(accum):
            seed = 1000 + 100 * step + micro
            out = case.forward(model, case.make_inputs(seed))
            loss = case.loss(out, seed) / accum
            loss.backward()
            if micro == 0:
                trace.outputs.append(out.detach().clone())
            step_loss = loss.detach().clone() if step_loss is None else step_loss + loss.detach()
        if after_backward is not None:
            after_backward()
        trace.losses.append(step_loss)
        trace.grads.append(trainable_grads(model))
        optimizer.step()
        optimizer.zero_grad()
        if stats is not None:
            trace.h2d_bytes.append(int(stats()["h2d_bytes"]))
        if check is not None:
            check(model)
    return trace


@torch.no_grad()
def infer(case: Case, model: nn.Module, seeds: tuple[int, ...] = (0, 1, 2)) -> list[torch.Tensor]:
    # Several passes: the first traces the unit order, the later ones prefetch along it.
    return [case.forward(model, case.make_inputs(s)).clone() for s in seeds]


def assert_bitwise(ref: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(ref) == len(got), f"{what}: {len(ref)} vs {len(got)} entries"
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}[{i}]: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise AssertionError(f"{what}[{i}] differs bitwise (max abs diff {diff:.3g})")


def assert_traces_equal(ref: Trace, got: Trace) -> None:
    assert_bitwise(ref.outputs, got.outputs, "output of step")
    assert_bitwise(ref.losses, got.losses, "loss of step")
    assert len(ref.grads) == len(got.grads)
    for step, (ga, gb) in enumerate(zip(ref.grads, got.grads)):
        assert ga.keys() == gb.keys(), f"step {step}: trainable params differ: {sorted(ga.keys() ^ gb.keys())}"
        for name, a in ga.items():
            b = gb[name]
            assert (a is None) == (b is None), f"step {step}: grad of {name}: {a is None=} vs {b is None=}"
            if a is not None:
                assert b.device == a.device, f"step {step}: grad of {name} on {b.device}, expected {a.device}"
                assert_bitwise([a], [b], f"step {step}: grad of {name}")


def assert_state_equal(ref: dict[str, torch.Tensor], model: nn.Module, what: str = "state") -> None:
    got = model.state_dict()
    assert ref.keys() == got.keys(), f"{what}: keys differ: {sorted(ref.keys() ^ got.keys())}"
    for name, a in ref.items():
        b = got[name]
        assert b.shape == a.shape, f"{what}: {name} has shape {tuple(b.shape)}, expected {tuple(a.shape)}"
        assert torch.equal(a, b), f"{what}: {name} differs bitwise"


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():  # named_parameters already drops tied duplicates
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def frozen_param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for _, p in unique_params(model) if not p.requires_grad)


def hook_counts(model: nn.Module) -> dict[str, int]:
    """Number of hooks of each kind on every module, to see that remove() takes all of them away."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
             "_state_dict_hooks", "_load_state_dict_pre_hooks")
    return {f"{name or '<root>'}.{k}": len(getattr(m, k, {})) for name, m in model.named_modules() for k in kinds}


_REFERENCES: dict[tuple, tuple[Trace, dict[str, torch.Tensor]]] = {}


def reference(case: Case, model: nn.Module, *, mode: str, checkpointing: bool, steps: int,
              accum: int = 1, fused: bool = False) -> tuple[Trace, dict[str, torch.Tensor]]:
    """Train the resident model A once per configuration; later tests reuse the (deterministic) result."""
    key = (case.name, mode, checkpointing, steps, accum, fused)
    if key not in _REFERENCES:
        trace = train(case, model, make_optimizer(model, fused=fused), steps=steps, accum=accum)
        _REFERENCES[key] = (trace, snapshot(model))
    return _REFERENCES[key]
