"""A tiny real training job for the dashboard's tests and cost bench: the engine on the CPU.

A few Linear blocks, LoRA-style (frozen weights streamed by the engine, one trainable head), each
step writing the engine's real `stats()` plus step, loss, lr, it_s, eta_seconds and host memory to
$OFFLOAD_JOBS_METRICS through the runners' records (jobs/contract.py: it cannot drift from them), at
up to `--rate` rows a second. `--samples` writes PNGs under outputs/samples and a checkpoint with a
completion marker; `--nan-from` makes the loss NaN from that step on.

    python bench/tui_job.py --steps 50 --rate 10 --samples
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from jobs.contract import Metric, StepMetrics, engine_stats
from offload_core import enable_offload


def png(path: Path, w: int, h: int, seed: int) -> None:
    """A small RGB gradient PNG written with zlib (no imaging library needed)."""
    rows = b"".join(b"\x00" + bytes(((x * 255 // w + seed * 40) % 256, (y * 255 // h) % 256, (seed * 70) % 256)
                                    [c] for x in range(w) for c in range(3)) for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes((8, 2, 0, 0, 0))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rate", type=float, default=10.0, help="metric rows per second (at most)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--samples", action="store_true")
    ap.add_argument("--nan-from", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=1)
    a = ap.parse_args()
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.blocks)]).requires_grad_(False)
    head = nn.Linear(a.width, 1)
    handle = enable_offload(blocks, target_device="cpu", offload_granularity="block", prefetch=1, record_timings=True)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-2)
    metrics = open(os.environ.get("OFFLOAD_JOBS_METRICS", os.devnull), "a")
    out = Path(os.environ.get("OFFLOAD_JOBS_RUN_DIR", ".")) / "outputs"
    try:
        import psutil

        proc, host_total = psutil.Process(), psutil.virtual_memory().total
    except ImportError:
        proc, host_total = None, None
    t0 = time.monotonic()
    for step in range(1, a.steps + 1):
        x = torch.randn(16, a.width, generator=torch.Generator().manual_seed(step))
        loss = (head(blocks(x)) - 1.0).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = time.monotonic() - t0
        st = engine_stats(handle.stats())
        row = {**StepMetrics(step=step, total_steps=a.steps, loss=float(loss.detach()), lr=1e-2,
                             it_s=step / elapsed if elapsed else None, eta_seconds=(a.steps - step) * elapsed / step,
                             host_rss_bytes=proc.memory_info().rss if proc else None,
                             host_total_bytes=host_total), **st}
        if a.nan_from and step >= a.nan_from:
            row[Metric.loss] = float("nan")
        metrics.write(json.dumps(row) + "\n")
        metrics.flush()
        if step % a.log_every == 0:
            print(f"step {step}/{a.steps} loss {row[Metric.loss]:.5f} h2d {st[Metric.h2d_gbps]:.3f} GB/s", flush=True)
        if a.samples and step % max(1, a.steps // 2) == 0:
            (out / "samples").mkdir(parents=True, exist_ok=True)
            png(out / "samples" / f"step-{step:05d}.png", 32, 32, step)
            ck = out / "checkpoints" / f"step-{step:05d}"
            ck.mkdir(parents=True, exist_ok=True)
            torch.save(head.state_dict(), ck / "head.pt")
            (ck / "COMPLETE").write_text(str(step))
        wait = t0 + step / a.rate - time.monotonic()
        if wait > 0:
            time.sleep(wait)
    handle.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
