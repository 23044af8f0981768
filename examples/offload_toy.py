"""DiffSynth-Studio's documented OffloadTrainingManager example, on offload-jobs.

Ten Linear(4096) layers with layer_norm, full fine-tune with AdamW and the optimizer offloaded to
the CPU. Runs on the GPU when there is one (else on the CPU, slowly but the same way) and prints the
peak VRAM of a resident run next to the offloaded one.

    python examples/offload_toy.py               # 100 steps at width 4096
    python examples/offload_toy.py --width 512 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import os

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from offload_core import OffloadTrainingManager


class ToyModel(nn.Module):
    def __init__(self, width: int = 4096, depth: int = 10) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.layer_norm(layer(x), x.shape[-1:])
        return x


def train(model: nn.Module, device: str, steps: int, batch: int, offload: bool) -> tuple[float, int]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    manager = None
    if offload:
        manager = OffloadTrainingManager(model, device, enable_optimizer_cpu_offload=True, optimizer=optimizer)
    else:
        model.to(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    width = model.layers[0].in_features
    loss = torch.zeros(())
    # Under offload-jobs, a job reports per-step metrics to this file (the TUI and `show` read it).
    metrics_path = os.environ.get("OFFLOAD_JOBS_METRICS")
    metrics = open(metrics_path, "a") if metrics_path else None
    for step in tqdm(range(steps), desc="offloaded" if offload else "resident"):
        g = torch.Generator(device=device).manual_seed(step)
        x = torch.randn(batch, width, device=device, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        if manager is not None:
            manager.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        if metrics is not None:
            row = {"step": step + 1, "total_steps": steps, "loss": float(loss.detach()), "phase": "offloaded" if offload else "resident"}
            if manager is not None:
                st = manager.stats()
                row.update({k: st[k] for k in ("vram_allocated_bytes", "vram_peak_bytes", "pinned_capacity_bytes",
                                               "pinned_used_bytes", "h2d_bytes", "d2h_bytes", "cache_hits",
                                               "cache_misses", "h2d_gbps", "stall_ms", "prefetch_misses")})
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
    if metrics is not None:
        metrics.close()
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
    if manager is not None:
        manager.remove()
    return float(loss.detach()), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=512)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = ToyModel(args.width)
    twin = copy.deepcopy(model)
    loss_r, peak_r = train(model, device, args.steps, args.batch, offload=False)
    loss_o, peak_o = train(twin, device, args.steps, args.batch, offload=True)
    print(f"device: {device}")
    print(f"final loss: resident {loss_r:.6f}, offloaded {loss_o:.6f}")
    if device == "cuda":
        print(f"peak VRAM: resident {peak_r / 2**30:.2f} GiB, offloaded {peak_o / 2**30:.2f} GiB")
    else:
        print("peak VRAM: n/a on the CPU")


if __name__ == "__main__":
    main()
