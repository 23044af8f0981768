"""What fp8 storage costs in accuracy, per ``fp8_scaling`` (tensor, row, block), on the CPU.

1. **Flux-dev widths** (hidden 3072, 24 heads x 128, joint_attention_dim 4096): one double and one
   single block of diffusers' FluxTransformer2DModel, random weights drawn two ways (``normal``: each
   matrix N(0, 1/fan_in); ``outliers``: the same plus 4 input and 4 output channels x20 in every
   matrix, as real checkpoints have), a fixed input (256 image + 64 text tokens), peft LoRA r16 on the
   attention projections. The reference is the model with bf16 weights (a bf16 checkpoint); each fp8
   variant stores those weights as the engine does (``quant.quantize``, widened to bf16: bitwise what
   a streamed bf16 model computes with, tests/offload_core/test_fp8_scaling.py). Reported: the
   relative error ||y - y_ref|| / ||y_ref|| of the transformer's output and of the LoRA gradients.
   The forward and backward run in fp32, so only the weights' storage differs.
2. **A short LoRA run** on the tiny pipelines' Flux transformer (widened to 4 x 64 heads so its
   matrices span several 128-tiles), through the engine on the CPU (``target_device="cpu"``): fp32
   storage against fp8 per scaling, the same data, timesteps and seed, the loss every 5th step and
   the final loss ratio.

``python -m bench.fp8_quality`` (about 3 minutes on 2 cores); ``--tiny`` shrinks part 1 to test
widths (seconds; the smoke test); ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SCALINGS = ("tensor", "row", "block")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
TINY = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8))
# the tiny pipeline's transformer (scripts/make_tiny_pipelines.py), 4 x 64 heads wide
TRAIN = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=64,
             num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
             axes_dims_rope=(8, 28, 28))


# ---------------------------------------------------------------- part 1: one forward and backward at Flux-dev widths
def build(dims: dict[str, Any], init: str, seed: int = 0) -> nn.Module:
    """The transformer at ``dims`` on the CPU in fp32, weights drawn by ``init`` (normal, outliers)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**dims)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = math.prod(p.shape[1:])
                p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)
                if init == "outliers":
                    rows = torch.randint(0, p.shape[0], (4,), generator=g)
                    cols = torch.randint(0, p.shape[1], (4,), generator=g)
                    p[rows] *= 20
                    p[:, cols] *= 20
            elif name.endswith("weight"):  # norms
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    for name, b in model.named_buffers():
        if b.is_meta:
            raise RuntimeError(f"buffer {name} stayed on the meta device")
    return model.eval()


def inputs(dims: dict[str, Any], img: int, txt: int, seed: int = 1) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    side = int(math.isqrt(img))
    ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(side).float(), torch.arange(side).float(), indexing="ij"), -1)
    return dict(hidden_states=torch.randn(1, img, dims["in_channels"], generator=g),
                encoder_hidden_states=torch.randn(1, txt, dims["joint_attention_dim"], generator=g),
                pooled_projections=torch.randn(1, dims["pooled_projection_dim"], generator=g),
                timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                img_ids=ids.reshape(-1, 3).float(), txt_ids=torch.zeros(txt, 3))


def add_lora(model: nn.Module, rank: int, seed: int = 2) -> list[nn.Parameter]:
    from peft import LoraConfig

    model.requires_grad_(False)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(seed)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    with torch.no_grad():  # B nonzero too, so both A's and B's gradients are measured
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.01, generator=g)
    return lora


def store_weights(model: nn.Module, bf16: dict[str, torch.Tensor], scaling: str | None) -> None:
    """The frozen weights as a bf16 model streaming them would hold: bf16, or fp8 widened to bf16."""
    from offload_core.quant import eligible, quantize, widen

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in bf16.items():
            if scaling is not None and eligible(w, torch.float8_e4m3fn):
                q, s = quantize(w, torch.float8_e4m3fn, scaling=scaling)
                w = widen(q, s, torch.bfloat16)
            params[name].copy_(w)


def forward_backward(model: nn.Module, lora: list[nn.Parameter], x: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    for p in lora:
        p.grad = None
    out = model(**x, return_dict=False)[0]
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    F.mse_loss(out, target).backward()
    return out.detach(), torch.cat([p.grad.reshape(-1) for p in lora])


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def widths_table(dims: dict[str, Any], img: int, txt: int, rank: int) -> list[dict[str, Any]]:
    rows = []
    for init in ("normal", "outliers"):
        model = build(dims, init)
        lora = add_lora(model, rank)
        bf16 = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters() if not p.requires_grad}
        x = inputs(dims, img, txt)
        store_weights(model, bf16, None)
        y_ref, g_ref = forward_backward(model, lora, x)
        for scaling in SCALINGS:
            t0 = time.perf_counter()
            store_weights(model, bf16, scaling)
            y, g = forward_backward(model, lora, x)
            rows.append(dict(init=init, scaling=scaling, out_rel=rel(y, y_ref), grad_rel=rel(g, g_ref),
                             seconds=round(time.perf_counter() - t0, 1)))
            print(f"  {init:8s} {scaling:6s} output {rows[-1]['out_rel']:.4%}  LoRA grads {rows[-1]['grad_rel']:.4%}",
                  file=sys.stderr, flush=True)
        del model, bf16
    return rows


