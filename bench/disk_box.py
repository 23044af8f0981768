"""The 8 GB card in a 16 GB box: full Flux-dev dims streamed from shards on local disk.

    python -m bench.disk_box --dir /var/tmp/flux-box                  # H200: VRAM capped at 8 GiB, max_memory 6 GiB
    python -m bench.disk_box --dir /var/tmp/flux-box --lora           # ... then LoRA r32 steps as well
    python -m bench.disk_box --tiny --device cpu --dir /tmp/box       # the same path, tiny, on a CPU

1. Builds Flux-dev dims (19 + 38 blocks, bf16, random weights), runs it resident once for the
   reference output and time, and writes its shards (``shard_model``) plus its config.json.
2. Reads the shard files once with O_DIRECT (page cache dropped first where permitted): the disk rate.
3. In a fresh child process (so its RSS is its own): builds the model on the meta device, caps VRAM
   (``set_per_process_memory_fraction``), ``enable_offload(lazy_load=True, max_memory=...)``, runs
   ``--steps`` inference passes (each compared bitwise with the reference), then, with
   ``--lora``, LoRA r32 training steps with gradient checkpointing; reports times, peak VRAM
   (inference and LoRA apart), peak RSS and the disk store's stats.
4. Prints both times against their floors, max(resident, (1 - f) x bytes / disk rate, bytes / H2D
   rate) per weight crossing, where f is the cache's share of the streamed bytes (max_memory holds
   the staging slots, ``--stream-slots`` of the largest unit, and the cache), and the issue's
   acceptance lines: bitwise, peak VRAM <= 7.5 GiB, peak RSS <= 10 GiB.

It needs diffusers; without it it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

FLUX_DEV = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
                pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
                num_layers=19, num_single_layers=38)
TINY = dict(patch_size=1, in_channels=16, attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
            pooled_projection_dim=32, guidance_embeds=False, axes_dims_rope=(8, 12, 12), num_layers=2,
            num_single_layers=4)


def inputs(cfg: dict[str, Any], tiny: bool, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    side, txt = (8, 16) if tiny else (64, 512)  # 1024x1024: 64x64 latent tokens, 512 text tokens
    g = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]
    out = {"hidden_states": torch.randn(1, side * side, cfg["in_channels"], generator=g).to(dtype),
           "encoder_hidden_states": torch.randn(1, txt, cfg["joint_attention_dim"], generator=g).to(dtype),
           "pooled_projections": torch.randn(1, cfg["pooled_projection_dim"], generator=g).to(dtype),
           "timestep": torch.tensor([0.5], dtype=dtype), "img_ids": img_ids.reshape(-1, 3), "txt_ids": torch.zeros(txt, 3)}
    return {k: v.to(device) for k, v in out.items()}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Build, run resident, shard; returns what the report needs."""
    from diffusers import FluxTransformer2DModel

    from bench.disk import drop_page_cache, raw_read_rate
    from offload_core.disk.format import load_index
    from offload_core.disk.write import shard_model
    from offload_core.units import discover_units

    cfg = TINY if args.tiny else FLUX_DEV
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = FluxTransformer2DModel(**cfg)
    model.to(dtype).to_empty(device="cpu").eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn((1 << 24) + (1 << 20), generator=gen) * 0.02).to(dtype)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            flat = t.view(-1)
            for s in range(0, flat.numel(), 1 << 24):
                k = min(1 << 24, flat.numel() - s)
                o = int(torch.randint(0, 1 << 20, (1,), generator=gen))
                flat[s: s + k].copy_(pool[o: o + k])
            if t.dim() == 1 and "norm" in name and name.endswith("weight"):
                flat.add_(1.0)
    build_s = time.perf_counter() - t0
    model.save_config(root)
    plan = discover_units(model, "block")
    t0 = time.perf_counter()
    shard_model(model, plan.units, root / "shards", plan.block_lists)
    shard_s = time.perf_counter() - t0
    x = inputs(cfg, args.tiny, args.device, dtype)
    model.to(args.device)
    with torch.no_grad():
        model(**x, return_dict=False)
        _sync(args.device)
        t0 = time.perf_counter()
        ref = model(**x, return_dict=False)[0]
        _sync(args.device)
    resident_s = time.perf_counter() - t0
    torch.save(ref.cpu(), root / "reference.pt")
    lora_resident_s = None
    if args.lora:
        lora_resident_s = min(_lora_steps(model, x, 2, args.device))
    del model, ref
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    index = load_index(root / "shards")
    cache = drop_page_cache()
    raw = raw_read_rate(index, args.workers, pin=args.device.startswith("cuda"))
    return {"build_s": build_s, "shard_s": shard_s, "resident_s": resident_s, "lora_resident_s": lora_resident_s,
            "raw_gbps": raw, "page_cache": cache, "bytes": sum(e.nbytes for e in index.units.values())}


