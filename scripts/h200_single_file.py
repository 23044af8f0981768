"""GPU acceptance of single-file checkpoints (issue 31): a Flux-dev-dims train job from a BFL-layout file.

    bash scripts/h200_wheels.sh                               # here, with PyPI: .whl/ for the GPU box
    # on the GPU box (OUT needs ~50 GB free: the 23.8 GB BFL file and its 23.8 GB conversion):
    pip install -q --no-index --find-links .whl -r .whl/requirements.txt
    python scripts/h200_single_file.py --out /tmp/oj-single --json /tmp/oj-single/single.json

It builds the random Flux-dev-dims diffusers folder (scripts/make_big_pipeline.py), writes its
transformer as one BFL-layout file (`double_blocks.N.img_attn.qkv.weight`, fused qkv and linear1:
the inverse of diffusers' converter, tests/jobs/runners/single_file_helpers.py), deletes the
folder's own transformer weights (the folder stays the `model.base`: text encoders, VAE, configs),
then submits the same train job twice with `model.transformer` the file and `OFFLOAD_JOBS_VRAM_CAP`:
the first converts it into the model cache (the `runner.convert` event: miss, seconds), the second
reuses it (hit, 0 s). It prints and keeps (`--json`) each job's status, convert event, s/step, peak
VRAM and peak host RSS against the weights (target <= 1.10x).

`--device cpu --blocks 1 --single-blocks 1 --size 64 --text-tokens 32` runs the same path on a CPU box.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "jobs" / "runners"))

from h200_runners import TARGETS, Worker, _dataset, _records, add_flux_job_args, build_big_flux  # noqa: E402  (the worker and dataset helpers)

RSS_TARGET = 1.10


def _events(job: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    path = Path(job["run_dir"]) / "events.jsonl"
    return [e for e in (json.loads(line) for line in path.read_text().splitlines() if line.strip())
            if e.get("type") == f"runner.{kind}"]


def write_bfl_file(model: Path, dst: Path) -> int:
    """The folder's transformer as one BFL-layout file, in a child process (this one holds nothing);
    then the folder's own transformer weights are removed (its config.json stays)."""
    code = ("import sys; from pathlib import Path; from single_file_helpers import write_bfl; "
            "write_bfl(Path(sys.argv[1]), Path(sys.argv[2]))")
    env_path = f"{REPO}:{REPO / 'tests' / 'jobs' / 'runners'}"
    subprocess.run([sys.executable, "-c", code, str(model / "transformer"), str(dst)], check=True, cwd=REPO,
                   env={**__import__("os").environ, "PYTHONPATH": env_path})
    for f in (model / "transformer").glob("*.safetensors*"):
        f.unlink()
    return dst.stat().st_size


def _report(job: dict[str, Any]) -> dict[str, Any]:
    run = Path(job["run_dir"])
    out: dict[str, Any] = {"status": job["status"], "reason": job.get("reason"), "message": job.get("message"),
                           "convert": [{k: v for k, v in e.items() if k != "ts"} for e in _events(job, "convert")]}
    if job["status"] != "SUCCEEDED":
        out["log_tail"] = (run / "output.log").read_text(errors="replace")[-4000:]
        return out
    steps = [r for r in _records(job) if "loss" in r]
    summary = json.loads((run / "outputs" / "train_summary.json").read_text())
    later = steps[len(steps) // 2:] or steps
    weights = summary.get("weight_bytes") or 0
    out.update({"steps": len(steps), "s_per_step": statistics.median(r["step_seconds"] for r in later),
                "vram_peak_bytes": steps[-1].get("vram_peak_bytes"), "weight_bytes": weights,
                "rss_peak_bytes": summary["host_rss_peak_bytes"],
                "rss_ratio": summary["host_rss_peak_bytes"] / weights if weights else None,
                "rss_peaks_by_phase": summary.get("host_rss_peaks", {})})
    return out


def _print(name: str, rep: dict[str, Any]) -> None:
    gib = 2**30
    print(f"\n== {name}: {rep['status']}", flush=True)
    for e in rep["convert"]:
        print("  event runner.convert " + json.dumps(e))
    if rep["status"] != "SUCCEEDED":
        print(f"  {rep.get('reason')}: {rep.get('message')}\n{rep.get('log_tail', '')}")
        return
    ratio = rep["rss_ratio"]
    print(f"  {rep['steps']} steps, {rep['s_per_step']:.2f} s/step; peak VRAM {(rep['vram_peak_bytes'] or 0) / gib:.2f} GiB; "
          f"peak host RSS {rep['rss_peak_bytes'] / gib:.2f} GiB" + (f" = {ratio:.3f}x the weights" if ratio else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flux_job_args(p, out="/tmp/oj-single", timeout=900, keep_help="Keep the model, the file and the conversion.")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    model, home, bfl = args.out / "model-flux", args.out / "home", args.out / "flux1-dev-random.safetensors"
    t0 = time.time()
    build_big_flux(args, model)
    size = write_bfl_file(model, bfl)
    print(f"built the model and its {size / 1e9:.1f} GB BFL file in {time.time() - t0:.0f}s", flush=True)
    data = _dataset("flux", args.out, args.size, 1)
    worker = Worker(home, args.device)
    reports: dict[str, Any] = {}
    try:
        env = {"OFFLOAD_JOBS_VRAM_CAP": args.cap} if args.device == "cuda" else {"OMP_NUM_THREADS": "2"}
        spec = {"kind": "train", "name": "single-file-flux-train", "offload": {"target_device": args.device},
                "model": {"transformer": str(bfl), "base": str(model), "dtype": "bfloat16"}, "env": env,
                "resources": {"gpus": 1 if args.device == "cuda" else 0},
                "train": {"dataset": str(data), "steps": args.steps, "learning_rate": 1e-4, "lora_rank": 32,
                          "lora_target_modules": TARGETS["flux"], "max_pixels": args.size * args.size,
                          "gradient_checkpointing": True, "save_every": args.steps,
                          "max_sequence_length": args.text_tokens}}
        for name in ("first (converts)", "second (cache hit)"):
            reports[name] = _report(worker.run(spec, timeout=args.timeout))
            _print(name, reports[name])
    finally:
        worker.stop()
        if not args.keep:
            shutil.rmtree(model, ignore_errors=True)
            shutil.rmtree(home / "models" / "converted", ignore_errors=True)
            bfl.unlink(missing_ok=True)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1, default=str))
    first, second = reports.values()
    ok = (first["status"] == second["status"] == "SUCCEEDED"
          and [e["result"] for e in first["convert"]] == ["miss"] and [e["result"] for e in second["convert"]] == ["hit"]
          and (args.device == "cpu" or all((r["rss_ratio"] or 0) <= RSS_TARGET for r in reports.values())))
    print("\nOK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
