"""The disk cache's plans on a disk made slow on purpose (CPU): a checkpointed LoRA step of a Flux-shaped
model (19 double blocks 2.4x the size of 38 single ones, small) streamed from shards through a cache of
0.466 of the streamed bytes, every read held to ``--rate`` bytes/s behind one lock (one disk). Prints,
per plan, the bytes and the step time of the settled steps against the floor's (the uses that reach the
store less the cache's bytes in each pass, at that rate) and against the first row's, all in one run.

    python -m bench.disk_paced --rate 3e6 --rate 1e7 --steps 12

Plans: ``static`` (the fixed set, the default where it reads less), ``replay`` (Belady's decisions at
each use, replayed: the plan before the fixed set), ``rank`` (no plan: decided at the read).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

PLANS = ("static", "replay", "rank")
FLUX_LIKE = dict(num_layers=19, num_single_layers=38, attention_head_dim=16, num_attention_heads=4)


class Pacer:
    """One disk: reads are served one after another at ``rate`` bytes/s (the real read, then a wait)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.lock, self.free_at = rate, threading.Lock(), 0.0

    def wrap(self, read: Any) -> Any:
        def paced(reader: Any, entry: Any, buf: torch.Tensor) -> Any:
            got = read(reader, entry, buf)
            with self.lock:
                start = max(time.perf_counter(), self.free_at)
                self.free_at = start + entry.read_nbytes / self.rate
                wait = self.free_at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
            return got
        return paced


def run_one(src: Path, shards: Path, plan: str, rate: float, steps: int, depth: int | None) -> dict[str, Any]:
    from offload_core.disk import cache as cache_mod
    from offload_core.disk.read import UnitReader
    from offload_core_disk_helpers import flux_inputs, offload_flux_lora

    saved = (cache_mod.SlabCache._static, cache_mod.SlabCache.plan, UnitReader.read_unchecked)
    if plan == "replay":
        cache_mod.SlabCache._static = lambda self: None
    elif plan == "rank":
        cache_mod.SlabCache.plan = lambda self: None
    UnitReader.read_unchecked = Pacer(rate).wrap(UnitReader.read_unchecked)
    try:
        model, handle = offload_flux_lora(src, shards, **({"prefetch": depth} if depth else {}))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model.train()
        rows = []
        for _ in range(steps):
            before, t0 = handle.stats(), time.perf_counter()
            model(**flux_inputs(), return_dict=False)[0].pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            after = handle.stats()
            rows.append({"s": time.perf_counter() - t0,
                         **{k: after[k] - before[k] for k in ("disk_bytes", "disk_read_s", "disk_cache_hit_bytes",
                                                               "disk_cache_miss_bytes")}})
        capacity = handle.stats()["disk_cache_capacity_bytes"]
        handle.remove()
    finally:
        cache_mod.SlabCache._static, cache_mod.SlabCache.plan, UnitReader.read_unchecked = saved
    later = rows[len(rows) // 2:]
    med = {k: statistics.median(r[k] for r in later) for k in later[0]}
    floor_bytes = med["disk_cache_hit_bytes"] + med["disk_cache_miss_bytes"] - 2 * capacity
    return {"plan": plan, "rate": rate, "depth": depth, "step_s": med["s"], "disk_bytes": med["disk_bytes"],
            "disk_busy": med["disk_read_s"] / med["s"], "floor_bytes": floor_bytes,
            "x_floor_bytes": med["disk_bytes"] / floor_bytes, "x_floor_time": med["s"] / (floor_bytes / rate)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.disk_paced", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, action="append", help="the disk's bytes/s (repeatable; default 3e6 and 1e7)")
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated, of {', '.join(PLANS)}")
    ap.add_argument("--steps", type=int, default=12, help="steps per row; the later half are the settled ones")
    ap.add_argument("--depth", type=int, default=None, help="the engine's prefetch depth (default: its own)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    plans = [p for p in args.plans.split(",") if p]
    bad = [p for p in plans if p not in PLANS]
    if bad:
        print(f"--plans: {', '.join(bad)} is not one of {', '.join(PLANS)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "_helpers"))
    from offload_core.shard import shard_checkpoint
    from offload_core_disk_helpers import tiny_flux

    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="oj-paced-"))
    tiny_flux(**FLUX_LIKE).save_pretrained(root / "src")
    shard_checkpoint(root / "src", root / "shards", progress=False)
    out = []
    print(f"{'rate MB/s':>9} {'plan':>7} {'s/step':>7} {'MB/step':>8} {'x floor bytes':>13} {'x floor time':>12} "
          f"{'disk busy':>9} {'x first plan':>12}", flush=True)
    for rate in args.rate or [3e6, 1e7]:
        first = None
        for plan in plans:
            r = run_one(root / "src", root / "shards", plan, rate, args.steps, args.depth)
            first = first or r["step_s"]
            r["x_first_plan"] = r["step_s"] / first
            out.append(r)
            print(f"{rate / 1e6:>9.1f} {plan:>7} {r['step_s']:>7.2f} {r['disk_bytes'] / 1e6:>8.2f} {r['x_floor_bytes']:>13.3f} "
                  f"{r['x_floor_time']:>12.3f} {r['disk_busy']:>9.2f} {r['x_first_plan']:>12.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
