"""The train runner: LoRA on a diffusers transformer, flow matching, the engine streaming its weights.

Read top to bottom, `train()` is the recipe:
1. check the model folder and the dataset (bad input fails here, with the file named)
2. precompute latents and text embeddings through the cache; free the text encoders
3. load the transformer, add the LoRA, put it on the engine
4. resume from the newest complete checkpoint, if any
5. step: sample sigma, x_t = (1 - sigma) x0 + sigma noise, predict noise - x0, MSE; metrics every step
6. checkpoints, samples and controls between steps; the LoRA file at the end
"""

from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from jobs.runners import render as rnd
from jobs.runners.checkpoint import CheckpointStore
from jobs.runners.controls import Controls
from jobs.runners.data import epoch_order, make_buckets, nearest_bucket
from jobs.runners.errors import NonFiniteLoss
from jobs.runners.families import FamilyAdapter, get_adapter
from jobs.runners.inputs import Checked, check_train
from jobs.runners.load import (apply_vram_cap, free_host_memory, load_pipeline_parts, load_transformer,
                               offload_config, resolve_device, resolve_dtype)
from jobs.runners.folders import LoraError
from jobs.runners.lora import export_lora, inject_lora, load_trainable_state, trainable_state
from jobs.runners.precompute import encode_items, encode_texts, make_cache
from jobs.runners.telemetry import HostMemoryWatch, MetricsWriter, emit_event, progress_bar
from jobs.spec import JobSpec

__all__ = ["train", "sample_sigmas", "lr_lambda"]

_ENGINE_STATS = ("vram_allocated_bytes", "vram_reserved_bytes", "vram_peak_bytes", "pinned_capacity_bytes",
                 "pinned_used_bytes", "cache_hits", "cache_misses", "cache_evictions", "h2d_bytes", "h2d_gbps",
                 "stall_ms", "prefetch_misses", "weight_bytes", "streamed_bytes", "resident_bytes",
                 "measured_step_ms", "predicted_step_ms")


def sample_sigmas(n: int, how: str, shift: float, gen: torch.Generator) -> torch.Tensor:
    """Flow-matching noise levels in (0, 1), drawn from the job's own generator (float32, CPU)."""
    if how == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=gen))
    u = torch.rand(n, generator=gen)
    if how == "shift":  # more steps at high noise, as SD3/Flux/Wan training does
        return shift * u / (1 + (shift - 1) * u)
    return u


def lr_lambda(kind: str, warmup: int, total: int):
    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 1.0 - progress if kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))

    return f


class _Samples:
    """Renders the sample prompts with the transformer being trained (no second copy of the model)."""

    def __init__(self, family: FamilyAdapter, vae: Any, scheduler: Any, prompts: list[rnd.PromptSpec],
                 texts: dict[str, dict[str, torch.Tensor]], out: Path, device: torch.device, dtype: torch.dtype,
                 budget: int | None) -> None:
        self.family, self.vae, self.scheduler, self.prompts, self.texts = family, vae, scheduler, prompts, texts
        self.out, self.device, self.dtype, self.budget = out, device, dtype, budget
        self.last: list[str] = []

    def render(self, transformer: torch.nn.Module, step: int) -> list[str]:
        pipe = rnd.embedding_pipeline(self.family, transformer, self.vae, self.scheduler)
        folder = self.out / "samples"
        folder.mkdir(parents=True, exist_ok=True)
        written, sheet = [], []
        was_training = transformer.training
        transformer.eval()
        try:
            for n, p in enumerate(self.prompts):
                neg = self.texts.get(p.negative) if self.family.uses_negative else None
                images = rnd.render(self.family, pipe, self.vae, self.texts[p.prompt], neg, p, self.device,
                                    self.dtype, self.budget)
                if self.family.is_video:
                    paths = rnd.save_frames(images, folder / f"step{step:06d}_{n:02d}", fps=16)
                    written.append(str(next(q for q in paths if q.suffix == ".gif")))
                    sheet.append(images[0])
                else:
                    path = folder / f"step{step:06d}_{n:02d}.png"
                    images[0].save(path)
                    written.append(str(path))
                    sheet.append(images[0])
        finally:
            transformer.train(was_training)
        rnd.contact_sheet(sheet, folder / f"step{step:06d}_sheet.png")
        self.last = written
        return written


