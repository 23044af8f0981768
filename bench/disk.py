"""The disk tier's benchmark: streaming from shards against the disk's own O_DIRECT rate, in one run.

    python -m bench.disk                          # CUDA: a 6 GB stack of DiT-width MLP blocks, bf16
    python -m bench.disk --device cpu --size-gb 0.05 --tokens 64     # the same on a CPU, small
    python -m bench.disk --json disk.json --dir /fast/disk/tmp

What it measures, every figure from this run:

1. raw: the shard files read with O_DIRECT by ``--workers`` threads into pinned buffers (cold:
   the page cache is dropped first when this process may, else it says so), and the pinned H2D rate;
2. resident: one pass over the blocks with every weight on the device (compute only);
3. ours, per ``max_memory`` fraction f: the DiskStore driven as the engine drives it (acquire, one
   H2D copy into a two-slot device ring on a copy stream, the block's forward on views of the slot,
   release after the copy's event), cold (first pass, empty cache) and warm (steady state), against
   the floor max(resident, (1 - f) x bytes / raw disk rate, bytes / H2D rate);
4. FIFO and LRU at the middle fraction: the same loop with the ablation policies;
5. engine: enable_offload(lazy_load=True) on the model built on the meta device, its max_memory the
   staging slots plus a cache of f of the streamed bytes (max_memory counts both), run right after
   the store alone at the same f (the disk's rate drifts over minutes; each pair shares a moment);
6. peer: diffusers' group offloading with ``offload_to_disk_path`` (block level, one block per
   group, streams on), on the same model, when diffusers is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from offload_core.disk.bind import bind_units
from offload_core.disk.format import FILE_ALIGN, ShardIndex, load_index
from offload_core.disk.pool import HostPool
from offload_core.disk.source import writable_buffer
from offload_core.disk.diskstore import DiskStore
from offload_core.disk.write import shard_model
from offload_core.units import Unit, discover_units


# ------------------------------------------------------------------ the model


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


class BlockStack(nn.Module):
    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build(n: int, d: int, dtype: torch.dtype, seed: int = 0) -> BlockStack:
    """Random weights at memcpy speed: each tensor copies a random window of one random pool."""
    with torch.device("meta"):
        model = BlockStack(n, d)
    model.to(dtype).to_empty(device="cpu").requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn((1 << 22) + (1 << 20), generator=gen) * 0.02).to(dtype)
    with torch.no_grad():
        for name, t in model.named_parameters():
            flat = t.view(-1)
            for s in range(0, flat.numel(), 1 << 22):
                k = min(1 << 22, flat.numel() - s)
                o = int(torch.randint(0, 1 << 20, (1,), generator=gen))
                flat[s: s + k].copy_(pool[o: o + k])
            if name.endswith("norm.weight"):
                flat.add_(1.0)
    return model


# ------------------------------------------------------------------ measurements


_DROP = [True]


def drop_page_cache() -> str:
    if not _DROP[0]:
        return "not dropped (--keep-page-cache)"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError as exc:
        return f"not dropped ({exc.strerror}): cold means the writer's fadvise(DONTNEED) only"


def raw_read_rate(index: ShardIndex, workers: int, pin: bool) -> float:
    """The disk's best O_DIRECT rate over the shard files, in GB/s: ``workers`` threads into pinned buffers,
    with 64 MiB reads and with whole-file reads (as the disk workers read a unit), the page cache
    dropped before each. The best of the two is the floor's rate, so no ratio reads low for a slow probe."""
    largest = max((index.root / f).stat().st_size for f in index.files)
    rates = []
    for chunk in (64 << 20, largest):
        drop_page_cache()
        rates.append(_raw_rate(index, workers, pin, chunk))
    return max(rates)


