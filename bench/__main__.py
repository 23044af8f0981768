"""python -m bench --workloads p1,p2,p3,flux-dev-lora-8g --json out.json [--device cuda|cpu] [--tiny] [--only ours,resident]
                  [--link-gbps 13,25,50,real]

Everything runs in this one process: the copy ceilings, then for each workload one CPU master
model and one set of inputs, and every variant on a fresh copy of that master.

``--link-gbps`` runs our variants again at each emulated link tier (consumer cards: Gen4 x8 about
13 GB/s, Gen4 x16 about 25, Gen5 x16 about 50; ``real`` is this machine's own link), one block of
rows per tier, each judged against its tier's floor: max(resident, bytes that must cross / the
tier's rate). The emulation is the engine's ``debug_link_gbps`` (offload_core/link.py): after each
H2D copy our engine queues, a spin kernel holds the copy stream for the extra time the slower link
would need (``nbytes / asked - nbytes / real``), so the unit's ready event, the next copy, a bounce
buffer's reuse and the copy rate the planner reads all see the slower link. It adds time on the
copy stream only: D2H copies run at the real rate, and the host side (bounce fills, kernel
launches) is what this machine's is. Peers are not paced (n/a at an emulated tier); resident
crosses no link and runs once per workload, its row standing in every tier. See bench/tiers.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from typing import Any

__all__ = ["main"]

ALL_VARIANTS = [
    "resident", "resident-repeat", "ours-seed", "ours", "ours-pf2", "ours-tuned", "ours-budget50", "ours-budget7g",
    "ours-phase", "ours-fp8", "ours-fp8-keep-widened", "ours-fp8-tensor", "ours-fp8-block", "resident-compile", "ours-compile",
    "ours-fp8-compile", "ours-bounce", "ours-bounce-t8", "ours-regfail", "ours-bounce-libc", "ours-bounce-native", "ours-regfail-native", "ours-exact", "ours-serial-step", "serial-hooks", "diffusers-leaf", "diffusers-block", "accelerate",
    "ours-accum2", "ours-accum2-layer", "ours-accum4", "ours-accum4-layer", "ours-accum4-layer-park",
]
# K micro-batches a step take K times as long: run only when named in --only
OPT_IN = {"ours-fp8-keep-widened", "ours-bounce-native", "ours-regfail-native", "ours-accum2", "ours-accum2-layer", "ours-accum4", "ours-accum4-layer", "ours-accum4-layer-park"}


class UsageError(Exception):
    """A bad command line; the message names the option."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description="Weight-offload benchmark: ours against resident and the peers.")
    p.add_argument("--workloads", default="p1,p2,p3", help="comma list of p1, p2, p3, flux-dev-lora-8g, flux-dev-infer-8g")
    p.add_argument("--json", dest="json_path", default=None, help="write every measurement here")
    p.add_argument("--md", dest="md_path", default=None, help="also write the report as markdown here")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--tiny", action="store_true", help="shrink every workload so the whole run takes seconds on a CPU")
    p.add_argument("--repeats", type=int, default=None, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (the first traces the schedule)")
    p.add_argument("--only", default=None, help=f"comma list of variants: {', '.join(ALL_VARIANTS)}")
    p.add_argument("--ceiling-gb", type=float, default=None, help="size of the pinned tensor for the H2D ceiling")
    p.add_argument("--no-profile", action="store_true", help="skip the extra profiled step per variant")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="after each of our variants, N rounds of one resident step then one of ours (default 0: off)")
    p.add_argument("--lora-dtype", choices=("bf16", "fp32"), default="bf16", help="the LoRA weights' dtype of p2 and flux-dev-lora-8g (default bf16); fp32 is the train runner's LoRA: fp32 weights and optimizer state, computing in bf16")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads on --device cpu (default 1: steady on a busy machine)")
    p.add_argument("--link-gbps", default=None, metavar="LIST",
                   help="comma list of emulated H2D link rates in GB/s and/or 'real' (e.g. 13,25,50,real): "
                        "our variants run at each, one block of rows per tier, each against its own floor")
    return p.parse_args(argv)