def _lora_config() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=32, lora_alpha=32, init_lora_weights="gaussian",
                      target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out", "ff.net.2"])


def _lora_steps(model: Any, x: dict[str, torch.Tensor], steps: int, device: str) -> list[float]:
    """LoRA r32 steps with gradient checkpointing on ``model`` (adapters added here when missing)."""
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA backward is broken on the H200 image (torch #196678)
    if not any("lora" in n for n, _ in model.named_parameters()):
        model.add_adapter(_lora_config())
    model.enable_gradient_checkpointing()
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(**x, return_dict=False)[0].float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def _vm_hwm_bytes() -> int:
    """This process's peak RSS since its exec (VmHWM). Not getrusage's ru_maxrss: Linux carries the
    parent's peak across fork and exec into it, and the parent here held the whole model."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


def child(args: argparse.Namespace) -> dict[str, Any]:
    """The measured run: a fresh process, the model on the meta device, weights only from the shards."""
    from diffusers import FluxTransformer2DModel

    from offload_core import enable_offload

    root = Path(args.dir)
    cfg = TINY if args.tiny else FLUX_DEV
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.vram_gib * 2**30 / total))
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(FluxTransformer2DModel.load_config(root)).to(dtype)
    model.eval().requires_grad_(False)
    if args.lora:  # adapters made on the meta device get their (random) values before the engine sees them
        model.add_adapter(_lora_config())
        lora = {n: (torch.randn(p.shape) * 0.01).to(dtype) if "lora_A" in n else torch.zeros(p.shape, dtype=dtype)
                for n, p in model.named_parameters() if "lora" in n}
        model.load_state_dict(lora, strict=False, assign=True)
        for n, p in model.named_parameters():
            p.requires_grad_("lora" in n)
    t0 = time.perf_counter()
    handle = enable_offload(model, target_device=args.device, lazy_load=True, shard_dir=str(root / "shards"),
                            max_memory=args.max_memory, num_disk_workers=args.workers, offload_granularity="block",
                            disk_stream_slots=args.stream_slots)  # staging: part of max_memory
    setup_s = time.perf_counter() - t0
    x = inputs(cfg, args.tiny, args.device, dtype)
    ref = torch.load(root / "reference.pt")
    out: dict[str, Any] = {"setup_s": setup_s, "infer_s": [], "bitwise": []}
    with torch.no_grad():  # the LoRA's B is zero: the output is the base model's, exactly
        for _ in range(args.steps):
            before = handle.stats()
            t0 = time.perf_counter()
            y = model(**x, return_dict=False)[0]
            _sync(args.device)
            out["infer_s"].append(time.perf_counter() - t0)
            out["bitwise"].append(bool(torch.equal(y.cpu(), ref)))
    s = handle.stats()
    hit, miss = (s[k] - before[k] for k in ("disk_cache_hit_bytes", "disk_cache_miss_bytes"))
    out["last_pass_hit_rate_bytes"] = hit / max(hit + miss, 1)  # the pass after the first: the steady state
    out["infer_stats"] = {k: v for k, v in s.items() if k.startswith(("disk_", "vram_", "pinned", "h2d_gbps", "stall",
                                                                          "streamed_bytes", "slot_", "prefetch_depth"))}
    out["vram_peak_gib"] = s.get("vram_peak_bytes", 0) / 2**30
    out["infer_peak_rss_gib"] = _vm_hwm_bytes() / 2**30  # before any LoRA step
    if args.lora:
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        out["lora_s"] = _lora_steps(model, x, args.steps, args.device)
        out["lora_vram_peak_gib"] = handle.stats().get("vram_peak_bytes", 0) / 2**30
    s = handle.stats()
    out["stats"] = {k: v for k, v in s.items() if k.startswith(("disk_", "vram_", "pinned", "h2d_gbps", "stall",
                                                                    "streamed_bytes", "slot_", "prefetch_depth"))}
    out["peak_rss_gib"] = _vm_hwm_bytes() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.disk_box", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="a directory on the local disk (about 25 GB free at full size)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny Flux dims (a check of the path, not a measurement)")
    p.add_argument("--vram-gib", type=float, default=8.0)
    p.add_argument("--max-memory", default="6GiB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--stream-slots", type=int, default=3,
                   help="staging slots the disk workers read into, part of max_memory (each the largest unit: "
                        "680 MB at Flux-dev dims)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--lora", action="store_true", help="LoRA training steps instead of inference passes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print("bench.disk_box: needs diffusers (carry its wheel, see bench/run_h200.sh)", file=sys.stderr)
        return 2
    prep = prepare(args)
    cmd = [sys.executable, "-m", "bench.disk_box", "--child", "--dir", args.dir, "--device", args.device,
           "--vram-gib", str(args.vram_gib), "--max-memory", args.max_memory, "--workers", str(args.workers),
           "--stream-slots", str(args.stream_slots),
           "--steps", str(args.steps), *(["--tiny"] if args.tiny else []), *(["--lora"] if args.lora else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if run.returncode != 0:
        print(run.stderr[-4000:], file=sys.stderr)
        return 1
    res = json.loads(run.stdout.strip().splitlines()[-1])
    st = res["stats"]
    streamed = st.get("streamed_bytes") or prep["bytes"]
    f = min(1.0, st.get("disk_cache_capacity_bytes", 0) / max(streamed, 1))  # the cache's share of what streams
    h2d = 55.0 if args.device.startswith("cuda") else float("inf")  # the host's measured pinned H2D rate

    def floor(resident: float, crossings: int) -> float:  # checkpointing: forward, then the recompute with backward
        return max(resident, crossings * (1 - f) * streamed / 1e9 / prep["raw_gbps"], crossings * streamed / 1e9 / h2d)

    report = {**prep, **res, "f": f, "infer_floor_s": floor(prep["resident_s"], 1), "infer_step_s": min(res["infer_s"])}
    print(f"{prep['bytes'] / 1e9:.1f} GB of shards, raw O_DIRECT {prep['raw_gbps']:.2f} GB/s ({prep['page_cache']}), "
          f"max_memory {args.max_memory} = {st.get('disk_stream_slots')} staging slots "
          f"({st.get('disk_stream_bytes', 0) / 2**30:.2f} GiB) + cache {st.get('disk_cache_capacity_bytes', 0) / 2**30:.2f} GiB "
          f"(f = {f:.2f}), VRAM cap {args.vram_gib} GiB")
    rows = [("inference", min(res["infer_s"]), report["infer_floor_s"], prep["resident_s"])]
    if args.lora:
        report["lora_floor_s"] = floor(prep["lora_resident_s"], 2)
        report["lora_step_s"] = min(res["lora_s"])
        rows.append(("LoRA step", report["lora_step_s"], report["lora_floor_s"], prep["lora_resident_s"]))
    for what, step, fl, resident in rows:
        print(f"{what}: {step:.2f} s against a floor of {fl:.2f} s ({step / fl:.2f}x); resident {resident:.2f} s")
    print(f"disk {st.get('disk_gbps', 0):.2f} GB/s, hit rate {st.get('disk_cache_hit_rate', 0):.2f} (all uses), "
          f"{res.get('last_pass_hit_rate_bytes', 0):.3f} of the bytes in the last inference pass (f = {f:.3f}), "
          f"disk stall {st.get('disk_stall_ms', 0) / 1e3:.1f} s, pinned {st.get('pinned_capacity_bytes', 0) / 2**30:.2f} GiB")
    ok = lambda c: "ok" if c else "MISS"  # noqa: E731
    bitwise = all(res["bitwise"])
    print(f"acceptance: inference bitwise equal to resident: {bitwise} ({ok(bitwise)}); peak VRAM "
          f"{res['vram_peak_gib']:.2f} GiB <= 7.5 ({ok(res['vram_peak_gib'] <= 7.5)}); peak RSS "
          f"{res['peak_rss_gib']:.2f} GiB <= 10 ({ok(res['peak_rss_gib'] <= 10)})"
          + (f"; LoRA steps completed, peak VRAM {res['lora_vram_peak_gib']:.2f} GiB" if args.lora else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
