"""The infer runner: the family's diffusers pipeline, the engine on its transformer.

1. check the model folder and the LoRA (a file, a folder, or a train job's id), and that they agree
2. encode every prompt and negative prompt (text encoders under component offload, then freed)
3. load the transformer onto the engine (read straight into its arena), fuse the LoRA into its host
   masters
4. render each prompt for each seed; write PNGs (frames, a GIF and, with imageio-ffmpeg, an MP4 for
   Wan), a JSON of every parameter, and a contact sheet of everything
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from jobs.contract import Metric, StepMetrics
from jobs.runners import render as rnd
from jobs.runners.convert import transformer_folder
from jobs.runners.families import FamilyAdapter, get_adapter
from jobs.runners.inputs import Checked, check_infer
from jobs.runners.load import (apply_vram_cap, compile_cache, free_host_memory, load_pipeline_parts, load_transformer,
                               offload_config, resolve_device, resolve_dtype)
from jobs.runners.folders import LoraError, lora_format, read_lora_header
from jobs.runners.host_tier import choose_host_tier
from jobs.runners.lora import base_weights_on_host, read_lora
from jobs.runners.precompute import encode_texts, make_cache
from jobs.runners.telemetry import HostMemoryWatch, MetricsWriter, emit_event
from jobs.spec import JobSpec

__all__ = ["infer", "plan_prompts", "prepare_model", "Ready", "home_cache"]


def plan_prompts(spec: JobSpec, family: FamilyAdapter, texts: list[str] | None = None) -> list[rnd.PromptSpec]:
    """Every (prompt, seed) to render, inline options applied over the spec's values; `texts`: the
    prompts `check_infer` read (infer.prompt and infer.prompt_file), else infer.prompt alone."""
    i = spec.infer
    defaults = rnd.PromptSpec(prompt="", width=i.width, height=i.height, seed=i.seed, steps=i.steps,
                              guidance=i.guidance if i.guidance is not None else family.default_guidance,
                              negative=i.negative_prompt or "", frames=i.num_frames if family.is_video else 1)
    prompts = texts if texts else (i.prompt if isinstance(i.prompt, list) else [i.prompt])
    out = []
    for text in prompts:
        base = rnd.parse_prompt(text, defaults)
        seeds = i.seeds if i.seeds else [base.seed + k for k in range(i.num_images)]
        for s in seeds:
            p = rnd.PromptSpec(**base.as_dict())
            p.seed = s
            out.append(p)
    return out


def infer(spec: JobSpec, run_dir: Path, checked: Checked | None = None) -> dict[str, Any]:
    """Run the job; `checked` is what `inputs.check_infer` returned (checked again if not given)."""
    checked = checked or check_infer(spec, run_dir.parent.parent)
    outputs = Path(os.environ.get("OFFLOAD_JOBS_OUTPUTS") or run_dir / "outputs")
    outputs.mkdir(parents=True, exist_ok=True)
    metrics = MetricsWriter()
    device = resolve_device(spec.offload.target_device)
    cap = apply_vram_cap(device)
    dtype = resolve_dtype(spec.model.dtype, device)
    family = get_adapter(checked.family)
    prompts = plan_prompts(spec, family, checked.prompts)
    watch = HostMemoryWatch(run_dir)
    with watch:
        return _infer(spec, run_dir, outputs, metrics, device, cap, dtype, checked.model_dir, family, checked.lora,
                      prompts, watch, transformer=checked.transformer, parts=checked.parts)


def _fuse_lora(family: FamilyAdapter, path: Path, scale: float, run_dir: Path | None = None):
    """The LoRA (any format `lora.read_lora` reads) fused into the transformer's weights at `scale`;
    how many modules it applied goes to the log and to a `lora_applied` event."""
    def prepare(model: torch.nn.Module) -> None:
        state, fmt, others = read_lora(path, family, model, "infer.lora")
        wanted = {k.rsplit(".lora_", 1)[0].removeprefix("transformer.") for k in state if ".lora_A" in k}
        if not wanted:
            raise LoraError(f"infer.lora: {path} ({fmt}) holds no LoRA for the {family.name} transformer")
        modules = {n for n, _ in model.named_modules()}
        absent = sorted(wanted - modules)
        if len(absent) == len(wanted):
            raise LoraError(f"infer.lora: none of the {len(wanted)} modules of {path} ({fmt}) is in this model "
                            f"(e.g. {absent[0]}); it applies nothing")
        if absent:
            raise LoraError(f"infer.lora: only {len(wanted) - len(absent)} of the {len(wanted)} modules of {path} ({fmt}) "
                            f"are in this model (e.g. not {absent[0]}; a LoRA of another model size?)")
        try:
            model.load_lora_adapter(state, prefix="transformer", adapter_name="job_lora")
        except Exception as exc:
            raise LoraError(f"infer.lora: {path} ({fmt}) does not fit this {family.name} model ({exc})"[:600]) from None
        got = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}
        if got != wanted:  # peft left some out: no silent partial LoRA
            raise LoraError(f"infer.lora: {len(got)} of the {len(wanted)} modules of {path} ({fmt}) were applied")
        with base_weights_on_host(model):  # on the CPU, into the engine's host masters when it streams them
            model.fuse_lora(lora_scale=scale)
        model.unload_lora()
        emit_event(run_dir, "lora_applied", path=str(path), format=fmt, modules=len(got), tensors=len(state),
                   other_model_tensors=others)

    return prepare


@dataclass
class Ready:
    """The model set up for rendering (what `prepare_model` made)."""

    pipe: Any
    vae: Any
    loaded: Any
    texts: dict[str, dict[str, torch.Tensor]]
    max_len: int
    engine_keys: dict[str, Any]


def prepare_model(spec: JobSpec, run_dir: Path, device: torch.device, cap: int | None, dtype: torch.dtype,
                  model_dir: Path, family: FamilyAdapter, lora: Path | None, prompts: list[rnd.PromptSpec],
                  watch: HostMemoryWatch, on_row: Callable[[dict[str, Any]], None],
                  transformer: Path | None = None, files: dict[str, Path] | None = None) -> Ready:
    """Encode every prompt (text encoders freed after), load the transformer onto the engine with the
    LoRA fused, and build the family's pipeline around it (a co-scheduled batch's too); each phase's
    metrics row goes to `on_row` as it ends."""
    i = spec.infer
    watch.phase("encode")
    t0 = time.perf_counter()
    pipe = load_pipeline_parts(model_dir, family, dtype, files=files)
    vae, scheduler = pipe.vae, pipe.scheduler
    cache = make_cache(home_cache(run_dir), model_dir, family, dtype, files)
    max_len = i.max_sequence_length or family.default_max_sequence_length
    wanted = [p.prompt for p in prompts] + ([p.negative for p in prompts] if family.uses_negative else [])
    texts = encode_texts(pipe, family, cache, wanted, max_len, device, cap)
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, None)
    del pipe
    free_host_memory()
    on_row({"phase": "encode", Metric.seconds: round(time.perf_counter() - t0, 3), **cache.counts.as_dict()})

    watch.phase("load")
    prepare = _fuse_lora(family, lora, i.lora_scale, run_dir) if lora is not None else None
    engine_keys = spec.offload.engine_kwargs()  # as the user wrote them, for params.json
    engine_keys.pop("enable_optimizer_cpu_offload", None)
    tdir = transformer_folder(model_dir, transformer, run_dir)
    if spec.offload.compile:
        compile_cache(run_dir)
    offload = choose_host_tier(spec, offload_config(spec, device, training=False), model_dir, dtype, run_dir,
                               held_bytes=watch.rss(), transformer_dir=tdir)
    if lora is not None and offload is not None and offload.lazy_load:
        # fusing writes the blocks the LoRA touches, which the disk store then keeps in RAM (their files no
        # longer hold their values), and base_weights_on_host reads the whole state_dict once to do it
        emit_event(run_dir, "lora_on_disk_tier", message=(
            "infer.lora with the weights streamed from disk: the LoRA is fused into the host copies of the blocks "
            "it changes, which then stay in RAM; with less RAM than the model this job may run out of host memory"))
    loaded = load_transformer(model_dir, family, dtype, device, offload=offload, training=False,
                              with_weights=prepare, rss=watch.rss, transformer_dir=tdir,
                              compile=bool(spec.offload.compile))
    watch.sample()
    on_row({"phase": "load", Metric.weight_bytes: loaded.weight_bytes, "load_seconds": round(loaded.load_seconds, 3),
                 "offload_seconds": round(loaded.offload_seconds, 3), "rss_peak_load_bytes": watch.peaks.get("load", 0),
                 "rss_peak_load_ratio": watch.peaks.get("load", 0) / max(1, loaded.weight_bytes),
                 "rss_load_added_ratio": (watch.peaks.get("load", 0) - loaded.memory["rss_before_load"])
                 / max(1, loaded.weight_bytes), **loaded.memory})
    if lora is not None:
        meta, keys = read_lora_header(lora)
        print(f"LoRA {lora} fused at scale {i.lora_scale} ({lora_format(keys)} names, rank "
              f"{meta.get('lora_rank', meta.get('ss_network_dim', '?'))}, for {family.name})", flush=True)
    pipe = rnd.embedding_pipeline(family, loaded.model, vae, scheduler)
    return Ready(pipe, vae, loaded, texts, max_len, engine_keys)


def _infer(spec: JobSpec, run_dir: Path, outputs: Path, metrics: MetricsWriter, device: torch.device, cap: int | None,
           dtype: torch.dtype, model_dir: Path, family: FamilyAdapter, lora: Path | None,
           prompts: list[rnd.PromptSpec], watch: HostMemoryWatch, transformer: Path | None = None,
           parts: dict[str, Path] | None = None) -> dict[str, Any]:
    i = spec.infer
    ready = prepare_model(spec, run_dir, device, cap, dtype, model_dir, family, lora, prompts, watch, metrics.write,
                          transformer, files=parts)
    pipe, vae, loaded, texts, max_len, engine_keys = (ready.pipe, ready.vae, ready.loaded, ready.texts, ready.max_len,
                                                      ready.engine_keys)
    watch.phase("render")
    records, sheet = [], []
    for n, p in enumerate(prompts):
        t1 = time.perf_counter()
        neg = texts.get(p.negative) if family.uses_negative else None
        images = rnd.render(family, pipe, vae, texts[p.prompt], neg, p, device, dtype, cap,
                            before_decode=loaded.release_growth)
        seconds = time.perf_counter() - t1
        if family.is_video:
            files = rnd.save_frames(images, outputs / f"video_{n:03d}", fps=i.fps)
            sheet.append(images[len(images) // 2])
        else:
            files = [outputs / f"image_{n:03d}.png"]
            images[0].save(files[0])
            sheet.append(images[0])
        stats = loaded.stats()
        rec = {**p.as_dict(), "index": n, "files": [str(f) for f in files], "seconds": round(seconds, 3)}
        records.append(rec)
        row = StepMetrics(step=n + 1, total_steps=len(prompts), seconds=seconds, host_rss_bytes=watch.sample(),
                          host_total_bytes=watch.total)
        metrics.write_step(row, stats)  # every stat the screens chart (hit rate, disk GB/s, ...)
        print(f"[{n + 1}/{len(prompts)}] {p.prompt!r} seed {p.seed} -> {(files[0].parent if family.is_video else files[0]).name} ({seconds:.1f}s)", flush=True)
    rnd.contact_sheet(sheet, outputs / "contact_sheet.png")
    params = {"family": family.name, "model": str(model_dir), "dtype": str(dtype).removeprefix("torch."),
              "device": str(device), "lora": str(lora) if lora else None, "lora_scale": i.lora_scale if lora else None,
              "max_sequence_length": max_len, "offload": engine_keys, "vram_cap_bytes": cap,
              "images": records, "host_rss_peak_bytes": watch.peak, Metric.weight_bytes: loaded.weight_bytes}
    rnd.write_params(outputs / "params.json", params)
    metrics.write({"phase": "done", "images": len(records), "host_rss_peak_bytes": watch.peak})
    if loaded.handle is not None:
        loaded.handle.remove()
    emit_event(run_dir, "outputs", files=len(records), contact_sheet=str(outputs / "contact_sheet.png"))
    return params


def home_cache(run_dir: Path) -> Path:
    return run_dir.parent.parent / "cache"
