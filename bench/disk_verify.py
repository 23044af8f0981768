"""What the shard check costs a disk-bound pass: first-read xxh3 (the default) and sha256 on every
read (``disk_verify: true``) against no check, as ratios measured in one run.

    python -m bench.disk_verify                       # 1 GB of bf16 blocks in a temp dir on the local disk
    python -m bench.disk_verify --size-gb 4 --dir /fast/disk/tmp --reps 5 --json verify.json

Each pass reads every unit once through a DiskStore with no cache (every use is a read, as a cold
first step reads), nothing computed: the pass is as disk-bound as the store can be. The page cache
is dropped before every pass when this process may (else the table says the cache was warm).
The modes run in turns, their order rotated each turn, so a drift of the disk's rate (or of the
box's load) hits them alike; a ratio is the median over the turns of each mode's time over the same
turn's "off".

- off:    every unit marked as checked before the pass (what a later pass in the same process costs)
- first:  the default: each unit's xxh3 checked on its read (the first pass of a process)
- sha256: ``disk_verify: true``: the sha256 on every read

Each pass also records this process's CPU seconds: the check is CPU work beside the disk's wait, so
it hides behind the reads where a core is free and shows in the wall time where none is (a busy
box). "run of N" is derived from the same turns: a job's N passes in one process check only on
the first, so it costs (first + (N - 1) x off) / (N x off).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.disk import build, drop_page_cache
from offload_core.disk import checksum
from offload_core.disk.bind import bind_units
from offload_core.disk.format import ShardIndex, load_index
from offload_core.disk.diskstore import DiskStore
from offload_core.disk.write import shard_model
from offload_core.units import discover_units


def _mark_all_checked(index: ShardIndex) -> None:
    for e in index.slabs():
        checksum.mark_seen(os.stat(index.root / e.file), e.offset, e.nbytes)


def one_pass(model: Any, units: list, index: ShardIndex, mode: str, workers: int) -> tuple[float, float, str, dict]:
    checksum.forget_all()
    if mode == "off":
        _mark_all_checked(index)
    cache = drop_page_cache()
    entries = bind_units(units, index, model)
    store = DiskStore(units, index, entries, cache_bytes=0, num_disk_workers=workers, verify=mode == "sha256")
    try:
        store.follow_trace([u.uid for u in units])
        t0, c0 = time.perf_counter(), time.process_time()
        for u in units:
            store.acquire(u.uid)
            store.release(u.uid)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = store.stats()
    finally:
        store.close()
    return seconds, cpu, cache, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disk_verify", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=1024, help="block width (a block is about 8 x dim^2 x 2 bytes)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--dir", default=None, help="where the shards go (default: a temp dir on the local disk)")
    p.add_argument("--run-passes", type=int, default=28, help="N of the derived 'run of N' ratio (28: a Flux image)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    block_bytes = 8 * args.dim * args.dim * 2
    n = max(2, round(args.size_gb * 1e9 / block_bytes))
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-verify-") as tmp:
        model = build(n, args.dim, torch.bfloat16)
        plan = discover_units(model, "block")
        shard_model(model, plan.units, Path(tmp) / "shards", plan.block_lists)
        index = load_index(Path(tmp) / "shards")
        units = [u for u in plan.units if not u.stray]
        nbytes = sum(index.units[u.name].nbytes for u in units)
        one_pass(model, units, index, "off", args.workers)  # warm-up: imports, allocator
        times: dict[str, list[float]] = {"off": [], "first": [], "sha256": []}
        cpus: dict[str, list[float]] = {m: [] for m in times}
        cache_state = ""
        checks: dict[str, int] = {}
        modes = list(times)
        for r in range(args.reps):
            for mode in modes[r % 3:] + modes[:r % 3]:  # each mode takes each place in the turn in turn
                seconds, cpu, cache_state, stats = one_pass(model, units, index, mode, args.workers)
                times[mode].append(seconds)
                cpus[mode].append(cpu)
                checks[mode] = stats["disk_first_read_checks"] + stats["disk_sha256_checks"]
    out: dict[str, Any] = {
        "bytes": nbytes, "units": len(units), "workers": args.workers, "reps": args.reps, "page_cache": cache_state,
        "fast_hash": checksum.FAST_HASH if checksum.fast_hasher() is not None else "none (sha256 fallback)",
        "load_average": os.getloadavg(), "cpus": os.cpu_count(),
        "seconds": times, "cpu_seconds": cpus, "checks_per_pass": checks,
        "gbps": {m: nbytes / 1e9 / statistics.median(t) for m, t in times.items()},
        "ratio_vs_off": {m: statistics.median(a / b for a, b in zip(t, times["off"])) for m, t in times.items()},
    }
    n = args.run_passes
    out["run_ratio_vs_off"] = {m: (r + n - 1) / n for m, r in out["ratio_vs_off"].items() if m != "sha256"}
    out["run_ratio_vs_off"]["sha256"] = out["ratio_vs_off"]["sha256"]  # checked on every pass
    print(f"{nbytes / 1e9:.2f} GB in {len(units)} units, {args.workers} disk workers, {args.reps} reps, "
          f"page cache {cache_state}, {os.cpu_count()} CPUs at load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<8} {'median s':>9} {'GB/s':>6} {'cpu s':>6} {'x off':>7} {f'run of {n}':>9} {'checks':>7}")
    for m, t in times.items():
        print(f"{m:<8} {statistics.median(t):>9.3f} {out['gbps'][m]:>6.2f} {statistics.median(cpus[m]):>6.3f} "
              f"{out['ratio_vs_off'][m]:>7.3f} {out['run_ratio_vs_off'][m]:>9.3f} {checks[m]:>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
