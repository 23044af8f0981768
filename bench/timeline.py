"""Where a step's time goes, for one configuration of our engine on one workload.

    python -m bench.timeline --workload p1 --set weight_dtype=float8_e4m3fn [--steps 3] [--json out.json]

After warm-up it reports, per step: wall time, the host's time to enqueue the step (a step that
takes as long to enqueue as to run is host-bound) and the CPU time the enqueuing thread spent in it
(near the enqueue time: the thread computed, so slower instructions slow it, as beside busy copy
threads; far under it: the thread waited, on a lock, the GIL or the device), the engine's stall and busy time, and from
``torch.profiler`` the GPU time by kind of kernel and by stream (compute, copy, widening). Then the
engine's per-unit table: copy ms, busy ms and stall ms per use. This is the evidence a missed
target is explained with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch

from .peers import ours_variant, resident_variant
from .runner import _step_fn
from .workloads import get_workload

__all__ = ["main"]


def _value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def _kind(name: str) -> str:
    n = name.lower()
    if "memcpy" in n and ("htod" in n or "host to device" in n):
        return "memcpy HtoD"
    if "memcpy" in n or "memset" in n:
        return "memcpy other"
    if "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "matmul" in n:
        return "gemm"
    if "copy" in n or "foreach" in n or "mul" in n or "elementwise" in n or "vectorized" in n:
        return "elementwise/copy"
    return "other"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu")
    wl = get_workload(args.workload, args.tiny)
    cfg = {k: _value(v) for k, v in (s.split("=", 1) for s in args.set)}
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)  # its backward is broken for Flux-width bf16 (torch #196678)
    model = wl.build()
    inputs = wl.make_inputs(device)
    if args.cap and wl.vram_cap_bytes and device.type == "cuda":  # the card the bench's own rows emulate
        index = torch.cuda.current_device() if device.index is None else device.index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, wl.vram_cap_bytes / total), index)
    variant = resident_variant() if args.resident else ours_variant("ours", **cfg)
    sess = variant.setup(model, wl, device)
    step = _step_fn(wl, sess, inputs)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(args.warmup):
        step()
    sync()
    stats0 = sess.stats() if not args.resident else {"h2d_bytes": 0}
    retries0 = _allocator(device)
    walls, enqueue, enqueue_cpu = [], [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        t1, c1 = time.perf_counter(), time.thread_time()
        enqueue_cpu.append((c1 - c0) * 1e3)
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
        enqueue.append((t1 - t0) * 1e3)
    stats1 = sess.stats() if not args.resident else {"h2d_bytes": 0}
    retries1 = _allocator(device)
    out: dict[str, Any] = {
        "workload": wl.name, "config": cfg, "device": str(device),
        "wall_ms": walls, "enqueue_ms": enqueue,
        "wall_ms_median": statistics.median(walls), "enqueue_ms_median": statistics.median(enqueue),
        "enqueue_cpu_ms": enqueue_cpu, "enqueue_cpu_ms_median": statistics.median(enqueue_cpu),
        "stall_ms_per_step": (stats1.get("stall_ms", 0) - stats0.get("stall_ms", 0)) / args.steps,
        "h2d_gb_per_step": (stats1["h2d_bytes"] - stats0["h2d_bytes"]) / args.steps / 1e9,
        "predicted_step_ms": stats1.get("predicted_step_ms"),
        "measured_step_ms": stats1.get("measured_step_ms"),
        "plan": stats1.get("plan"),
        # the caching allocator freeing its cache to fit (each one synchronizes the device), per step
        "allocator_per_step": {k: (retries1[k] - retries0[k]) / args.steps for k in retries1},
    }
    units = []
    for u in stats1.get("units", []):
        if any(k.endswith("_ms") for k in u):
            units.append({k: v for k, v in u.items() if k in ("name", "bytes", "streamed", "sticky") or k.endswith("_ms")})
    out["units"] = units

    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step()
            sync()
        by_kind: dict[str, float] = defaultdict(float)
        by_stream: dict[str, float] = defaultdict(float)
        spans: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            by_kind[_kind(ev.name)] += us / 1e3 / 2
            stream = str(getattr(ev, "device_resource_id", getattr(ev, "thread", "?")))
            by_stream[stream] += us / 1e3 / 2
            start = ev.time_range.start / 1e3
            end = ev.time_range.end / 1e3
            lo_hi = spans.setdefault(stream, [start, end])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], start), max(lo_hi[1], end)
        out["gpu_ms_by_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        if args.cpu_top:
            # where the host's time goes (per step): the ops it spends the most self time in
            rows = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[: args.cpu_top]
            out["host_top_ops"] = [{"op": a.key, "calls_per_step": a.count / 2,
                                    "self_cpu_ms_per_step": a.self_cpu_time_total / 1e3 / 2} for a in rows]
        out["gpu_busy_ms_by_stream"] = dict(sorted(by_stream.items(), key=lambda kv: -kv[1]))
    sess.teardown()
    return out


def _allocator(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    st = torch.cuda.memory_stats(device)
    return {k: int(st.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}


def render(out: dict[str, Any]) -> None:
    print(f"{out['workload']} {out['config']} on {out['device']}")
    print(f"  step wall {out['wall_ms_median']:.2f} ms (all: {', '.join(f'{x:.1f}' for x in out['wall_ms'])})")
    print(f"  host enqueue {out['enqueue_ms_median']:.2f} ms per step, of it {out['enqueue_cpu_ms_median']:.2f} ms "
          f"the thread's own CPU time")
    print(f"  engine stall {out['stall_ms_per_step']:.2f} ms/step, H2D {out['h2d_gb_per_step']:.3f} GB/step, "
          f"predicted {out['predicted_step_ms']}, measured cycle {out['measured_step_ms']}")
    print(f"  plan {out['plan']}")
    print(f"  allocator per step {out['allocator_per_step']}")
    for key in ("gpu_ms_by_kind", "gpu_busy_ms_by_stream"):
        if key in out:
            print(f"  {key} (per step): " + ", ".join(f"{k} {v:.2f}" for k, v in out[key].items()))
    if out.get("host_top_ops"):
        print("  host ops by self CPU time (per step):")
        for a in out["host_top_ops"]:
            print(f"    {a['op'][:60]:60s} {a['calls_per_step']:8.0f} calls {a['self_cpu_ms_per_step']:8.2f} ms")
    print("  per unit (totals over every step so far):")
    for u in out["units"]:
        times = " ".join(f"{k[:-3]} {v:.2f}" for k, v in u.items() if k.endswith("_ms"))
        print(f"    {u['name'][:48]:48s} {u['bytes'] / 1e6:9.1f} MB  {times}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.timeline", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="p1", help="p1, p2 or p3")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an OffloadConfig override (repeatable)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--cap", action="store_true", help="under the workload's VRAM cap, as the bench's rows of ours run")
    p.add_argument("--resident", action="store_true", help="time the resident model instead (host enqueue against ours)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--cpu-top", type=int, default=0, metavar="N", help="also list the N host ops with the most self CPU time")
    args = p.parse_args(argv)
    out = run(args)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(out, f, indent=1, default=str)
    render(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
