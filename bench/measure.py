"""Timers, memory readings and the copy-rate ceilings the floor is computed from."""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "Timing",
    "free_device",
    "warm_device",
    "host_rss",
    "measure_ceilings",
    "profile_copies",
    "sync",
    "time_steps",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def free_device(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        # Pinned blocks freed by one variant stay cached by torch's host allocator; drop them so
        # the next variant neither reuses them nor is charged for them in its RSS.
        for name in ("_accelerator_emptyHostCache", "_host_emptyCache", "_cuda_hostEmptyCache"):
            fn = getattr(torch._C, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception:
                    pass
                break


def warm_device(device: torch.device) -> None:
    """Touch matmul, attention and norm kernels once, so library start-up is not charged to the first variant."""
    for dt in (torch.bfloat16, torch.float32):
        a = torch.randn(256, 256, device=device, dtype=dt, requires_grad=True)
        q = a.view(1, 4, 64, 256)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q).sum() + torch.nn.functional.layer_norm(a @ a, (256,)).sum()
        out.backward()
    sync(device)


@dataclass
class Timing:
    wall_ms: list[float] = field(default_factory=list)
    event_ms: list[float] = field(default_factory=list)
    enqueue_ms: list[float] = field(default_factory=list)  # until step() returned: the host's share

    @property
    def median_ms(self) -> float:
        return statistics.median(self.wall_ms)


def time_steps(step: Callable[[], Any], device: torch.device, repeats: int) -> tuple[Timing, list[Any]]:
    """Run `step` `repeats` times, each between two device synchronizations.

    Wall time (perf_counter around synchronize) is the figure we report: it includes host-side
    work such as a CPU optimizer step. CUDA event time is kept next to it as a cross-check.
    """
    timing = Timing()
    results = []
    for _ in range(repeats):
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        results.append(step())
        timing.enqueue_ms.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            end.record()
        sync(device)
        timing.wall_ms.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            timing.event_ms.append(start.elapsed_time(end))
    return timing, results


# ---- copy ceilings ----------------------------------------------------------------------------


def _rate(nbytes: int, seconds: list[float]) -> dict[str, float]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"median": statistics.median(rates), "max": max(rates)}


def measure_ceilings(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Pinned H2D, pinned D2H and both-at-once rates, copying one big tensor repeatedly.

    On the CPU there is no PCIe: a host memcpy rate stands in, so the floor stays finite.
    """
    n = nbytes // 2
    if device.type != "cuda":
        src = torch.empty(n, dtype=torch.bfloat16).normal_()
        dst = torch.empty_like(src)
        secs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            secs.append(time.perf_counter() - t0)
        r = _rate(nbytes, secs)
        return {"kind": "cpu memcpy (no PCIe on this device)", "bytes": nbytes, "h2d_gbps": r["median"], "h2d_gbps_max": r["max"]}

    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True).fill_(1.0)
    host_out = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)
    dev2 = torch.empty(n, dtype=torch.bfloat16, device=device)

    def run(copy: Callable[[], None]) -> list[float]:
        copy()  # warm: first touch, driver mappings
        sync(device)
        out = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    h2d = _rate(nbytes, run(lambda: dev.copy_(host, non_blocking=True)))
    d2h = _rate(nbytes, run(lambda: host_out.copy_(dev, non_blocking=True)))

    up, down = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def both() -> None:
        cur = torch.cuda.current_stream(device)
        up.wait_stream(cur)
        down.wait_stream(cur)
        with torch.cuda.stream(up):
            dev2.copy_(host, non_blocking=True)
        with torch.cuda.stream(down):
            host_out.copy_(dev, non_blocking=True)
        cur.wait_stream(up)
        cur.wait_stream(down)

    bidir = _rate(2 * nbytes, run(both))
    result = {
        "kind": "pinned host <-> GPU",
        "bytes": nbytes,
        "h2d_gbps": h2d["median"],
        "h2d_gbps_max": h2d["max"],
        "d2h_gbps": d2h["median"],
        "bidir_gbps": bidir["median"],
    }
    del host, host_out, dev, dev2
    free_device(device)
    return result


# ---- copies seen by the profiler --------------------------------------------------------------


def parse_trace_copies(trace: dict[str, Any]) -> dict[str, Any]:
    """Sum the bytes and count of memcpy events in a Chrome trace written by torch.profiler (kineto)."""
    out: dict[str, Any] = {"h2d_bytes": 0, "h2d_count": 0, "d2h_bytes": 0, "d2h_count": 0, "h2d_ms": 0.0, "d2h_ms": 0.0}
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "gpu_memcpy":
            continue
        name = ev.get("name", "")
        nbytes = int((ev.get("args") or {}).get("bytes", 0))
        ms = float(ev.get("dur", 0.0)) / 1e3
        if "HtoD" in name:
            out["h2d_bytes"] += nbytes
            out["h2d_count"] += 1
            out["h2d_ms"] += ms
        elif "DtoH" in name:
            out["d2h_bytes"] += nbytes
            out["d2h_count"] += 1
            out["d2h_ms"] += ms
    return out


def profile_copies(step: Callable[[], Any], device: torch.device) -> dict[str, Any] | None:
    """Run `step` once under torch.profiler: the H2D / D2H bytes the GPU really copied, and the copies' ms."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return parse_trace_copies(json.load(f))
    finally:
        os.unlink(path)
