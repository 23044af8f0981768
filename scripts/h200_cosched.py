"""GPU acceptance of co-scheduled inference (issue 32): 4 Flux-dev-dims infer jobs, one stream of weights.

    bash scripts/h200_wheels.sh                                  # here, with PyPI: .whl/ for the GPU box
    # on the GPU box (~6 min; OUT needs ~25 GB free for the 23.8 GB model):
    pip install -q --no-index --find-links .whl -r .whl/requirements.txt
    python scripts/h200_cosched.py --out /tmp/oj-cosched --json /tmp/oj-cosched/cosched.json

It builds the random Flux-dev-dims diffusers folder (scripts/make_big_pipeline.py), starts one worker
with one GPU, and runs, each phase through that worker:
1. together: 4 infer jobs (different prompts and seeds, --size 1024) under an 8 GiB cap
   (OFFLOAD_JOBS_VRAM_CAP), submitted at once: they must run as one batch;
2. staggered: the same 4 jobs submitted --gap (2) seconds apart: how many shared a batch (>= 3 wanted);
3. resident: the same 4 jobs with `offload.enabled: false` and no cap, together: the resident
   per-image time, and the batch the capped one must equal bitwise;
4. alone: one job with `share_stream: false` rendering the 4 prompts one at a time under the cap:
   the max difference of each job's image against its image in the batch (bf16 batching noise).
It prints the per-image time of each phase against the resident one (acceptance: the batch <= 1.25x),
the max differences, the peak VRAM (<= 8 GiB), and keeps it all with `--json`.

`--device cpu --blocks 1 --single-blocks 1 --size 64 --text-tokens 32 --steps 2` runs the same path on
a CPU box (a smoke test of this script; phase 3 then keeps the model resident on the CPU).
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

from h200_runners import Worker, _records, add_flux_job_args, build_big_flux  # noqa: E402

PROMPTS = [("a red square on a blue background", 11), ("a green circle on a white background", 22),
           ("a yellow stripe on a black background", 33), ("a purple square on an orange background", 44)]


def _spec(args: argparse.Namespace, model: Path, n: int, *, resident: bool = False, alone: bool = False) -> dict[str, Any]:
    gpu = args.device == "cuda"
    env = {"OFFLOAD_JOBS_VRAM_CAP": args.cap} if gpu and not resident else {}
    if not gpu:
        env["OMP_NUM_THREADS"] = "2"
    offload: dict[str, Any] = {"target_device": args.device}
    if resident:
        offload["enabled"] = False
    infer: dict[str, Any] = {"steps": args.steps, "width": args.size, "height": args.size,
                             "max_sequence_length": args.text_tokens, "max_batch": 4}
    if alone:  # one job, each prompt rendered on its own, with its batch twin's seed
        infer.update(prompt=[f"{p} --seed {s}" for p, s in PROMPTS], share_stream=False)
    else:
        infer.update(prompt=PROMPTS[n][0], seed=PROMPTS[n][1])
    name = "alone" if alone else f"{'resident' if resident else 'capped'}-{n}"
    return {"kind": "infer", "name": f"cosched-{name}", "model": {"path": str(model), "dtype": "bfloat16"},
            "offload": offload, "env": env, "resources": {"gpus": 1 if gpu else 0}, "infer": infer}


def _submit(worker: Worker, specs: list[dict[str, Any]], gap: float, timeout: float) -> list[dict[str, Any]]:
    ids = []
    for n, spec in enumerate(specs):
        if n and gap:
            time.sleep(gap)
        ids.append(worker.client.submit(spec)["id"])
    return [worker.client.wait(i, timeout=timeout) for i in ids]


def _rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in _records(job) if r.get("step") is not None and r.get("seconds") is not None]


def _images(job: dict[str, Any]) -> list[Any]:
    import numpy as np
    from PIL import Image

    files = sorted((Path(job["run_dir"]) / "outputs").glob("image_*.png"))
    return [np.asarray(Image.open(f).convert("RGB")).astype("int16") for f in files]


def _phase(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """Status, who ran with whom, per-image time and peak VRAM of one phase's jobs."""
    rows = [r for j in jobs for r in _rows(j)]
    out: dict[str, Any] = {"status": [j["status"] for j in jobs], "ids": [j["id"] for j in jobs],
                           "batches": [(j.get("last_metrics") or {}).get("batch_with") for j in jobs]}
    per = [r.get("image_seconds", r["seconds"]) for r in rows]
    out["s_per_image"] = statistics.median(per) if per else None
    peaks = [r["vram_peak_bytes"] for r in rows if r.get("vram_peak_bytes") is not None]
    out["vram_peak_gib"] = max(peaks) / 2**30 if peaks else None  # None: no engine said (the resident run)
    bad = [j for j in jobs if j["status"] != "SUCCEEDED"]
    if bad:
        out["failed"] = [{"id": j["id"], "reason": j.get("reason"), "message": j.get("message"),
                          "log_tail": (Path(j["run_dir"]) / "output.log").read_text(errors="replace")[-2000:]} for j in bad]
    return out


