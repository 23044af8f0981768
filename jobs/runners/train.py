"""The train runner: LoRA on a diffusers transformer, flow matching, the engine streaming its weights.

`TrainRecipe` is the recipe (torchtune's shape), read top to bottom:
1. `inputs.check_train` checked the model folder and the dataset (bad input failed there, the file named)
2. `setup()`: latents and text embeddings through the cache (the text encoders freed); the transformer,
   its LoRA and the engine; the newest complete checkpoint resumed, if any
3. `train_step()`: sample sigma, x_t = (1 - sigma) x0 + sigma noise, predict noise - x0, MSE
4. `log()` every step; `save_checkpoint()`, `sample()` and the controls between steps (`run()`)
5. `finish()`: the LoRA file and the summary
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from jobs.contract import Metric, StepMetrics
from jobs.runners import render as rnd
from jobs.runners.checkpoint import CheckpointStore
from jobs.runners.controls import Controls
from jobs.runners.convert import transformer_folder
from jobs.runners.data import epoch_order, make_buckets, nearest_bucket
from jobs.runners.errors import NonFiniteLoss
from jobs.runners.families import FamilyAdapter, get_adapter
from jobs.runners.inputs import Checked, check_train
from jobs.runners.load import (apply_vram_cap, bytes_text, compile_cache, free_host_memory, host_ram_on_load, load_pipeline_parts,
                               load_transformer, offload_config, resolve_device, resolve_dtype)
from jobs.runners.host_tier import choose_host_tier
from jobs.runners.lora import check_lora_format, export_lora, inject_lora, load_lora_file, load_trainable_state, trainable_state
from jobs.runners.train_parts import StepLoggers, hold_out, make_optimizer, with_trigger
from jobs.runners.precompute import encode_items, encode_texts, make_cache
from jobs.runners.telemetry import HostMemoryWatch, MetricsWriter, emit_event, progress_bar
from jobs.spec import JobSpec

__all__ = ["train", "TrainRecipe", "Progress", "sample_sigmas", "lr_lambda"]

# also to tensorboard/wandb, beside metrics.jsonl
_TO_LOGGERS = (Metric.loss, Metric.lr, Metric.grad_norm, Metric.val_loss, Metric.ema_distance, Metric.it_s,
               Metric.host_rss_bytes)


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
                 budget: int | None, before_decode: Any = None) -> None:
        self.family, self.vae, self.scheduler, self.prompts, self.texts = family, vae, scheduler, prompts, texts
        self.out, self.device, self.dtype, self.budget = out, device, dtype, budget
        self.before_decode = before_decode  # the engine's release_growth: the VAE gets the ring's grown slots
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
                                    self.dtype, self.budget, before_decode=self.before_decode)
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
    recipe = TrainRecipe(spec, run_dir, checked or check_train(spec))
    with recipe.watch:
        try:
            recipe.setup()
            return recipe.run()
        finally:
            gc.unfreeze()  # run() froze the setup's objects for its loop
            recipe.loggers.close()  # what tensorboard/wandb hold is flushed, a failed run's too


@dataclass
class Progress:
    """Where the run is; saved in every checkpoint, so a retry continues from the same place in the data."""

    step: int = 0
    epoch: int = 0
    position: int = 0
    order: list[list[int]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "position": self.position, "order": self.order}


class TrainRecipe:
    """One train job in torchtune's recipe shape: `setup()` once, then `train_step()` per optimizer step,
    with `log()`, `save_checkpoint()` and `sample()` between steps; `run()` is the loop."""

    def __init__(self, spec: JobSpec, run_dir: Path, checked: Checked) -> None:
        t = self.t = spec.train
        self.spec, self.run_dir = spec, run_dir
        self.outputs = Path(os.environ.get("OFFLOAD_JOBS_OUTPUTS") or run_dir / "outputs")
        self.outputs.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsWriter()
        self.device = resolve_device(spec.offload.target_device)
        self.cap = apply_vram_cap(self.device)
        if self.device.type == "cuda":
            # torch issue 196678: cuDNN's SDPA backward gives NaN or illegal memory accesses on H100/H200 in bf16.
            torch.backends.cuda.enable_cudnn_sdp(False)
            emit_event(run_dir, "cudnn_sdp_disabled", message="cuDNN SDPA off for training (torch issue 196678)")
        if self.cap:
            emit_event(run_dir, "vram_cap", bytes=self.cap)
        self.dtype = resolve_dtype(spec.model.dtype, self.device)
        self.family = get_adapter(checked.family)
        self.model_dir = checked.model_dir
        self.transformer_file = checked.transformer
        self.part_files = checked.parts  # model.text_encoders / model.vae
        self.items, self.val_items = hold_out(checked.items, t.validation)
        defaulted = sum(it.caption == t.default_caption for it in checked.items) if t.default_caption is not None else 0
        for it in self.items + self.val_items:
            it.caption = with_trigger(it.caption, t.trigger_word)
        emit_event(run_dir, "dataset", items=len(self.items), held_out=len(self.val_items), default_captions=defaulted,
                   example_caption=self.items[0].caption[:200])
        defaults = rnd.PromptSpec(prompt="", width=t.sample_width or 0, height=t.sample_height or 0, seed=t.seed,
                                  steps=t.sample_steps, guidance=t.sample_guidance if t.sample_guidance is not None
                                  else self.family.default_guidance, frames=t.num_frames)
        dataset = Path(t.dataset or "").expanduser().resolve()
        self.prompts = [rnd.parse_prompt(p, defaults) for p in rnd.read_prompts(t.sample_prompts, dataset)]
        warn = float(os.environ.get("OFFLOAD_JOBS_HOST_MEMORY_WARN", "0.92"))
        self.watch = HostMemoryWatch(run_dir, warn_fraction=warn)
        self.alpha = t.lora_alpha or float(t.lora_rank)
        self.targets = t.lora_target_modules or list(self.family.default_targets)
        self.adapted: list[str] = []
        self.ckpts = CheckpointStore(run_dir / "checkpoints", keep_last=t.keep_last)
        self.progress = Progress()
        self.ema: dict[str, torch.Tensor] | None = None
        self.loggers = StepLoggers(t.log_to, run_dir, spec)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        """Precompute latents and text embeddings, load the transformer with its LoRA on the engine, resume."""
        self._precompute()
        # the checkpoint to resume from is found now: its LoRA goes in before the engine packs the weights
        self.latest = self.ckpts.latest(on_skip=lambda why: emit_event(self.run_dir, "checkpoint_skipped", reason=why))
        self._load_model()
        self._schedule()
        if self.latest is not None:
            self._resume(self.latest)
        if self.t.ema is not None and self.ema is None:
            self.ema = {n: v.float() for n, v in trainable_state(self.model).items()}
        self.samples = (_Samples(self.family, self.vae, self.scheduler, self.prompts, self.texts, self.outputs,
                                 self.device, self.dtype, self.cap, self.loaded.release_growth)
                        if self.vae is not None else None)

    def _precompute(self) -> None:
        t, family, items = self.t, self.family, self.items
        self.watch.phase("precompute")
        t0 = time.perf_counter()
        pipe = load_pipeline_parts(self.model_dir, family, self.dtype, files=self.part_files)
        buckets = make_buckets(t.max_pixels, family.bucket_multiple(pipe.vae))
        for it in items + self.val_items:
            it.bucket = nearest_bucket(it.size, buckets)
        for p in self.prompts:  # unset sample sizes: the first item's bucket
            p.width, p.height = p.width or items[0].bucket[0], p.height or items[0].bucket[1]
        home = self.run_dir.parent.parent
        cache = make_cache(Path(t.cache_dir).expanduser() if t.cache_dir else home / "cache", self.model_dir, family,
                           self.dtype, self.part_files)
        max_len = t.max_sequence_length or family.default_max_sequence_length
        wanted = [it.caption for it in items + self.val_items] + [p.prompt for p in self.prompts]
        if family.uses_negative and self.prompts:
            wanted += [p.negative for p in self.prompts]
        if t.caption_dropout > 0:
            wanted.append("")  # the dropped caption
        self.texts = encode_texts(pipe, family, cache, wanted, max_len, self.device, self.cap)
        self.latents = encode_items(pipe.vae, family, cache, items, t.num_frames, self.device, self.cap)
        self.val_latents = (encode_items(pipe.vae, family, cache, self.val_items, t.num_frames, self.device, self.cap)
                            if self.val_items else [])
        self.cache_counts = cache.counts.as_dict()
        emit_event(self.run_dir, "cache", **self.cache_counts, items=len(items), dir=str(cache.root))
        self.metrics.write({"phase": "precompute", Metric.seconds: round(time.perf_counter() - t0, 3), **self.cache_counts})
        # the VAE stays only for samples (on schedule or on `signal JOB sample`)
        self.vae = pipe.vae if self.prompts else None
        self.scheduler = pipe.scheduler
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            if getattr(pipe, name, None) is not None:
                setattr(pipe, name, None)
        del pipe
        free_host_memory()

    def _prepare_model(self, model: torch.nn.Module) -> None:
        t = self.t
        torch.manual_seed(t.seed)  # the LoRA's initial A matrices
        self.adapted.extend(inject_lora(model, t.lora_rank, self.alpha, self.targets))
        check_lora_format(self.adapted, self.family, t.lora_format)  # now, not when the file is written at the end
        if self.latest is not None:
            from safetensors.torch import load_file

            load_trainable_state(model, load_file(str(self.latest / "trainable.safetensors")))
        elif t.init_lora:
            applied = load_lora_file(model, self.family, Path(t.init_lora).expanduser(), rank=t.lora_rank,
                                     alpha=self.alpha)
            emit_event(self.run_dir, "init_lora", path=str(t.init_lora), **applied)
        if t.gradient_checkpointing:
            model.enable_gradient_checkpointing()

    def _make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return make_optimizer(self.t.optimizer, params, lr=self.t.learning_rate, weight_decay=self.t.weight_decay)

    def _load_model(self) -> None:
        self.watch.phase("load")
        tdir = transformer_folder(self.model_dir, self.transformer_file, self.run_dir)
        if self.spec.offload.compile:
            compile_cache(self.run_dir)
        self.engine_config = choose_host_tier(self.spec, offload_config(self.spec, self.device, training=True),
                                              self.model_dir, self.dtype, self.run_dir, held_bytes=self.watch.rss(),
                                              transformer_dir=tdir)
        loaded = self.loaded = load_transformer(
            self.model_dir, self.family, self.dtype, self.device, offload=self.engine_config, training=True,
            prepare=self._prepare_model, make_optimizer=self._make_optimizer, rss=self.watch.rss, transformer_dir=tdir,
            compile=bool(self.spec.offload.compile))
        self.model, self.optimizer = loaded.model, loaded.optimizer
        self.lora_params = [p for p in self.model.parameters() if p.requires_grad]
        self.watch.sample()
        peak = self.watch.peaks.get("load", 0)
        record = {"phase": "load", Metric.weight_bytes: loaded.weight_bytes, "load_seconds": round(loaded.load_seconds, 3),
                  "offload_seconds": round(loaded.offload_seconds, 3), "rss_peak_load_bytes": peak,
                  "rss_peak_load_ratio": peak / max(1, loaded.weight_bytes),
                  # what loading added on top of the process as it was (torch, the cache's tensors)
                  "rss_load_added_ratio": (peak - loaded.memory["rss_before_load"]) / max(1, loaded.weight_bytes),
                  "vram_budget_bytes": loaded.vram_budget, "optimizer": self.t.optimizer, "lora_modules": len(self.adapted),
                  "lora_parameters": sum(p.numel() for p in self.lora_params), **loaded.memory}
        self.metrics.write(record)
        t = self.t
        print(f"{self.family.name} transformer: {bytes_text(loaded.weight_bytes)} of weights, {len(self.adapted)} "
              f"LoRA modules (rank {t.lora_rank}, alpha {self.alpha:g}), "
              f"engine {'on ' + str(self.device) if self.engine_config is not None else 'off'}; "
              + host_ram_on_load(peak, loaded.memory["rss_before_load"], loaded.weight_bytes), flush=True)

    def _schedule(self) -> None:
        t = self.t
        per_epoch = len(epoch_order(self.items, t.repeats, t.batch_size, t.seed, 0))
        steps_per_epoch = max(1, per_epoch // t.gradient_accumulation_steps)
        self.total = t.num_epochs * steps_per_epoch if t.num_epochs is not None else t.steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(t.lr_scheduler, t.lr_warmup_steps, self.total))
        self.gen = torch.Generator("cpu").manual_seed(t.seed)
        self.progress.order = epoch_order(self.items, t.repeats, t.batch_size, t.seed, 0)

    def _resume(self, latest: Path) -> None:
        """The optimizer, the LR schedule, the generator and the place in the data (the LoRA went in at load)."""
        opt_state = torch.load(latest / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(opt_state["optimizer"])
        self.lr_schedule.load_state_dict(opt_state["lr_scheduler"])
        saved = torch.load(latest / "state.pt", weights_only=True)
        self.gen.set_state(saved["generator"])
        self.progress = Progress(**{k: saved[k] for k in ("step", "epoch", "position", "order")})
        if self.t.ema is not None and (latest / "ema.safetensors").is_file():
            from safetensors.torch import load_file

            self.ema = load_file(str(latest / "ema.safetensors"))
        emit_event(self.run_dir, "resumed", step=self.progress.step, checkpoint=str(latest))

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        """Step until the total (or a stop), then write the LoRA file."""
        # What exists now lives as long as the loop does: frozen out of the cycle collector's sight, a
        # full collection scans only what the steps allocate (in the bench's Flux-dev dims LoRA process
        # on the H200, 633k tracked objects made each full collection take 0.3-0.5 s, about one step in
        # ten; after gc.freeze() 5 ms). train() unfreezes them when this returns or raises.
        gc.collect()
        gc.freeze()
        emit_event(self.run_dir, "gc_frozen", objects=gc.get_freeze_count())
        self.watch.phase("train")
        controls = Controls(self.run_dir)
        controls.install_sigterm()
        self.model.train()
        self.bar = progress_bar(self.total, initial=self.progress.step)
        self.last_save = time.monotonic()
        self.t_start, self.start_step = time.monotonic(), self.progress.step
        stopped = False
        while self.progress.step < self.total and not stopped:
            t_step = time.perf_counter()
            values = self.train_step()
            values[Metric.step_seconds] = time.perf_counter() - t_step
            if self.ema is not None:
                values[Metric.ema_distance] = self._update_ema()
            if self._validation_due():
                values[Metric.val_loss] = self.validate()
            self.log(values)
            stopped = self._between_steps(controls.poll())
        self.bar.close()
        return self.finish(stopped)

    def _next_batch(self) -> list[int]:
        pr, t = self.progress, self.t
        if pr.position >= len(pr.order):
            pr.epoch += 1
            pr.position = 0
            pr.order = epoch_order(self.items, t.repeats, t.batch_size, t.seed, pr.epoch)
        batch = pr.order[pr.position]
        pr.position += 1
        return batch

    def _loss(self, batch: list[int]) -> torch.Tensor:
        t, device, dtype = self.t, self.device, self.dtype
        x0 = torch.stack([self.latents[i] for i in batch]).to(device, dtype)
        captions = [self.items[i].caption for i in batch]
        if t.caption_dropout > 0:  # drawn only when on, so the noise stream is the same as before otherwise
            dropped = (torch.rand(len(batch), generator=self.gen) < t.caption_dropout).tolist()
            captions = ["" if drop else c for c, drop in zip(captions, dropped)]
            self.captions_dropped += sum(dropped)
        text = self.family.collate_text([self.texts[c] for c in captions], device, dtype)
        noise = torch.randn(x0.shape, generator=self.gen).to(device, dtype)
        sigmas = sample_sigmas(len(batch), t.timestep_sampling, t.discrete_flow_shift, self.gen)
        return self._flow_loss(x0, text, noise, sigmas)

    def _flow_loss(self, x0: torch.Tensor, text: Any, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """Flow matching: x_t = (1 - sigma) x0 + sigma noise; the model predicts noise - x0."""
        family, device, dtype = self.family, self.device, self.dtype
        s = sigmas.view(-1, *([1] * (x0.dim() - 1))).to(device, dtype)
        noisy = (1 - s) * x0 + s * noise
        out = self.model(**family.model_inputs(self.model, noisy, sigmas.to(device), text, self.t.guidance_scale))[0]
        return F.mse_loss(family.prediction(out, x0).float(), (noise - x0).float())

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over gradient_accumulation_steps micro-batches: the mean loss and the grad norm."""
        t = self.t
        k = t.gradient_accumulation_steps
        self.captions_dropped = 0
        batches = [self._next_batch() for _ in range(k)]

        def loss_fn(batch: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            loss = self._loss(batch)
            return loss / k, loss.detach()

        if self.loaded.handle is not None:
            # the engine runs the micro-batches in train.accumulation_order (layer: each block once for all k)
            losses = [raw for _, raw in self.loaded.handle.accumulate(batches, loss_fn)]
        else:
            losses = []
            for batch in batches:
                scaled, raw = loss_fn(batch)
                scaled.backward()
                losses.append(raw)
        # One host sync per optimizer step, after the backward is queued (a read of the loss between the
        # forward and the backward would leave the GPU idle while the backward's first kernels are issued).
        # A non-finite loss still stops the step before the optimizer touches the weights.
        loss_value = 0.0
        for value in torch.stack(losses).tolist():
            if not math.isfinite(value):
                raise NonFiniteLoss(self.progress.step + 1, value)
            loss_value += value / k
        if self.loaded.handle is not None:
            self.loaded.handle.after_backward()
        grad_norm = None
        if t.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.lora_params, t.max_grad_norm))
        self.optimizer.step()
        self.lr_schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        values = {Metric.loss: loss_value, Metric.grad_norm: grad_norm}
        if t.caption_dropout > 0:
            values[Metric.captions_dropped] = self.captions_dropped
        return values

    def _update_ema(self) -> float:
        """ema = decay * ema + (1 - decay) * lora, in fp32 on the CPU; returns their L2 distance."""
        assert self.ema is not None
        decay, squares = float(self.t.ema), 0.0
        for name, value in trainable_state(self.model).items():
            avg = self.ema[name]
            avg.mul_(decay).add_(value.float(), alpha=1 - decay)
            squares += float((avg - value.float()).pow(2).sum())
        return math.sqrt(squares)

    def _validation_due(self) -> bool:
        v, step = self.t.validation, self.progress.step
        return v is not None and (step % v.every == 0 or step >= self.total)

    def validate(self) -> float:
        """Mean loss over the held-out items at the fixed sigmas, with the same noise every time."""
        v, device, dtype = self.t.validation, self.device, self.dtype
        assert v is not None
        gen = torch.Generator("cpu").manual_seed(v.seed)
        losses = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for it, latent in zip(self.val_items, self.val_latents):
                    x0 = latent.unsqueeze(0).to(device, dtype)
                    text = self.family.collate_text([self.texts[it.caption]], device, dtype)
                    for sigma in v.timesteps:
                        noise = torch.randn(x0.shape, generator=gen).to(device, dtype)
                        losses.append(float(self._flow_loss(x0, text, noise, torch.tensor([sigma]))))
        finally:
            self.model.train(was_training)
        return sum(losses) / len(losses)

    def log(self, values: dict[str, Any]) -> None:
        """The step's line in metrics.jsonl (with the engine's stats), the extra loggers and the progress bar."""
        step, total = self.progress.step, self.total
        elapsed = time.monotonic() - self.t_start
        rate = (step - self.start_step) / elapsed if elapsed > 0 else 0.0
        record = StepMetrics(step=step, total_steps=total, loss=values[Metric.loss], lr=self.lr_schedule.get_last_lr()[0],
                             grad_norm=values[Metric.grad_norm], epoch=self.progress.epoch, it_s=rate,
                             step_seconds=values[Metric.step_seconds],
                             eta_seconds=(total - step) / rate if rate > 0 else None,
                             host_rss_bytes=self.watch.sample(), host_total_bytes=self.watch.total)
        record.update({k: values[k] for k in (Metric.ema_distance, Metric.val_loss, Metric.captions_dropped)  # type: ignore[misc]
                       if k in values})
        self.metrics.write_step(record, self.loaded.stats())
        self.loggers.write(step, {k: record[k] for k in _TO_LOGGERS if record.get(k) is not None})
        self.bar.set_postfix(loss=f"{values[Metric.loss]:.4f}", refresh=False)
        self.bar.update(1)

    def _between_steps(self, actions: set[str]) -> bool:
        """Checkpoints, samples and controls after a step; True when the job was asked to stop."""
        t, step = self.t, self.progress.step
        due_save = (t.save_every and step % t.save_every == 0) or "save" in actions or (
            t.save_every_minutes and time.monotonic() - self.last_save >= 60 * t.save_every_minutes)
        stopped = "stop" in actions
        if step >= self.total or stopped or due_save:
            self.save_checkpoint()
            self.last_save = time.monotonic()
        if self.samples is not None and ((t.sample_every and step % t.sample_every == 0) or "sample" in actions):
            self.sample()
        elif "sample" in actions:
            emit_event(self.run_dir, "samples", step=step, paths=[], message="no sample_prompts (or sample_every) set")
        if stopped:
            emit_event(self.run_dir, "stopped", step=step, message="stopped on request after a checkpoint")
        return stopped

    def save_checkpoint(self) -> Path:
        """An atomic checkpoint: the LoRA, the optimizer and LR schedule, the generator and the place in the data."""
        from safetensors.torch import save_file

        lora = trainable_state(self.model)
        state = {"generator": self.gen.get_state(), **self.progress.as_dict()}
        files = {
            "trainable.safetensors": lambda p: save_file(lora, str(p)),
            "optimizer.pt": lambda p: torch.save({"optimizer": self.optimizer.state_dict(),
                                                  "lr_scheduler": self.lr_schedule.state_dict()}, p),
            "state.pt": lambda p: torch.save(state, p),
        }
        if self.ema is not None:
            ema = {n: v.contiguous() for n, v in self.ema.items()}
            files["ema.safetensors"] = lambda p: save_file(ema, str(p))
        path = self.ckpts.save(self.progress.step, files)
        emit_event(self.run_dir, "checkpoint", step=self.progress.step, path=str(path))
        return path

    def sample(self) -> list[str]:
        """Render the sample prompts with the transformer being trained."""
        assert self.samples is not None
        paths = self.samples.render(self.model, self.progress.step)
        emit_event(self.run_dir, "samples", step=self.progress.step, paths=paths)
        return paths

    def finish(self, stopped: bool) -> dict[str, Any]:
        """The LoRA file and the summary."""
        t, step = self.t, self.progress.step
        lora_path = self.outputs / f"{t.output_name}.safetensors"
        metadata = {"offload_jobs.base_model": str(self.model_dir), "offload_jobs.step": step,
                    "offload_jobs.targets": ",".join(self.targets)}
        export_lora(self.model, self.family, lora_path, rank=t.lora_rank, alpha=self.alpha, metadata=metadata,
                    fmt=t.lora_format)
        ema_path = None
        if self.ema is not None:  # beside the raw one
            ema_path = self.outputs / f"{t.output_name}_ema.safetensors"
            export_lora(self.model, self.family, ema_path, rank=t.lora_rank, alpha=self.alpha,
                        metadata={**metadata, "offload_jobs.ema_decay": t.ema}, state=self.ema, fmt=t.lora_format)
        watch = self.watch
        summary = {"done": True, "lora": str(lora_path), "family": self.family.name, "step": step,
                   "stopped_early": stopped, "checkpoints": self.ckpts.complete(),
                   "samples": self.samples.last if self.samples else [], "host_rss_peak_bytes": watch.peak,
                   "host_rss_peaks": watch.peaks, Metric.weight_bytes: self.loaded.weight_bytes, "cache": self.cache_counts,
                   "lora_ema": str(ema_path) if ema_path else None}
        rnd.write_params(self.outputs / "train_summary.json", summary)
        self.metrics.write({"phase": "done", "step": step, "lora": str(lora_path), "host_rss_peak_bytes": watch.peak})
        print(f"LoRA written to {lora_path} ({step} steps)", flush=True)
        if self.loaded.handle is not None:
            self.loaded.handle.remove()
        return summary