def _raw_rate(index: ShardIndex, workers: int, pin: bool, chunk: int) -> float:
    files = [index.root / f for f in index.files]
    jobs = [(p, off, min(chunk, p.stat().st_size - off)) for p in files for off in range(0, p.stat().st_size, chunk)]
    lock = threading.Lock()
    total = [0]
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)

    def run() -> None:
        pool = HostPool(chunk, pin=pin)
        view = writable_buffer(pool.buf)
        while True:
            with lock:
                if not jobs:
                    break
                path, off, n = jobs.pop(0)
            fd = os.open(path, flags)
            try:
                got = os.preadv(fd, [view[: (n + FILE_ALIGN - 1) // FILE_ALIGN * FILE_ALIGN]], off)
            finally:
                os.close(fd)
            with lock:
                total[0] += min(got, n)
        pool.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return total[0] / 1e9 / (time.perf_counter() - t0)


def h2d_rate(nbytes: int, device: torch.device) -> float:
    if device.type != "cuda":
        return float("inf")
    src = HostPool(nbytes, pin=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(2):
        dst.copy_(src.buf[:nbytes], non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src.buf[:nbytes], non_blocking=True)
    torch.cuda.synchronize()
    rate = 10 * nbytes / 1e9 / (time.perf_counter() - t0)
    src.close()
    return rate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resident_pass(model: BlockStack, x: torch.Tensor, device: torch.device, reps: int = 5) -> float:
    on = BlockStack(0, 1)
    on.blocks = model.blocks.to(device)
    with torch.no_grad():
        on(x)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            on(x)
        _sync(device)
    t = (time.perf_counter() - t0) / reps
    model.blocks.to("cpu")
    return t


class StoreDriver:
    """One pass over the blocks the way the engine uses a host store: acquire, H2D into a two-slot
    device ring on a copy stream, the block's forward on views of the slot, release after the copy."""

    def __init__(self, model: BlockStack, units: list[Unit], store: DiskStore, device: torch.device) -> None:
        self.units, self.store, self.device = units, store, device
        self.blocks = list(model.blocks)
        names = {(id(m), a): f"{mn}.{a}" if mn else a for b in self.blocks for mn, m in b.named_modules()
                 for a in [*m._parameters, *m._buffers]}
        self.names = [[names[(id(ts.module), ts.attr)] for ts in u.tensors] for u in units]
        size = max(u.store_nbytes for u in units)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        self.cuda = device.type == "cuda"
        self.copy = torch.cuda.Stream(device) if self.cuda else None
        self.ready: list[Any] = [None, None]
        self.done: list[Any] = [None, None]

    def _load(self, i: int, k: int) -> None:
        u = self.units[i]
        slab = self.store.acquire(u.uid)
        if not self.cuda:
            self.slots[k][: u.store_nbytes].copy_(slab)
            self.store.release(u.uid)
            return
        if self.done[k] is not None:
            self.copy.wait_event(self.done[k])
        with torch.cuda.stream(self.copy):
            self.slots[k][: u.store_nbytes].copy_(slab, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy)
        self.store.release(u.uid, after=ev)
        self.ready[k] = ev

    def run(self, x: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call

        with torch.no_grad():
            self._load(0, 0)
            for i, u in enumerate(self.units):
                k = i % 2
                if self.cuda:
                    torch.cuda.current_stream(self.device).wait_event(self.ready[k])
                params = {n: self.slots[k][ts.store_offset: ts.store_offset + ts.store_nbytes].view(ts.dtype).view(ts.shape)
                          for n, ts in zip(self.names[i], u.tensors)}
                x = functional_call(self.blocks[i], params, (x,))
                if self.cuda:
                    self.done[k] = torch.cuda.Event()
                    self.done[k].record(torch.cuda.current_stream(self.device))
                if i + 1 < len(self.units):
                    self._load(i + 1, 1 - k)
            _sync(self.device)
        return x


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------------ the rows


def ours(model: BlockStack, units: list[Unit], index: ShardIndex, x: torch.Tensor, device: torch.device,
         fraction: float, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    entries = bind_units(units, index, model)
    streamed = sum(entries[u.uid].read_nbytes for u in units)
    cache = drop_page_cache()
    store = DiskStore(units, index, entries, cache_bytes=int(fraction * streamed), num_disk_workers=args.workers,
                      policy=policy, pin=device.type == "cuda")
    try:
        driver = StoreDriver(model, units, store, device)
        store.follow_trace([u.uid for u in units])
        cold = timed(lambda: driver.run(x))
        s0 = store.stats()
        warm = [timed(lambda: driver.run(x)) for _ in range(args.passes)]
        s = store.stats()
    finally:
        store.close()
    hits, misses = s["disk_cache_hits"] - s0["disk_cache_hits"], s["disk_cache_misses"] - s0["disk_cache_misses"]
    return {"policy": policy, "f": fraction, "cold_s": cold, "cold_gbps": streamed / 1e9 / cold,
            "warm_s": min(warm), "warm_all_s": warm, "hit_rate": hits / max(hits + misses, 1),
            "disk_busy_frac": (s["disk_read_s"] - s0["disk_read_s"]) / sum(warm),
            "wasted_reads": s["disk_wasted_reads"] - s0["disk_wasted_reads"],
            "disk_gbps": s["disk_gbps"], "stall_ms_per_pass": (s["disk_stall_ms"] - s0["disk_stall_ms"]) / args.passes,
            "direct_reads": s["disk_direct_reads"], "reads": s["disk_reads"], "page_cache": cache}


def engine_rows(args: argparse.Namespace, index: ShardIndex, x: torch.Tensor, device: torch.device,
                fractions: list[float], streamed: int, dtype: torch.dtype) -> list[dict[str, Any]] | str:
    from offload_core import enable_offload
    from offload_core.disk.integrate import max_memory_for

    rows = []
    for f in fractions:
        with torch.device("meta"):
            model = BlockStack(args.blocks, args.dim).to(dtype)
        model.requires_grad_(False)
        budget = max_memory_for(index, index.units, f, args.workers)
        handle = enable_offload(model, target_device=str(device), lazy_load=True, shard_dir=str(index.root),
                                max_memory=budget, num_disk_workers=args.workers, offload_granularity="block")
        with torch.no_grad():
            drop_page_cache()
            # The first pass traces the order of uses: the store reads each unit as it is asked for
            # (no read-ahead before a trace exists), so it is not the cold streaming rate.
            cold = timed(lambda: (model(x), _sync(device)))
            s0 = handle.stats()
            warm = [timed(lambda: (model(x), _sync(device))) for _ in range(args.passes)]
        s = handle.stats()
        hits = s["disk_cache_hits"] - s0["disk_cache_hits"]
        uses = hits + s["disk_cache_misses"] - s0["disk_cache_misses"]
        rows.append({"policy": "engine", "f": f, "max_memory": budget, "cold_s": cold, "cold_gbps": streamed / 1e9 / cold,
                     "warm_s": min(warm), "warm_all_s": warm, "hit_rate": hits / max(uses, 1),
                     # the share of the warm passes with a read in flight: below 1, the disk sat idle
                     "disk_busy_frac": (s["disk_read_s"] - s0["disk_read_s"]) / sum(warm),
                     "wasted_reads": s["disk_wasted_reads"] - s0["disk_wasted_reads"],
                     "cache_fraction": s["disk_cache_capacity_bytes"] / max(streamed, 1), "vram_peak_gib":
                     s.get("vram_peak_bytes", 0) / 2**30, "pinned_bytes": s.get("pinned_capacity_bytes"),
                     "stall_ms": s.get("stall_ms"), "disk_stall_ms": s.get("disk_stall_ms")})
        del handle, model  # dropped without remove(): remove() would read the whole model back into RAM
    return rows


def peer_row(model: BlockStack, x: torch.Tensor, device: torch.device, args: argparse.Namespace,
             workdir: Path) -> dict[str, Any] | str:
    try:
        from diffusers.hooks import apply_group_offloading
    except ImportError as exc:
        return f"skipped: diffusers not importable ({exc})"
    if device.type != "cuda":
        return "skipped: diffusers' group offloading needs an accelerator"
    path = workdir / "diffusers-offload"
    path.mkdir(exist_ok=True)
    peer = BlockStack(0, 1)
    peer.blocks = model.blocks
    t0 = time.perf_counter()
    apply_group_offloading(peer, onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1, use_stream=True, offload_to_disk_path=str(path))
    with torch.no_grad():
        peer(x)  # its first pass writes its safetensors files
        _sync(device)
        setup = time.perf_counter() - t0
        cache = drop_page_cache()
        cold = timed(lambda: (peer(x), _sync(device)))
        # warm: buffered reads, so from here the page cache holds the model (a second copy in RAM)
        warm = [timed(lambda: (peer(x), _sync(device))) for _ in range(args.passes)]
    return {"policy": "diffusers-disk", "f": None, "cold_s": cold, "warm_s": min(warm), "setup_s": setup,
            "page_cache": cache}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disk", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size-gb", type=float, default=None, help="model size (default 6 on CUDA, 0.05 on CPU)")
    p.add_argument("--dim", type=int, default=None, help="block width (default 3072 on CUDA, 256 on CPU)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--fractions", default="0.25,0.5,0.75")
    p.add_argument("--passes", type=int, default=3, help="warm passes per configuration")
    p.add_argument("--workers", type=int, default=4, help="disk worker threads (ours and raw)")
    p.add_argument("--dir", default=None, help="where the shards go (default: a temp dir on the local disk)")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="do not drop the page cache before cold runs (it is system-wide: for shared machines)")
    p.add_argument("--no-peer", action="store_true")
    p.add_argument("--no-engine", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _DROP[0] = not args.keep_page_cache
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.disk: --device cuda but this machine has no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    args.dim = args.dim or (3072 if cuda else 256)
    size = (args.size_gb or (6.0 if cuda else 0.05)) * 1e9
    per_block = (8 * args.dim * args.dim + 7 * args.dim) * dtype.itemsize
    args.blocks = max(4, int(size // per_block))
    fractions = [float(f) for f in args.fractions.split(",")]
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-disk-", dir="/var/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"device": str(device), "blocks": args.blocks, "dim": args.dim, "dtype": str(dtype),
                           "tokens": args.tokens, "workers": args.workers, "dir": str(workdir)}
    try:
        t0 = time.perf_counter()
        model = build(args.blocks, args.dim, dtype)
        plan = discover_units(model, "block")
        units = [u for u in plan.units if not u.stray]
        out["build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        shard_model(model, units, workdir / "shards", plan.block_lists)
        index = load_index(workdir / "shards")
        streamed = sum(index.units[u.name].read_nbytes for u in units)
        out.update(bytes=streamed, shard_s=time.perf_counter() - t0,
                   shard_gbps=streamed / 1e9 / (time.perf_counter() - t0))
        print(f"model: {args.blocks} blocks x {args.dim} ({dtype}), {streamed / 1e9:.2f} GB in shards "
              f"written at {out['shard_gbps']:.2f} GB/s; {workdir}", flush=True)
        out["page_cache"] = drop_page_cache()
        out["raw_gbps"] = raw_read_rate(index, args.workers, pin=cuda)
        out["h2d_gbps"] = h2d_rate(max(u.store_nbytes for u in units), device)
        x = torch.randn(args.tokens, args.dim, dtype=dtype, device=device)
        out["resident_s"] = resident_pass(model, x, device)
        print(f"raw O_DIRECT {out['raw_gbps']:.2f} GB/s ({out['page_cache']}), H2D {out['h2d_gbps']:.1f} GB/s, "
              f"resident pass {out['resident_s'] * 1e3:.1f} ms", flush=True)
        rows, engine = [], []
        # At each fraction the store alone, then the engine: the same moment of the disk for both (a
        # cloud disk's rate drifts over minutes of sustained reads), before the FIFO and LRU ablations.
        for f in fractions:
            rows.append(ours(model, units, index, x, device, f, "belady", args))
            if not args.no_engine:
                engine += engine_rows(args, index, x, device, [f], streamed, dtype)
        mid = fractions[len(fractions) // 2]
        for policy in ("fifo", "lru"):
            rows.append(ours(model, units, index, x, device, mid, policy, args))
        for r in rows:
            r["floor_s"] = max(out["resident_s"], (1 - r["f"]) * streamed / 1e9 / out["raw_gbps"],
                               streamed / 1e9 / out["h2d_gbps"])
            r["vs_floor"] = r["warm_s"] / r["floor_s"]
            r["cold_vs_raw"] = r["cold_gbps"] / out["raw_gbps"]
        out["rows"] = rows
        out["engine"] = "skipped (--no-engine)" if args.no_engine else engine
        for r in out["engine"] if isinstance(out["engine"], list) else []:
            r["floor_s"] = max(out["resident_s"], (1 - r["f"]) * streamed / 1e9 / out["raw_gbps"],
                               streamed / 1e9 / out["h2d_gbps"])
            r["vs_floor"] = r["warm_s"] / r["floor_s"]
            r["cold_vs_raw"] = r["cold_gbps"] / out["raw_gbps"]
        out["peer"] = "skipped (--no-peer)" if args.no_peer else peer_row(model, x, device, args, workdir)
    finally:
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    _report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


def _report(out: dict[str, Any]) -> None:
    print(f"\n{'policy':<15}{'f':>5}{'cold s':>9}{'cold/raw':>10}{'warm s':>9}{'floor s':>9}{'warm/floor':>11}"
          f"{'hits':>7}{'stall ms':>10}{'disk busy':>10}{'wasted':>7}")
    for r in out["rows"]:
        print(f"{r['policy']:<15}{r['f']:>5.2f}{r['cold_s']:>9.3f}{r['cold_vs_raw']:>10.2f}{r['warm_s']:>9.3f}"
              f"{r['floor_s']:>9.3f}{r['vs_floor']:>11.2f}{r['hit_rate']:>7.2f}{r['stall_ms_per_pass']:>10.0f}"
              f"{r['disk_busy_frac']:>10.2f}{r['wasted_reads']:>7}")
    if isinstance(out["engine"], list):
        for r in out["engine"]:
            print(f"{'engine':<15}{r['f']:>5.2f}{r['cold_s']:>9.3f}{r['cold_vs_raw']:>10.2f}{r['warm_s']:>9.3f}"
                  f"{r['floor_s']:>9.3f}{r['vs_floor']:>11.2f}{r['hit_rate']:>7.2f}{r['disk_stall_ms']:>10.0f}"
                  f"{r['disk_busy_frac']:>10.2f}{r['wasted_reads']:>7}")
    else:
        print(f"engine: {out['engine']}")
    peer = out["peer"]
    if isinstance(peer, dict):
        print(f"{'diffusers-disk':<15}{'':>5}{peer['cold_s']:>9.3f}{'':>10}{peer['warm_s']:>9.3f}   (setup {peer['setup_s']:.1f} s)")
    else:
        print(f"diffusers disk group offload: {peer}")
    belady = [r for r in out["rows"] if r["policy"] == "belady"]
    worst_cold = min(r["cold_vs_raw"] for r in belady)
    worst_warm = max(r["vs_floor"] for r in belady)
    print(f"\ncold streaming >= 0.85x raw O_DIRECT: worst {worst_cold:.2f}x ({'ok' if worst_cold >= 0.85 else 'MISS'}); "
          f"steady state <= 1.10x floor: worst {worst_warm:.2f}x ({'ok' if worst_warm <= 1.10 else 'MISS'})")
    if isinstance(out["engine"], list) and out["engine"]:
        ec = min(r["cold_vs_raw"] for r in out["engine"])
        ew = max(r["vs_floor"] for r in out["engine"])
        print(f"engine (enable_offload lazy_load): steady state <= 1.10x floor: worst {ew:.2f}x "
              f"({'ok' if ew <= 1.10 else 'MISS'}); its first pass, which traces the order, at {ec:.2f}x raw")


if __name__ == "__main__":
    sys.exit(main())