# ---------------------------------------------------------------- part 2: a short LoRA run through the engine
def train_run(scaling: str | None, steps: int, dims: dict[str, Any] = TRAIN, seed: int = 0) -> list[float]:
    """Losses of a LoRA r16 run on the ``dims`` transformer; ``scaling`` None: fp32 storage (no fp8)."""
    from offload_core import enable_offload

    model = build(dims, "normal", seed=seed)  # outliers x20 blow its outputs up hundredfold: no run to compare
    lora = add_lora(model, 16)
    model.train()
    kw: dict[str, Any] = {} if scaling is None else dict(weight_dtype="float8_e4m3fn", fp8_scaling=scaling)
    handle = enable_offload(model, target_device="cpu", offload_granularity="block", **kw)
    opt = torch.optim.AdamW(lora, lr=1e-3)
    g = torch.Generator().manual_seed(seed + 10)
    data = [inputs(dims, 64, 12, seed=100 + i) for i in range(4)]  # four fixed samples
    losses = []
    for step in range(steps):
        x = dict(data[step % len(data)])
        x0 = x["hidden_states"]
        noise = torch.randn(x0.shape, generator=g)
        t = torch.rand(1, generator=g)
        x["hidden_states"], x["timestep"] = (1 - t) * x0 + t * noise, t
        pred = model(**x, return_dict=False)[0]
        loss = F.mse_loss(pred, noise - x0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        handle.remove()
    return losses


def training_table(steps: int, dims: dict[str, Any] = TRAIN) -> dict[str, list[float]]:
    curves = {"fp32": train_run(None, steps, dims)}
    for scaling in SCALINGS:
        curves[f"fp8 {scaling}"] = train_run(scaling, steps, dims)
        print(f"  trained fp8 {scaling}: final loss {curves[f'fp8 {scaling}'][-1]:.5f}", file=sys.stderr, flush=True)
    return curves


# ---------------------------------------------------------------- report
def markdown(widths: list[dict[str, Any]], curves: dict[str, list[float]], label: str) -> str:
    lines = [f"Output and LoRA-gradient error against bf16 weights ({label}):", "",
             "| weights | fp8_scaling | output rel. error | LoRA grad rel. error |", "|---|---|---|---|"]
    for r in widths:
        lines.append(f"| {r['init']} | {r['scaling']} | {r['out_rel']:.3%} | {r['grad_rel']:.3%} |")
    names = list(curves)
    steps = len(curves[names[0]])
    lines += ["", "LoRA r16 losses through the engine (fp32 storage vs fp8 per scaling; same data and seed):", "",
              "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in list(range(0, steps, 5)) + ([steps - 1] if (steps - 1) % 5 else []):
        lines.append(f"| {s + 1} | " + " | ".join(f"{curves[n][s]:.5f}" for n in names) + " |")
    base = curves["fp32"]
    tail = max(1, steps // 5)  # the mean of the last fifth: one step's loss is mostly its timestep's draw
    lines.append("| final / fp32 | " + " | ".join(f"{curves[n][-1] / base[-1]:.4f}" for n in names) + " |")
    lines.append(f"| last {tail} mean / fp32 | " + " | ".join(
        f"{sum(curves[n][-tail:]) / sum(base[-tail:]):.4f}" for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fp8_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="test widths and 6 training steps (seconds)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 40; 6 with --tiny)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dims, img, txt = (TINY, 16, 8) if args.tiny else (FLUX_DEV, 256, 64)
    steps = args.steps or (6 if args.tiny else 40)
    t0 = time.perf_counter()
    widths = widths_table(dims, img, txt, rank=4 if args.tiny else 16)
    curves = training_table(steps, TINY if args.tiny else TRAIN)
    label = ("tiny test widths" if args.tiny else
             "Flux-dev widths, 1 double + 1 single block, 256 image + 64 text tokens, LoRA r16")
    print(markdown(widths, curves, label))
    print(f"\n({time.perf_counter() - t0:.0f} s on the CPU, torch {torch.__version__})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"widths": widths, "curves": curves, "label": label}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
