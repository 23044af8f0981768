"""H200 acceptance of the train and infer runners: full-size random models, through a real worker.

    python scripts/h200_runners.py --families flux,wan            # one device call (~5 min)
    python scripts/h200_runners.py --families qwen-image          # the other (~5 min)

For each family: build the full-width random pipeline on local disk (scripts/make_big_pipeline.py),
make a small dataset, start a worker, run a train job (a few LoRA steps, a sample at the end) and
an infer job with the LoRA it wrote, both with VRAM capped through OFFLOAD_JOBS_VRAM_CAP (8 GiB for
Flux, 24 GiB for Qwen-Image and Wan), then delete the model folder (the disk holds one at a time).
It prints, per family: s/step against the engine floor (bytes that must cross / 55.45 GB/s), peak
VRAM, peak host RSS against the weight bytes, and the infer job's s/image; `--json FILE` keeps it.

Flux only: `--match-bench` trains the bench's LoRA targets and times the engine bench's step for the
same model, LoRA and cap in a child first (issue 30: the job's s/step against it); `--fp8`
adds a train job with fp8 weights; `--compile-jobs N` adds N fp8 + offload.compile jobs (the first
compiles, the later ones read inductor's cache in the state dir: compile seconds and cache hits).

`--device cpu --blocks 1 --size 64` runs the same path on a CPU box (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

H2D_GBPS = 55.45
CAPS = {"flux": "8GiB", "qwen-image": "24GiB", "wan": "24GiB"}
# Flux: attention only (the 990 ms / 5 GiB reference run's kind of adapter); the others: the family's defaults
TARGETS = {"flux": "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"}


def _clip_size(side: int) -> tuple[int, int]:
    """Wan's clips: 832x480 at --size 1024 (its 480p shape), sides multiples of 16."""
    return side * 13 // 16 // 16 * 16, side * 15 // 32 // 16 * 16


def _max_pixels(family: str, side: int) -> int:
    if family == "wan":  # the clips' own size is a bucket: no upscaling
        w, h = _clip_size(side)
        return w * h
    return side * side


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_flux_job_args(p: argparse.ArgumentParser, *, out: str, timeout: float, keep_help: str) -> None:
    """The options the one-job Flux acceptance scripts share (h200_ramtier.py, h200_single_file.py)."""
    p.add_argument("--out", type=Path, default=Path(out), help="Work folder (~50 GB free at full size).")
    p.add_argument("--cap", default="8GiB", help="The VRAM cap (OFFLOAD_JOBS_VRAM_CAP).")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", type=int, default=512, help="Image side.")
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--blocks", type=int, default=None, help="Override the depth (smoke tests).")
    p.add_argument("--single-blocks", type=int, default=None)
    p.add_argument("--timeout", type=float, default=timeout)
    p.add_argument("--keep", action="store_true", help=keep_help)
    p.add_argument("--json", type=Path, default=None)


def build_big_flux(args: argparse.Namespace, model: Path) -> None:
    """The random Flux-dev-dims diffusers folder, written by a child (this process holds none of it)."""
    cmd = [sys.executable, str(REPO / "scripts" / "make_big_pipeline.py"), "flux", str(model)]
    cmd += ["--blocks", str(args.blocks)] if args.blocks is not None else []
    cmd += ["--single-blocks", str(args.single_blocks)] if args.single_blocks is not None else []
    subprocess.run(cmd, check=True, cwd=REPO)