def train(spec: JobSpec, run_dir: Path, checked: Checked | None = None) -> dict[str, Any]:
    """Run the job; `checked` is what `inputs.check_train(spec)` returned (checked again if not given)."""
    t = spec.train
    checked = checked or check_train(spec)
    outputs = Path(os.environ.get("OFFLOAD_JOBS_OUTPUTS") or run_dir / "outputs")
    outputs.mkdir(parents=True, exist_ok=True)
    metrics = MetricsWriter()
    device = resolve_device(spec.offload.target_device)
    cap = apply_vram_cap(device)
    if device.type == "cuda":
        # torch issue 196678: cuDNN's SDPA backward gives NaN or illegal memory accesses on H100/H200 in bf16.
        torch.backends.cuda.enable_cudnn_sdp(False)
        emit_event(run_dir, "cudnn_sdp_disabled", message="cuDNN SDPA off for training (torch issue 196678)")
    if cap:
        emit_event(run_dir, "vram_cap", bytes=cap)
    dtype = resolve_dtype(spec.model.dtype, device)
    family = get_adapter(checked.family)
    prompt_defaults = rnd.PromptSpec(prompt="", width=t.sample_width or 0, height=t.sample_height or 0, seed=t.seed,
                                     steps=t.sample_steps, guidance=t.sample_guidance if t.sample_guidance is not None
                                     else family.default_guidance, frames=t.num_frames)
    dataset = Path(t.dataset or "").expanduser().resolve()
    prompts = [rnd.parse_prompt(p, prompt_defaults) for p in rnd.read_prompts(t.sample_prompts, dataset)]
    watch = HostMemoryWatch(run_dir, warn_fraction=float(os.environ.get("OFFLOAD_JOBS_HOST_MEMORY_WARN", "0.92")))
    with watch:
        try:
            return _train(spec, run_dir, outputs, metrics, device, cap, dtype, checked.model_dir, family, checked.items,
                          prompts, watch)
        finally:
            gc.unfreeze()  # _train froze the setup's objects for its loop