def _shared(batches: list[Any]) -> int:
    """The most jobs that ran in one batch."""
    sizes = [len(b) for b in batches if isinstance(b, list)]
    return max(sizes) if sizes else 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.out / "model-flux"
    if not (model / "model_index.json").exists():
        shutil.rmtree(model, ignore_errors=True)
        build_big_flux(args, model)
    worker = Worker(args.out / "home", args.device)
    rep: dict[str, Any] = {"cap": args.cap, "size": args.size, "steps": args.steps, "device": args.device}
    try:
        together = _submit(worker, [_spec(args, model, n) for n in range(4)], 0, args.timeout)
        rep["together"] = _phase(together)
        staggered = _submit(worker, [_spec(args, model, n) for n in range(4)], args.gap, args.timeout)
        rep["staggered"] = _phase(staggered)
        resident = _submit(worker, [_spec(args, model, n, resident=True) for n in range(4)], 0, args.timeout)
        rep["resident"] = _phase(resident)
        alone = _submit(worker, [_spec(args, model, 0, alone=True)], 0, args.timeout)
        rep["alone"] = _phase(alone)
    finally:
        worker.stop()
        if not args.keep:
            shutil.rmtree(model, ignore_errors=True)
    if all(s == "SUCCEEDED" for k in ("together", "resident", "alone") for s in rep[k]["status"]):
        batch = [im for j in together for im in _images(j)]
        res = [im for j in resident for im in _images(j)]
        solo = _images(alone[0])
        rep["bitwise_vs_resident_batch"] = [bool((a == b).all()) for a, b in zip(batch, res)]
        rep["max_diff_vs_alone"] = [int(abs(a - b).max()) for a, b in zip(batch, solo)]
    return rep


def _print(rep: dict[str, Any]) -> bool:
    base = (rep.get("resident") or {}).get("s_per_image")
    ok = True
    for k in ("together", "staggered", "resident", "alone"):
        ph = rep.get(k) or {}
        ratio = ph.get("s_per_image") / base if base and ph.get("s_per_image") else None
        print(f"{k:>9}: {ph.get('status')}; s/image {ph.get('s_per_image')}"
              + (f" = {ratio:.2f}x resident" if ratio else "") + "; peak VRAM "
              + (f"{ph['vram_peak_gib']} GiB; " if ph.get("vram_peak_gib") is not None else "- (no engine); ")
              + f"largest batch {_shared(ph.get('batches') or [])} jobs", flush=True)
        if ph.get("failed"):
            print(json.dumps(ph["failed"], indent=1)[:4000])
            ok = False
    print(f"bitwise equal to the resident batch: {rep.get('bitwise_vs_resident_batch')}")
    print(f"max |diff| per job vs the job alone (0-255): {rep.get('max_diff_vs_alone')}")
    if rep["device"] == "cuda" and ok:
        t, b = rep["together"], rep["resident"]["s_per_image"]
        checks = {"together share one batch": _shared(t["batches"]) == 4,
                  "staggered: >= 3 share": _shared(rep["staggered"]["batches"]) >= 3,
                  "s/image <= 1.25x resident": t["s_per_image"] <= 1.25 * b,
                  "peak VRAM <= cap": (t["vram_peak_gib"] is not None
                                       and t["vram_peak_gib"] <= float(rep["cap"].removesuffix("GiB"))),
                  "bitwise vs resident batch": all(rep.get("bitwise_vs_resident_batch") or [False])}
        for name, good in checks.items():
            print(f"  {'PASS' if good else 'FAIL'}  {name}")
        ok = all(checks.values())
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flux_job_args(p, out="/tmp/oj-cosched", timeout=900, keep_help="Keep the model folder.")
    p.add_argument("--gap", type=float, default=2.0, help="Seconds between the staggered submissions.")
    p.set_defaults(size=1024, steps=8, text_tokens=512)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rep = run(args)
    ok = _print(rep)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1, default=str))
    print("\nALL OK" if ok else "\nSOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