def _dataset(family: str, root: Path, size: int, frames: int) -> Path:
    import make_tiny_pipelines as tiny

    data = root / f"data-{family}"
    if data.exists():
        return data
    if family == "wan":
        data.mkdir(parents=True)
        w, h = _clip_size(size)
        for i in range(2):
            clip = data / f"clip_{i:02d}"
            clip.mkdir()
            for f in range(frames):
                tiny._draw(["red", "blue"][i], "circle", "white", (w, h), phase=f * 0.3).save(clip / f"{f:03d}.png")
            (data / f"clip_{i:02d}.txt").write_text(f"a {['red', 'blue'][i]} circle on a white background\n")
        return data
    data.mkdir(parents=True)
    rows = []
    for i, (c, s, b) in enumerate([("red", "square", "blue"), ("green", "circle", "white"), ("yellow", "stripe", "black"),
                                   ("purple", "square", "orange")]):
        tiny._draw(c, s, b, (size, size)).save(data / f"img_{i}.png")
        rows.append(json.dumps({"file_name": f"img_{i}.png", "text": f"a {c} {s} on a {b} background"}))
    (data / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return data


class Worker:
    def __init__(self, home: Path, device: str) -> None:
        self.home, self.port = home, _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # keep a --target site
        env["OFFLOAD_JOBS_GPUS"] = "1" if device == "cuda" else "0"
        home.mkdir(parents=True, exist_ok=True)
        self.log = open(home / "worker.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.worker", "--port", str(self.port), "--home", str(home),
                                      "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     cwd=REPO)
        from jobs.client import JobsClient

        deadline = time.monotonic() + 60
        while True:
            try:
                self.client = JobsClient(f"http://127.0.0.1:{self.port}", (home / "token").read_text().strip())
                self.client.health()
                break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"worker did not start; see {home / 'worker.log'}")
                time.sleep(0.2)

    def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        job = self.client.submit(spec)
        print(f"  job {job['id']} ({spec['kind']}) submitted", flush=True)
        return self.client.wait(job["id"], timeout=timeout)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _records(job: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(job["run_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steady(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steady state: the steps after the engine chose its ring (rows say `planning`; at least two),
    else the later half (rows of an engine before that field)."""
    settled = [r for r in steps[1:] if r.get("planning") is False]
    return settled if len(settled) >= 2 else steps[len(steps) // 2:] or steps


def _train_report(job: dict[str, Any]) -> dict[str, Any]:
    recs = _records(job)
    steps = [r for r in recs if "loss" in r]
    load = next((r for r in recs if r.get("phase") == "load"), {})
    summary = json.loads((Path(job["run_dir"]) / "outputs" / "train_summary.json").read_text())
    later = _steady(steps)
    per_step_h2d = [b["h2d_bytes"] - a["h2d_bytes"] for a, b in zip(steps, steps[1:])] or [steps[0]["h2d_bytes"]]
    streamed = steps[-1].get("streamed_bytes", 0)
    must_cross = 2 * streamed  # checkpointed LoRA training: forward, then the recompute that backward shares
    weight = summary["weight_bytes"]
    return {
        "status": job["status"], "steps": len(steps), "losses": [round(r["loss"], 5) for r in steps],
        "s_per_step": statistics.median(r["step_seconds"] for r in later),
        "step_seconds": [round(r["step_seconds"], 3) for r in steps],
        "first_step_s": steps[0]["step_seconds"],
        "floor_s": must_cross / (H2D_GBPS * 1e9), "must_cross_gb": must_cross / 1e9,
        "h2d_gb_per_step": statistics.median(per_step_h2d) / 1e9,
        "h2d_gbps": steps[-1].get("h2d_gbps"), "stall_ms_total": steps[-1].get("stall_ms"),
        "vram_peak_gib": steps[-1].get("vram_peak_bytes", 0) / 2**30,
        "weight_gb": weight / 1e9,
        "rss_peak_gb": summary["host_rss_peak_bytes"] / 1e9,
        "rss_peak_over_weights": summary["host_rss_peak_bytes"] / max(1, weight),
        "rss_load_peak_over_weights": load.get("rss_peak_load_ratio"),
        "rss_load_added_over_weights": load.get("rss_load_added_ratio"),
        "rss_peaks_by_phase_gb": {k: v / 1e9 for k, v in summary.get("host_rss_peaks", {}).items()},
        # what the peak holds beyond the process and its encoders while they ran (the precompute phase's peak)
        "rss_beyond_encoders_over_weights": (summary["host_rss_peak_bytes"]
                                             - summary.get("host_rss_peaks", {}).get("precompute", 0)) / max(1, weight),
        "samples": summary.get("samples"),
    }


def _engine_bench(root: Path, lora_dtype: str = "fp32") -> dict[str, Any]:
    """The engine bench's flux-dev-lora-8g 'ours' row (the same dims, LoRA targets and cap), in a child so
    that this process holds none of its memory. ``fp32``: the job's own LoRA (fp32 weights and AdamW
    state, computing in bf16: jobs/runners/lora.compute_in_input_dtype); ``bf16``: bf16 adapters, whose
    weights, gradients and optimizer state take half the VRAM (1.05 GB less at r32 on the 14 targets)."""
    out = root / f"bench-ours-{lora_dtype}.json"
    cmd = [sys.executable, "-m", "bench", "--workloads", "flux-dev-lora-8g", "--only", "ours", "--device", "cuda",
           "--warmup", "2", "--repeats", "3", "--no-profile", "--lora-dtype", lora_dtype, "--json", str(out)]
    print("engine bench: " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    row = next(r for r in json.loads(out.read_text())["rows"] if r["variant"] == "ours")
    return {"ms_per_step": row["time_ms"], "peak_vram_gib": row["peak_vram_bytes"] / 2**30, "status": row["status"]}


def _extra_jobs(train: dict[str, Any], args: argparse.Namespace, worker: Worker) -> list[dict[str, Any]]:
    """--fp8: the same train job with fp8 weights; --compile-jobs N: N jobs with fp8 and compiled blocks
    (the first compiles; the later ones read inductor's cache in the state dir)."""
    kinds = (["fp8"] if args.fp8 else []) + [f"fp8+compile #{i + 1}" for i in range(args.compile_jobs)]
    out = []
    for kind in kinds:
        spec = json.loads(json.dumps(train))
        spec["name"] = f"{train['name']}-{kind.replace('+', '-').replace(' #', '-')}"
        spec["offload"]["weight_dtype"] = "float8_e4m3fn"
        if "compile" in kind:
            spec["offload"]["compile"] = True
        spec["train"].update(steps=args.extra_steps, save_every=args.extra_steps, sample_every=None, sample_prompts=[])
        job = worker.run(spec, timeout=args.timeout)
        rep: dict[str, Any] = {"kind": kind, "status": job["status"], "job": job["id"]}
        if job["status"] != "SUCCEEDED":
            rep["log_tail"] = (Path(job["run_dir"]) / "output.log").read_text(errors="replace")[-3000:]
        else:
            steps = [r for r in _records(job) if "loss" in r]
            later = _steady(steps)
            first, last = steps[0], steps[-1]
            rep.update(s_per_step=statistics.median(r["step_seconds"] for r in later),
                       step_seconds=[round(r["step_seconds"], 3) for r in steps],
                       vram_peak_gib=last.get("vram_peak_bytes", 0) / 2**30, losses=[round(r["loss"], 5) for r in steps],
                       **{k: last.get(k) for k in ("compile_graphs", "recompiles", "compile_seconds", "compile_cache_hits",
                                                   "compile_cache_misses")})
            rep["first_step_s"] = first["step_seconds"]
        print(f"  {kind}: {json.dumps(rep)[:600]}", flush=True)
        out.append(rep)
    return out


def _infer_report(job: dict[str, Any]) -> dict[str, Any]:
    recs = _records(job)
    imgs = [r for r in recs if "seconds" in r and "step" in r]
    params = json.loads((Path(job["run_dir"]) / "outputs" / "params.json").read_text())
    return {"status": job["status"], "images": len(imgs),
            "s_per_image": statistics.median(r["seconds"] for r in imgs) if imgs else None,
            "vram_peak_gib": max((r.get("vram_peak_bytes") or 0) for r in imgs) / 2**30 if imgs else None,
            "rss_peak_over_weights": params["host_rss_peak_bytes"] / max(1, params["weight_bytes"]),
            "lora": params["lora"]}


def run_family(family: str, args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    model = args.out / f"model-{family}"
    shutil.rmtree(model, ignore_errors=True)  # a folder left by an earlier run: the disk holds one model
    try:
        return _run_family(family, args, worker)
    finally:
        if not args.keep:  # failed or not: the next family needs the space
            shutil.rmtree(model, ignore_errors=True)


def _run_family(family: str, args: argparse.Namespace, worker: Worker) -> dict[str, Any]:
    root = args.out
    model = root / f"model-{family}"
    t0 = time.time()
    # in a child, so that this process holds none of the model's memory while the jobs run
    cmd = [sys.executable, str(REPO / "scripts" / "make_big_pipeline.py"), family, str(model)]
    if args.blocks is not None:
        cmd += ["--blocks", str(args.blocks)]
    if args.single_blocks is not None:
        cmd += ["--single-blocks", str(args.single_blocks)]
    subprocess.run(cmd, check=True, cwd=REPO)
    nbytes = sum(f.stat().st_size for f in (model / "transformer").glob("*.safetensors"))
    build_s = time.time() - t0
    print(f"{family}: built {nbytes / 1e9:.1f} GB of transformer weights in {build_s:.0f}s", flush=True)
    frames = 17 if args.size >= 512 else 5
    data = _dataset(family, root, args.size, frames)
    side = args.size
    env = {"OFFLOAD_JOBS_VRAM_CAP": CAPS[family]} if args.device == "cuda" else {"OMP_NUM_THREADS": "2"}
    offload: dict[str, Any] = {"target_device": args.device}  # the engine's defaults: no knobs
    cw, ch = _clip_size(side)
    sample = f"a red square on a blue background --steps {args.sample_steps} --seed 1" + (
        f" --w {cw} --h {ch} --f {frames}" if family == "wan" else "")
    train = {"kind": "train", "name": f"h200-{family}-train", "model": {"path": str(model), "dtype": "bfloat16"},
             "offload": offload, "env": env, "resources": {"gpus": 1 if args.device == "cuda" else 0},
             "train": {"dataset": str(data), "steps": args.steps, "learning_rate": 1e-4, "lora_rank": 32,
                       "max_pixels": _max_pixels(family, side), "num_frames": frames, "gradient_checkpointing": True,
                       "save_every": args.steps, "sample_every": args.steps, "sample_prompts": [sample],
                       "max_sequence_length": args.text_tokens}}
    if family in TARGETS:
        train["train"]["lora_target_modules"] = TARGETS[family]
    bench = None
    if family == "flux" and args.match_bench:
        from bench.models import FLUX_LORA_TARGETS

        train["train"]["lora_target_modules"] = list(FLUX_LORA_TARGETS)
        bench = _engine_bench(root, "fp32")
        bench["bf16_adapters"] = _engine_bench(root, "bf16")
    job = worker.run(train, timeout=args.timeout)
    if job["status"] != "SUCCEEDED":
        tail = (Path(job["run_dir"]) / "output.log").read_text(errors="replace")[-3000:]
        return {"family": family, "train": {"status": job["status"], "reason": job.get("reason"),
                                            "message": job.get("message"), "log_tail": tail}}
    report: dict[str, Any] = {"family": family, "build_s": build_s, "train_job": job["id"], "train": _train_report(job)}
    if bench is not None:
        report["bench"] = bench
    if family == "flux":
        report["extra"] = _extra_jobs(train, args, worker)
    w, h = _clip_size(side) if family == "wan" else (side, side)
    infer = {"kind": "infer", "name": f"h200-{family}-infer", "model": {"path": str(model), "dtype": "bfloat16"},
             "offload": offload, "env": env, "resources": {"gpus": 1 if args.device == "cuda" else 0},
             "infer": {"prompt": "a red square on a blue background", "negative_prompt": "blurry",
                       "steps": args.infer_steps, "width": w, "height": h, "num_frames": frames, "lora": job["id"],
                       "max_sequence_length": args.text_tokens}}
    inf = worker.run(infer, timeout=args.timeout)
    report["infer"] = _infer_report(inf) if inf["status"] == "SUCCEEDED" else {
        "status": inf["status"], "reason": inf.get("reason"), "message": inf.get("message"),
        "log_tail": (Path(inf["run_dir"]) / "output.log").read_text(errors="replace")[-3000:]}
    return report


def _print(rep: dict[str, Any]) -> None:
    fam, t = rep["family"], rep.get("train", {})
    print(f"\n== {fam}: train {t.get('status')}", flush=True)
    if t.get("status") != "SUCCEEDED":
        print(json.dumps(t, indent=1)[:4000])
        return
    print(f"  weights {t['weight_gb']:.2f} GB; {t['steps']} steps; s/step {t['s_per_step']:.3f} (steps {t['step_seconds']})"
          f"; floor {t['floor_s']:.3f} s ({t['must_cross_gb']:.1f} GB must cross at {H2D_GBPS} GB/s) -> "
          f"x{t['s_per_step'] / t['floor_s']:.2f} of the floor; H2D {t['h2d_gb_per_step']:.1f} GB/step at "
          f"{t['h2d_gbps'] or 0:.1f} GB/s")
    print(f"  peak VRAM {t['vram_peak_gib']:.2f} GiB (cap {CAPS[fam]}); host RSS peak {t['rss_peak_gb']:.1f} GB = "
          f"{t['rss_peak_over_weights']:.2f}x weights ({t['rss_beyond_encoders_over_weights']:.3f}x beyond the process and its "
          f"encoders); (while loading {t['rss_load_peak_over_weights']:.2f}x, of which "
          f"loading added {t['rss_load_added_over_weights']:.2f}x); by phase {t['rss_peaks_by_phase_gb']}")
    print(f"  losses {t['losses']}; samples {t['samples']}")
    b = rep.get("bench")
    if b:
        print(f"  engine bench (flux-dev-lora-8g ours, same dims, targets, cap and LoRA: fp32 weights computing in bf16): "
              f"{b['ms_per_step']:.1f} ms/step; the job's s/step x{t['s_per_step'] * 1e3 / b['ms_per_step']:.3f} of it")
        b16 = b.get("bf16_adapters")
        if b16:
            print(f"  engine bench with bf16 adapters (half the LoRA's VRAM): {b16['ms_per_step']:.1f} ms/step; "
                  f"the job x{t['s_per_step'] * 1e3 / b16['ms_per_step']:.3f}")
    for e in rep.get("extra", []):
        if e["status"] != "SUCCEEDED":
            print(f"  {e['kind']}: {e['status']}\n{e.get('log_tail', '')}")
            continue
        print(f"  {e['kind']}: s/step {e['s_per_step']:.3f} (steps {e['step_seconds']}), first step {e['first_step_s']:.1f} s, "
              f"peak VRAM {e['vram_peak_gib']:.2f} GiB" + (
                  f", compile {e['compile_seconds']:.1f} s, {e['compile_graphs']} graphs, {e['recompiles']} recompiles, "
                  f"inductor cache {e['compile_cache_hits']} hit / {e['compile_cache_misses']} miss"
                  if e.get("compile_graphs") is not None else ""))
    i = rep.get("infer", {})
    if i.get("status") == "SUCCEEDED":
        print(f"  infer: {i['images']} image(s), {i['s_per_image']:.2f} s each, peak VRAM {i['vram_peak_gib']:.2f} GiB, "
              f"RSS {i['rss_peak_over_weights']:.2f}x weights, LoRA {i['lora']}")
    else:
        print(f"  infer {i.get('status')}: {json.dumps(i)[:3000]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="flux,wan", help="Comma-separated: flux, qwen-image, wan.")
    p.add_argument("--out", type=Path, default=Path("/tmp/oj-h200"), help="Work folder on local disk.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--steps", type=int, default=8, help="LoRA steps per train job (s/step: the median of the later half).")
    p.add_argument("--infer-steps", type=int, default=8)
    p.add_argument("--sample-steps", type=int, default=4)
    p.add_argument("--size", type=int, default=1024, help="Image side (Wan: 832x480 clips at 1024).")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--blocks", type=int, default=None, help="Override the depth (smoke tests).")
    p.add_argument("--single-blocks", type=int, default=None)
    p.add_argument("--timeout", type=float, default=480)
    p.add_argument("--keep", action="store_true", help="Keep the model folders.")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--match-bench", action="store_true",
                   help="Flux: train the bench's LoRA targets (bench.models.FLUX_LORA_TARGETS) and time the engine bench's "
                        "flux-dev-lora-8g 'ours' row in a child first (with the job's fp32 LoRA, then bf16 adapters): "
                        "the job's s/step against the engine's own step.")
    p.add_argument("--fp8", action="store_true", help="A second train job with offload.weight_dtype: float8_e4m3fn.")
    p.add_argument("--compile-jobs", type=int, default=0,
                   help="Then this many train jobs with fp8 and offload.compile: the first compiles, the later ones "
                        "should find inductor's graphs in the state dir's cache.")
    p.add_argument("--extra-steps", type=int, default=4, help="LoRA steps of the --fp8 and --compile-jobs jobs.")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    worker = Worker(args.out / "home", args.device)
    reports = []
    try:
        for fam in [f.strip() for f in args.families.split(",") if f.strip()]:
            rep = run_family(fam, args, worker)
            reports.append(rep)
            _print(rep)
            if args.json:  # after each family: a call cut short still keeps the families it finished
                args.json.write_text(json.dumps(reports, indent=1, default=str))
    finally:
        worker.stop()
    ok = all(r.get("train", {}).get("status") == "SUCCEEDED" and r.get("infer", {}).get("status") == "SUCCEEDED"
             and all(e["status"] == "SUCCEEDED" for e in r.get("extra", [])) for r in reports)
    print("\nALL OK" if ok else "\nSOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