def _train(spec: JobSpec, run_dir: Path, outputs: Path, metrics: MetricsWriter, device: torch.device,
           cap: int | None, dtype: torch.dtype, model_dir: Path, family: FamilyAdapter, items: list, prompts: list,
           watch: HostMemoryWatch) -> dict[str, Any]:
    t = spec.train
    # 2. precompute
    watch.phase("precompute")
    t0 = time.perf_counter()
    pipe = load_pipeline_parts(model_dir, family, dtype)
    vae, scheduler = pipe.vae, pipe.scheduler
    buckets = make_buckets(t.max_pixels, family.bucket_multiple(vae))
    for it in items:
        it.bucket = nearest_bucket(it.size, buckets)
    for p in prompts:  # unset sample sizes: the first item's bucket
        p.width, p.height = p.width or items[0].bucket[0], p.height or items[0].bucket[1]
    home = run_dir.parent.parent
    cache = make_cache(Path(t.cache_dir).expanduser() if t.cache_dir else home / "cache", model_dir, family, dtype)
    max_len = t.max_sequence_length or family.default_max_sequence_length
    texts_wanted = [it.caption for it in items] + [p.prompt for p in prompts]
    if family.uses_negative and prompts:
        texts_wanted += [p.negative for p in prompts]
    texts = encode_texts(pipe, family, cache, texts_wanted, max_len, device, cap)
    latents = encode_items(vae, family, cache, items, t.num_frames, device, cap)
    counts = cache.counts.as_dict()
    emit_event(run_dir, "cache", **counts, items=len(items), dir=str(cache.root))
    metrics.write({"phase": "precompute", "seconds": round(time.perf_counter() - t0, 3), **counts})
    for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, None)
    keep_vae = bool(prompts)  # samples on schedule or on `signal JOB sample`
    del pipe
    if not keep_vae:
        vae = None
    free_host_memory()

    # 3. the transformer, its LoRA and the engine
    watch.phase("load")
    alpha = t.lora_alpha or float(t.lora_rank)
    targets = t.lora_target_modules or list(family.default_targets)
    adapted: list[str] = []
    # 4. (found now) the checkpoint to resume from: its LoRA goes in before the engine packs the weights
    ckpts = CheckpointStore(run_dir / "checkpoints", keep_last=t.keep_last)
    latest = ckpts.latest(on_skip=lambda why: emit_event(run_dir, "checkpoint_skipped", reason=why))

    def prepare(model: torch.nn.Module) -> None:
        torch.manual_seed(t.seed)  # the LoRA's initial A matrices
        adapted.extend(inject_lora(model, t.lora_rank, alpha, targets))
        unnamed = [m for m in adapted if family.lora_key(m) is None]
        if unnamed:  # found now, not when the LoRA file is written after the last step
            raise LoraError(f"train.lora_target_modules: {unnamed[0]} has no {family.name} name outside diffusers "
                            f"({len(unnamed)} such modules); target attention/MLP projections")
        if latest is not None:
            from safetensors.torch import load_file

            load_trainable_state(model, load_file(str(latest / "trainable.safetensors")))
        if t.gradient_checkpointing:
            model.enable_gradient_checkpointing()

    def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)

    engine_config = offload_config(spec, device, training=True)
    loaded = load_transformer(model_dir, family, dtype, device, offload=engine_config, training=True, prepare=prepare,
                              make_optimizer=make_optimizer, rss=watch.rss)
    model, optimizer = loaded.model, loaded.optimizer
    lora_params = [p for p in model.parameters() if p.requires_grad]
    watch.sample()
    load_record = {"phase": "load", "weight_bytes": loaded.weight_bytes, "load_seconds": round(loaded.load_seconds, 3),
                   "offload_seconds": round(loaded.offload_seconds, 3), "rss_peak_load_bytes": watch.peaks.get("load", 0),
                   "rss_peak_load_ratio": watch.peaks.get("load", 0) / max(1, loaded.weight_bytes),
                   # what loading added on top of the process as it was (torch, the cache's tensors)
                   "rss_load_added_ratio": (watch.peaks.get("load", 0) - loaded.memory["rss_before_load"])
                   / max(1, loaded.weight_bytes),
                   "vram_budget_bytes": loaded.vram_budget, "lora_modules": len(adapted), "lora_parameters": sum(p.numel() for p in lora_params),
                   **loaded.memory}
    metrics.write(load_record)
    print(f"{family.name} transformer: {loaded.weight_bytes / 1e9:.2f} GB of weights, {len(adapted)} LoRA modules "
          f"(rank {t.lora_rank}, alpha {alpha:g}), engine {'on ' + str(device) if engine_config is not None else 'off'}; "
          f"host RSS while loading peaked at {load_record['rss_peak_load_bytes'] / 1e9:.2f} GB "
          f"({load_record['rss_peak_load_ratio']:.2f}x the weight bytes; loading added "
          f"{load_record['rss_load_added_ratio']:.2f}x)", flush=True)

    per_epoch = len(epoch_order(items, t.repeats, t.batch_size, t.seed, 0))
    steps_per_epoch = max(1, per_epoch // t.gradient_accumulation_steps)
    total = t.num_epochs * steps_per_epoch if t.num_epochs is not None else t.steps
    scheduler_lr = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.lr_scheduler, t.lr_warmup_steps, total))
    gen = torch.Generator("cpu").manual_seed(t.seed)
    state: dict[str, Any] = {"step": 0, "epoch": 0, "position": 0, "order": epoch_order(items, t.repeats, t.batch_size,
                                                                                        t.seed, 0)}

    # 4. resume: the optimizer, the LR schedule, the generator and the place in the data
    if latest is not None:
        opt_state = torch.load(latest / "optimizer.pt", weights_only=True)
        optimizer.load_state_dict(opt_state["optimizer"])
        scheduler_lr.load_state_dict(opt_state["lr_scheduler"])
        saved = torch.load(latest / "state.pt", weights_only=True)
        gen.set_state(saved["generator"])
        state.update({k: saved[k] for k in ("step", "epoch", "position", "order")})
        emit_event(run_dir, "resumed", step=state["step"], checkpoint=str(latest))

    samples = _Samples(family, vae, scheduler, prompts, texts, outputs, device, dtype, cap) if keep_vae else None

    def save_checkpoint() -> Path:
        from safetensors.torch import save_file

        lora = trainable_state(model)
        path = ckpts.save(state["step"], {
            "trainable.safetensors": lambda p: save_file(lora, str(p)),
            "optimizer.pt": lambda p: torch.save({"optimizer": optimizer.state_dict(),
                                                  "lr_scheduler": scheduler_lr.state_dict()}, p),
            "state.pt": lambda p: torch.save({"generator": gen.get_state(), "step": state["step"],
                                              "epoch": state["epoch"], "position": state["position"],
                                              "order": state["order"]}, p),
        })
        emit_event(run_dir, "checkpoint", step=state["step"], path=str(path))
        return path

    def next_batch() -> list[int]:
        if state["position"] >= len(state["order"]):
            state["epoch"] += 1
            state["position"] = 0
            state["order"] = epoch_order(items, t.repeats, t.batch_size, t.seed, state["epoch"])
        batch = state["order"][state["position"]]
        state["position"] += 1
        return batch

    # 5. the loop. What exists now lives as long as the loop does: frozen out of the cycle
    # collector's sight, a full collection scans only what the steps allocate (in the bench's
    # Flux-dev dims LoRA process on the H200, 633k tracked objects made each full collection take
    # 0.3-0.5 s, about one step in ten; after gc.freeze() 5 ms). train() unfreezes them when this
    # returns or raises.
    gc.collect()
    gc.freeze()
    emit_event(run_dir, "gc_frozen", objects=gc.get_freeze_count())
    watch.phase("train")
    controls = Controls(run_dir)
    controls.install_sigterm()
    model.train()
    bar = progress_bar(total, initial=state["step"])
    last_save = time.monotonic()
    t_start, start_step = time.monotonic(), state["step"]
    stopped = False
    while state["step"] < total:
        t_step = time.perf_counter()
        loss_value = 0.0
        for _ in range(t.gradient_accumulation_steps):
            batch = next_batch()
            x0 = torch.stack([latents[i] for i in batch]).to(device, dtype)
            text = family.collate_text([texts[items[i].caption] for i in batch], device, dtype)
            noise = torch.randn(x0.shape, generator=gen).to(device, dtype)
            sigmas = sample_sigmas(len(batch), t.timestep_sampling, t.discrete_flow_shift, gen)
            s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(device, dtype)
            noisy = (1 - s) * x0 + s * noise
            out = model(**family.model_inputs(model, noisy, sigmas.to(device), text, t.guidance_scale))[0]
            loss = F.mse_loss(family.prediction(out, x0).float(), (noise - x0).float())
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteLoss(state["step"] + 1, value)
            (loss / t.gradient_accumulation_steps).backward()
            loss_value += value / t.gradient_accumulation_steps
        if loaded.handle is not None:
            loaded.handle.after_backward()
        grad_norm = None
        if t.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(lora_params, t.max_grad_norm))
        optimizer.step()
        scheduler_lr.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        step = state["step"]

        elapsed = time.monotonic() - t_start
        rate = (step - start_step) / elapsed if elapsed > 0 else 0.0
        record = {"step": step, "total_steps": total, "loss": loss_value, "lr": scheduler_lr.get_last_lr()[0],
                  "grad_norm": grad_norm, "epoch": state["epoch"], "it_s": rate,
                  "step_seconds": time.perf_counter() - t_step,
                  "eta_seconds": (total - step) / rate if rate > 0 else None, "host_rss_bytes": watch.sample()}
        stats = loaded.stats()
        record.update({k: stats[k] for k in _ENGINE_STATS if k in stats})
        metrics.write(record)
        bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
        bar.update(1)

        actions = controls.poll()
        due_save = (t.save_every and step % t.save_every == 0) or "save" in actions or (
            t.save_every_minutes and time.monotonic() - last_save >= 60 * t.save_every_minutes)
        if "stop" in actions:
            stopped = True
        if step >= total or stopped or due_save:
            save_checkpoint()
            last_save = time.monotonic()
        if samples is not None and ((t.sample_every and step % t.sample_every == 0) or "sample" in actions):
            paths = samples.render(model, step)
            emit_event(run_dir, "samples", step=step, paths=paths)
        elif "sample" in actions:
            emit_event(run_dir, "samples", step=step, paths=[], message="no sample_prompts (or sample_every) set")
        if stopped:
            emit_event(run_dir, "stopped", step=step, message="stopped on request after a checkpoint")
            break
    bar.close()

    # 6. the LoRA file
    lora_path = outputs / f"{t.output_name}.safetensors"
    export_lora(model, family, lora_path, rank=t.lora_rank, alpha=alpha,
                metadata={"offload_jobs.base_model": str(model_dir), "offload_jobs.step": state["step"],
                          "offload_jobs.targets": ",".join(targets)})
    summary = {"done": True, "lora": str(lora_path), "family": family.name, "step": state["step"],
               "stopped_early": stopped, "checkpoints": ckpts.complete(), "samples": samples.last if samples else [],
               "host_rss_peak_bytes": watch.peak, "host_rss_peaks": watch.peaks, "weight_bytes": loaded.weight_bytes,
               "cache": counts}
    rnd.write_params(outputs / "train_summary.json", summary)
    metrics.write({"phase": "done", "step": state["step"], "lora": str(lora_path), "host_rss_peak_bytes": watch.peak})
    print(f"LoRA written to {lora_path} ({state['step']} steps)", flush=True)
    if loaded.handle is not None:
        loaded.handle.remove()
    return summary
