"""GPU acceptance of "RAM smaller than the model": a Flux-dev-dims LoRA train job with 16 GiB of job RAM.

    bash scripts/h200_wheels.sh                               # here, with PyPI: .whl/ for the GPU box
    # on the GPU box (~5 min; OUT needs ~52 GB free: the 23.8 GB model and its 23.8 GB of shards):
    pip install -q --no-index --find-links .whl -r .whl/requirements.txt
    python scripts/h200_ramtier.py --out /tmp/oj-ramtier --json /tmp/oj-ramtier/ramtier.json
    # or the same through pytest:  RAMTIER_OUT=/tmp/oj-ramtier pytest -m gpu tests/jobs/runners/test_ram_tier_gpu.py

It builds the random Flux-dev-dims diffusers folder (scripts/make_big_pipeline.py: 19 + 38 blocks, width
3072, 23.8 GB bf16; tiny text encoders and VAE) under OUT, starts a worker (state dir OUT/home, so the
model cache's shards land in OUT/home/models/shards) and submits one train job: LoRA r32 on the
attention projections, gradient checkpointing, `OFFLOAD_JOBS_RAM_BUDGET=16GiB` and
`OFFLOAD_JOBS_VRAM_CAP=8GiB` in its env and nothing else about offload. The runner must see that the
weights do not fit, shard them once into the model cache and stream them from disk. It prints and
keeps (`--json`): the job's status, its `runner.host_store` and `runner.shard_cache` events, s/step
and the disk floor (the bytes of the uses that reach the store less the RAM cache's capacity in each of the
step's two passes, at the shards' raw O_DIRECT rate), peak VRAM, and the peak host RSS (the job's own watch) against the 16 GiB.
The model folder and the shards are deleted at the end unless `--keep`.

`--device cpu --blocks 1 --single-blocks 1 --size 64 --text-tokens 32 --ram 1GiB` runs the same path on
a CPU box (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from h200_runners import TARGETS, Worker, _dataset, _records, add_flux_job_args, build_big_flux  # noqa: E402  (the worker and dataset helpers)

from byte_sizes import parse_bytes  # noqa: E402


def _events(job: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    path = Path(job["run_dir"]) / "events.jsonl"
    return [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if e.get("type") == f"runner.{kind}"]


def _raw_gbps(shard_dir: str | None, device: str) -> tuple[float | None, str]:
    """The shards' raw O_DIRECT read rate (page cache dropped first where permitted), as the disk floor's rate."""
    if not shard_dir or not Path(shard_dir).is_dir():
        return None, "no shard dir"
    from bench.disk import drop_page_cache, raw_read_rate
    from offload_core.disk.format import load_index

    cache = drop_page_cache()
    return raw_read_rate(load_index(Path(shard_dir)), 2, pin=device == "cuda"), cache


def _report(job: dict[str, Any], ram: int, raw_gbps: float | None = None) -> dict[str, Any]:
    run = Path(job["run_dir"])
    out: dict[str, Any] = {"status": job["status"], "reason": job.get("reason"), "message": job.get("message"),
                           "host_store": _events(job, "host_store"), "shard_cache": _events(job, "shard_cache"),
                           "ram_budget_bytes": ram}
    if job["status"] != "SUCCEEDED":
        out["log_tail"] = (run / "output.log").read_text(errors="replace")[-4000:]
        return out
    steps = [r for r in _records(job) if "loss" in r]
    summary = json.loads((run / "outputs" / "train_summary.json").read_text())
    later = steps[len(steps) // 2:] or steps
    last = steps[-1]
    tier = out["host_store"][-1] if out["host_store"] else {}
    # what must come from disk per step: the bytes of the uses that reach the store (twice the streamed
    # bytes, forward and the recompute backward shares, less the units the engine keeps on the device
    # across each turn), less what the RAM cache serves in each of the two passes (Belady on forward-then-
    # reverse: its capacity each), at the disk's raw O_DIRECT rate. The cache is what the engine reports,
    # not max_memory: max_memory also holds the staging slots the disk workers read into
    # (disk_stream_slots x the largest unit, 2.7 GB at Flux-dev dims). Units kept or dropped whole pack the
    # cache a little short of its capacity, so this floor is a lower bound (tests/offload_core/disk/
    # test_disk_forward_backward.py computes Belady's exactly on a small model).
    streamed = last.get("streamed_bytes", 0)
    cache = last.get("disk_cache_capacity_bytes")
    if cache is None:  # rows of an engine without the field: max_memory, an upper bound
        cache = tier.get("max_memory_bytes", 0)
    gbps = raw_gbps or last.get("disk_gbps") or 0.0
    # what the disk store did in the later half of the steps (cumulative counters: differences between rows;
    # row i+1 less row i is step i+1's own). The first steps are the cache's warm-up and the plan's settling
    # (the fixed set fills over the first cycles): a median over every step would mix them in.
    pairs = list(zip(later, later[1:])) or list(zip(steps, steps[1:]))
    s_per_step = statistics.median(b["step_seconds"] for _, b in pairs) if pairs else \
        statistics.median(r["step_seconds"] for r in later)
    per_step = {k: statistics.median(b.get(k, 0) - a.get(k, 0) for a, b in pairs) if pairs else None
                for k in ("disk_bytes", "disk_stall_ms", "disk_cache_hit_bytes", "disk_cache_miss_bytes", "disk_read_s",
                          "disk_cache_planned")}
    used = (per_step["disk_cache_hit_bytes"] or 0) + (per_step["disk_cache_miss_bytes"] or 0)
    floor_bytes = max(0, (used or 2 * streamed) - 2 * cache)  # rows without the counters: every use reaches it
    disk_floor = floor_bytes / (gbps * 1e9) if gbps else None
    out.update({"disk_gb_per_step": per_step["disk_bytes"] / 1e9 if per_step["disk_bytes"] is not None else None,
                "disk_floor_gb_per_step": floor_bytes / 1e9, "store_use_gb_per_step": used / 1e9,
                "disk_stall_ms_per_step": per_step["disk_stall_ms"],
                "disk_busy_s_per_step": per_step["disk_read_s"], "disk_planned_per_step": per_step["disk_cache_planned"],
                "disk_cache_hit_rate": last.get("disk_cache_hit_rate"),
                "disk_plan_gb_per_cycle": (last.get("disk_cache_plan_bytes") or 0) / 1e9,
                "disk_cache_capacity_bytes": last.get("disk_cache_capacity_bytes")})
    out.update({
        "steps": len(steps), "losses": [round(r["loss"], 5) for r in steps],
        "step_seconds": [round(r["step_seconds"], 3) for r in steps], "s_per_step": s_per_step,
        "disk_gbps": gbps, "disk_gbps_engine": last.get("disk_gbps"), "disk_floor_s_estimate": disk_floor,
        "x_disk_floor": s_per_step / disk_floor if disk_floor else None,
        "row_host_store": last.get("host_store"), "vram_peak_bytes": last.get("vram_peak_bytes"),
        "weight_bytes": summary.get("weight_bytes"), "rss_peak_bytes": summary["host_rss_peak_bytes"],
        "rss_peaks_by_phase": summary.get("host_rss_peaks", {}),
        "rss_within_budget": summary["host_rss_peak_bytes"] <= ram,
    })
    return out


def _print(rep: dict[str, Any]) -> None:
    gib = 2**30
    print(f"\n== flux-dev dims, job RAM {rep['ram_budget_bytes'] / gib:.1f} GiB: train {rep['status']}", flush=True)
    for e in rep["host_store"] + rep["shard_cache"]:
        print("  event " + json.dumps({k: v for k, v in e.items() if k != "ts"}))
    if rep["status"] != "SUCCEEDED":
        print(f"  {rep.get('reason')}: {rep.get('message')}\n{rep.get('log_tail', '')}")
        return
    floor = rep["disk_floor_s_estimate"]
    print(f"  {rep['steps']} steps {rep['step_seconds']}; s/step {rep['s_per_step']:.2f}; disk raw O_DIRECT "
          f"{rep.get('raw_disk_gbps') or 0:.2f} GB/s ({rep.get('page_cache')}), the engine's reads {rep.get('disk_gbps_engine') or 0:.2f}"
          + (f"; disk floor ~{floor:.2f} s -> x{rep['x_disk_floor']:.2f}" if floor else ""))
    if rep.get("disk_gb_per_step") is not None:
        print(f"  disk {rep['disk_gb_per_step']:.2f} GB read a step (the floor's {rep['disk_floor_gb_per_step']:.2f}), "
              f"the engine waited {rep['disk_stall_ms_per_step'] or 0:.0f} ms a step on reads; RAM cache "
              f"{(rep['disk_cache_capacity_bytes'] or 0) / gib:.2f} GiB, hit rate {rep['disk_cache_hit_rate'] or 0:.2f}; "
              f"a read in flight {rep.get('disk_busy_s_per_step') or 0:.2f} s a step, "
              f"{rep.get('disk_planned_per_step') or 0:.0f} reads placed by the cache's plan, "
              f"which reads {rep.get('disk_plan_gb_per_cycle') or 0:.2f} GB a cycle of the trace")
    print(f"  rows say host_store {rep['row_host_store']}; peak VRAM {(rep['vram_peak_bytes'] or 0) / gib:.2f} GiB")
    print(f"  peak host RSS {rep['rss_peak_bytes'] / gib:.2f} GiB of {rep['ram_budget_bytes'] / gib:.1f} GiB "
          f"({ {True: 'within', False: 'OVER', None: 'not judged on the CPU'}[rep['rss_within_budget']]}); by phase "
          + ", ".join(f"{k} {v / gib:.2f}" for k, v in rep["rss_peaks_by_phase"].items()))
    print(f"  losses {rep['losses']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flux_job_args(p, out="/tmp/oj-ramtier", timeout=540, keep_help="Keep the model folder and the shards.")
    p.add_argument("--ram", default="16GiB", help="The job's RAM (OFFLOAD_JOBS_RAM_BUDGET).")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, home = args.out / "model-flux", args.out / "home"
    t0 = time.time()
    build_big_flux(args, model)
    print(f"built the model in {time.time() - t0:.0f}s", flush=True)
    data = _dataset("flux", args.out, args.size, 1)
    worker = Worker(home, args.device)
    try:
        env = {"OFFLOAD_JOBS_RAM_BUDGET": args.ram}
        env.update({"OFFLOAD_JOBS_VRAM_CAP": args.cap} if args.device == "cuda" else {"OMP_NUM_THREADS": "2"})
        spec = {"kind": "train", "name": "ramtier-flux-train", "model": {"path": str(model), "dtype": "bfloat16"},
                "offload": {"target_device": args.device}, "env": env,
                "resources": {"gpus": 1 if args.device == "cuda" else 0},
                "train": {"dataset": str(data), "steps": args.steps, "learning_rate": 1e-4, "lora_rank": 32,
                          "lora_target_modules": TARGETS["flux"], "max_pixels": args.size * args.size,
                          "gradient_checkpointing": True, "save_every": args.steps,
                          "max_sequence_length": args.text_tokens}}
        t1 = time.time()
        job = worker.run(spec, timeout=args.timeout)
        tier = (_events(job, "host_store") or [{}])[-1] if job["status"] == "SUCCEEDED" else {}
        raw, page_cache = _raw_gbps(tier.get("shard_dir"), args.device)
        rep = _report(job, parse_bytes(args.ram), raw)
        rep["raw_disk_gbps"], rep["page_cache"] = raw, page_cache
        rep["job_seconds"] = round(time.time() - t1, 1)
        if args.device == "cpu" and "rss_within_budget" in rep:
            rep["rss_within_budget"] = None  # the CPU is the device: its slot ring and activations live in RAM
    finally:
        worker.stop()
        if not args.keep:
            shutil.rmtree(model, ignore_errors=True)
            shutil.rmtree(home / "models" / "shards", ignore_errors=True)
    _print(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1, default=str))
    ok = rep["status"] == "SUCCEEDED" and rep.get("row_host_store") == "disk" and rep.get("rss_within_budget") is not False
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
