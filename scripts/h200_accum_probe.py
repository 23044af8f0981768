"""Layer-major accumulation at Flux-dev dims under the 8 GiB cap, step by step: where the memory goes.

    python scripts/h200_accum_probe.py --variants ours,ours-accum4-layer-park --steps 4 [--link-gbps 13]

For each bench variant of flux-dev-lora-8g (bench/peers.py): one engine, ``--steps`` optimizer steps,
and after each the step's wall time, the device's peak and live memory, the ring (slots, depth,
sticky units), the parked bytes and whether the engine is still planning. A step that fails prints
its error (the whole chain) and the memory at that moment, and the probe goes on with the next step,
so a first-step failure and a settled second step both show. Prints one JSON line per step too.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.peers import variants_for  # noqa: E402
from bench.runner import _cap, _step_fn  # noqa: E402
from bench.tiers import at_tier  # noqa: E402
from bench.workloads import get_workload  # noqa: E402

GiB = 1 << 30


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: its innermost frames in the model, the engine or the bench."""
    keep = [f for f in frames if any(k in f.get("filename", "") for k in ("diffusers", "offload_core", "bench", "peft"))]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}({f['name']})" for f in keep[:3]) or "?"


def live_by_site(snap: dict, top: int = 25) -> None:
    """The live blocks of a memory snapshot, summed by allocation site, largest first."""
    sums: dict[str, list[int]] = {}
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            site = _site(b.get("frames", []))
            acc = sums.setdefault(site, [0, 0])
            acc[0] += b["size"]
            acc[1] += 1
    total = sum(v[0] for v in sums.values())
    print(f"live at the failure: {total / GiB:.3f} GiB in {sum(v[1] for v in sums.values())} blocks", flush=True)
    for site, (size, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {size / GiB:8.3f} GiB {n:5d}x  {site}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="ours,ours-accum4-layer-park")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--link-gbps", type=float, default=None)
    ap.add_argument("--lora-dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--snapshot", action="store_true",
                    help="record allocations (python stacks) and, at the first failing step, print what was live")
    ap.add_argument("--tiny", action="store_true", help="the workload's toy dims on the CPU (a smoke test)")
    args = ap.parse_args()
    torch.backends.cuda.enable_cudnn_sdp(False)
    dev = torch.device("cpu") if args.tiny else torch.device("cuda", 0)
    cuda = dev.type == "cuda"
    wl = get_workload("flux-dev-lora-8g", args.tiny,
                      lora_dtype=torch.bfloat16 if args.lora_dtype == "bf16" else torch.float32)
    by_name = {v.name: v for v in variants_for(wl)}
    unknown = [n for n in args.variants.split(",") if n not in by_name]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(by_name)})")
    t0 = time.perf_counter()
    master = wl.build()
    inputs = wl.make_inputs(dev)
    print(f"built in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for name in args.variants.split(","):
        variant = at_tier(by_name[name], args.link_gbps)
        model = copy.deepcopy(master)
        _cap(wl, variant, dev)
        sess = variant.setup(model, wl, dev)
        step = _step_fn(wl, sess, inputs)
        recording = args.snapshot and cuda
        if recording:
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        for i in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.perf_counter()
            err = None
            try:
                step()
                if cuda:
                    torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                err = "".join(traceback.format_exception(exc)[-6:])
                if recording:
                    live_by_site(torch.cuda.memory._snapshot())
                    torch.cuda.memory._record_memory_history(enabled=None)
                    recording = False
                for p in model.parameters():
                    p.grad = None
            ms = (time.perf_counter() - t) * 1e3
            s = sess.stats()
            mem = ((torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev),
                    torch.cuda.memory_reserved(dev)) if cuda else (0, 0, 0))
            row = {"variant": name, "step": i, "ms": round(ms, 1), "error": err is not None,
                   **{k: round(v / GiB, 3) for k, v in zip(("peak_gib", "live_gib", "reserved_gib"), mem)},
                   **{k: s.get(k) for k in ("slot_count", "slot_bytes", "prefetch_depth", "sticky_units",
                                             "sticky_bytes", "parked_bytes", "parked_tensors", "planning",
                                             "lockstep_pad_nodes", "refetches", "stall_ms")}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if err:
                print(err, flush=True)
        sess.teardown()
        del sess, model, step
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction(1.0, dev)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