def _tiers(args: argparse.Namespace) -> list[float | None] | None:
    from .tiers import parse_link_gbps

    if args.link_gbps is None:
        return None
    try:
        return parse_link_gbps(args.link_gbps)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    from .workloads import WORKLOADS

    names = [w.strip().lower() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise UsageError(f"--workloads: unknown workload {bad[0] if bad else '(none)'!r} (choose from {', '.join(WORKLOADS)})")
    only = None
    if args.only:
        only = [v.strip() for v in args.only.split(",") if v.strip()]
        bad = [v for v in only if v not in ALL_VARIANTS]
        if bad:
            raise UsageError(f"--only: unknown variant {bad[0]!r} (choose from {', '.join(ALL_VARIANTS)})")
    _tiers(args)
    if args.paired < 0:
        raise UsageError(f"--paired: must be >= 0, got {args.paired}")
    for key in ("repeats", "warmup"):
        v = getattr(args, key)
        if v is not None and v < (1 if key == "repeats" else 0):
            raise UsageError(f"--{key}: must be >= {1 if key == 'repeats' else 0}, got {v}")
    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise UsageError(f"--device: expected cuda or cpu, got {args.device!r}")
    return names, only


def _versions() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("diffusers", "accelerate", "peft"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:
            out[mod] = f"unavailable ({type(e).__name__})"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from .floor import derive, workload_meta
    from .measure import measure_ceilings, warm_device
    from .peers import NotApplicable, variants_for
    from .runner import run_tuned, run_variant
    from .tiers import at_tier, derive_tiers, tier_label, tier_row
    from .workloads import get_workload

    t_start = time.perf_counter()
    names, only = _check(args)
    tiers = _tiers(args)
    want = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device: cuda was asked for, but torch sees no CUDA device (use --device cpu)")
    device = torch.device(want)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    warmup = args.warmup if args.warmup is not None else (2 if args.tiny else 3)
    repeats = args.repeats if args.repeats is not None else (3 if args.tiny else 10)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(max(1, args.cpu_threads or 1))
    else:
        # cuDNN's SDPA backward is broken for bf16 Flux-width attention on torch 2.11 + cuDNN 9.19
        # (torch issue 196678, resident too): flash and memory-efficient attention take over.
        torch.backends.cuda.enable_cudnn_sdp(False)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    meta = {
        **_versions(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "tiny": args.tiny,
        "warmup": warmup,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "cudnn_sdp": "off" if device.type == "cuda" else None,
        "argv": sys.argv,
        "link_gbps": None if tiers is None else [tier_label(g) for g in tiers],
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    gb = args.ceiling_gb if args.ceiling_gb is not None else (0.0625 if args.tiny or device.type == "cpu" else 2.0)
    log(f"measuring the copy ceiling with {gb:g} GB ...")
    ceiling = measure_ceilings(device, int(gb * 1e9))
    ceiling["repeats"] = 10
    log(f"  H2D {ceiling['h2d_gbps']:.2f} GB/s ({ceiling['kind']})")
    warm_device(device)

    rows: list[dict[str, Any]] = []
    metas: dict[str, dict[str, Any]] = {}

    def result(partial: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"meta": meta, "ceiling": ceiling, "workloads": metas, "rows": rows}
        if tiers is None:
            derive(rows, metas, ceiling)
        else:
            out["tiers"] = derive_tiers(rows, metas, ceiling, tiers)
        if partial:
            out["partial"] = True
        return out

    for name in names:
        wl = get_workload(name, args.tiny, lora_dtype=torch.bfloat16 if args.lora_dtype == "bf16" else torch.float32)
        t0 = time.perf_counter()
        master = wl.build()
        inputs = wl.make_inputs(device)
        metas[name] = workload_meta(wl, master)
        metas[name]["build_s"] = time.perf_counter() - t0
        log(f"{name}: {wl.title} ({metas[name]['weight_bytes'] / 1e9:.3f} GB, built in {metas[name]['build_s']:.1f} s)")
        ref = ref_compiled = None  # what resident and resident-compile produced
        for variant in variants_for(wl):
            if (variant.name not in only) if only is not None else variant.name in OPT_IN:
                continue
            # resident crosses no link: at link tiers it runs once, its row standing in every tier
            shared = tiers is None or variant.family == "resident"
            for gbps in ([None] if shared else tiers):
                log(f"  {variant.name}{'' if shared else ' at ' + tier_label(gbps)} ...")
                # a compiled variant is compared with resident compiled the same way, when it ran
                compiled = variant.config.get("compile") and variant.name != "resident-compile"
                kw = dict(warmup=warmup, repeats=repeats, ref=ref_compiled if compiled and ref_compiled else ref)
                try:
                    paced = at_tier(variant, gbps)
                except NotApplicable as e:
                    row = {"workload": wl.name, "variant": variant.name, "family": variant.family,
                           "config": dict(variant.config), "status": "n/a", "reason": str(e)}
                else:
                    if variant.name == "ours-tuned":
                        row = run_tuned(wl, master, inputs, device, log=log, paired=args.paired, **kw)
                    else:
                        row = run_variant(wl, master, inputs, paced, device, profile=not args.no_profile,
                                          paired=args.paired, **kw)
                reference = row.pop("_reference", None)
                if variant.name == "resident" and reference is not None:
                    ref = reference
                if variant.name == "resident-compile" and reference is not None:
                    ref_compiled = reference
                status = f"{row['time_ms']:.2f} ms" if row.get("status") == "ok" else f"{row.get('status')}: {row.get('reason')}"
                log(f"    {status}")
                if tiers is None:
                    rows.append(row)
                else:
                    rows.extend(tier_row(row, g) for g in (tiers if shared else [gbps]))
                if args.json_path:  # after each variant, so a run cut short still leaves its results
                    _write_json(args.json_path, result(partial=True))
        del master, inputs
    out = result()
    meta["wall_s"] = time.perf_counter() - t_start
    return out


def _write_json(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_jsonable(result), f, indent=1)
    os.replace(tmp, path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None or isinstance(obj, float):
        return obj
    return str(obj)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        _check(args)
        result = run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .report import format_markdown, render

    if args.json_path:
        _write_json(args.json_path, result)
    if args.md_path:
        with open(args.md_path, "w") as f:
            f.write(format_markdown(result))
    render(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
