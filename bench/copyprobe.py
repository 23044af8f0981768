"""Where a copy's event-pair time and the profiler's DMA time part, for one pinned H2D copy.

    python -m bench.copyprobe [--mb 67,415] [--reps 20] [--json out.json]

The engine times each unit copy with a CUDA event pair on the copy stream; ``torch.profiler``
reports the DMA alone. This probe times the same copy both ways in four situations:

* ``idle``: the copy stream has nothing queued, so the start event runs as soon as it is
  enqueued and the DMA only when the host has finished submitting the copy;
* ``queued``: the copy stream is held by a short spin kernel while the host enqueues the start
  event and the copy, so they run back to back;
* ``idle+d2h``: as ``idle``, with a device-to-host copy running on another stream;
* ``clock``: as ``idle``, timed by the engine's ``CopyClock`` (which holds an idle stream with a
  spin shorter than the host's submission time, so the start event runs just before the DMA);
* ``host``: the host's own time to submit ``copy_`` (perf_counter around the call).

If ``idle`` shows a gap that ``queued`` does not, the gap is host submission time, not DMA time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from offload_core.stats import CopyClock, TimingLog

__all__ = ["main"]


def _dma_durations(prof: Any) -> list[float]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    evs = [e for e in trace.get("traceEvents", []) if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    evs.sort(key=lambda e: float(e.get("ts", 0.0)))
    return [float(e.get("dur", 0.0)) / 1e3 for e in evs]


def probe(nbytes: int, reps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dsrc = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d, d2h = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    out: dict[str, Any] = {"mb": nbytes / 1e6}
    clock = CopyClock(TimingLog(), h2d)
    per_us = out["cycles_per_us"] = clock.cycles_per_us
    for mode in MODES:
        pairs = []
        host_us = []
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                torch.cuda.synchronize()
                time.sleep(0.002)
                if mode == "idle+d2h":
                    with torch.cuda.stream(d2h):
                        back.copy_(dsrc, non_blocking=True)
                with torch.cuda.stream(h2d):
                    if mode == "queued":
                        torch.cuda._sleep(int(200 * per_us))
                    b = torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    if mode == "clock":
                        a = clock.start(h2d)
                    else:
                        a = torch.cuda.Event(enable_timing=True)
                        a.record(h2d)
                    dst.copy_(src, non_blocking=True)
                    host_us.append((time.perf_counter() - t0) * 1e6)
                    if mode == "clock":
                        clock.submitted()
                    b.record(h2d)
                pairs.append((a, b))
            torch.cuda.synchronize()
        events = [a.elapsed_time(b) for a, b in pairs]
        dma = _dma_durations(prof)
        n = min(len(events), len(dma))
        gaps_us = [(events[i] - dma[i]) * 1e3 for i in range(n)]
        out[mode] = {
            "event_ms": statistics.median(events),
            "dma_ms": statistics.median(dma) if dma else None,
            "ratio_sum": sum(events[:n]) / max(sum(dma[:n]), 1e-9),
            "gap_us_median": statistics.median(gaps_us) if gaps_us else None,
            "gap_us_max": max(gaps_us) if gaps_us else None,
            "host_copy_us_median": statistics.median(host_us),
        }
    out["clock_holds"] = clock.holds
    out["clock_submit_us"] = clock.submit_us
    return out


MODES = ("idle", "queued", "idle+d2h", "clock")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.copyprobe", description=__doc__.splitlines()[0])
    p.add_argument("--mb", default="8,67,415", help="copy sizes in MB, comma-separated")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.exit(2, "error: bench.copyprobe needs a CUDA device\n")
    rows = [probe(int(float(mb) * 1e6), args.reps) for mb in args.mb.split(",")]
    for r in rows:
        print(f"{r['mb']:7.1f} MB: spin {r['cycles_per_us']:.0f} cycles/us; CopyClock held {r['clock_holds']} copies, "
              f"submission estimate {r['clock_submit_us']:.1f} us")
        for mode in MODES:
            m = r[mode]
            print(f"{r['mb']:7.1f} MB {mode:9s} event {m['event_ms']:.4f} ms  dma {m['dma_ms']:.4f} ms  "
                  f"events/dma {m['ratio_sum']:.4f}  gap {m['gap_us_median']:.1f} us (max {m['gap_us_max']:.1f})  "
                  f"host copy_ {m['host_copy_us_median']:.1f} us")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
