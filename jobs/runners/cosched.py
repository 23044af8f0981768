"""A co-scheduled batch's leader (issue 32): one model, one stream of weights, every member's images.

The worker claimed these infer jobs together (jobs/worker/cosched.py): same model, LoRA, engine and
pipeline settings. This child, the first job's own, then
1. checks each job's inputs as a job alone would (`check_infer`, its prompts): a job whose inputs are
   wrong fails alone (its waiter exits with the reason), the others go on;
2. encodes every prompt and loads the transformer once (`infer.prepare_model`);
3. renders the jobs' images in passes of up to `images_per_pass` rows, each row with its own seed's
   generator; writes each image, metrics row, log line and event into its own job's run dir, and a
   job's result (its waiter's exit) as soon as its last image is written.

Leaving a batch: a job the worker stops (cancel, timeout) has a stop record in its run dir. Its rows
are left out of every later pass; a pass that is under way finishes and its rows are discarded (the
pipelines keep per-row tensors such as Flux's pooled embeddings outside what a step callback may
change, and under offload a pass costs the copies, not the rows). A pass whose rows all left stops
at the next denoising step.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jobs.batchdir import BATCH_DIR_ENV, BatchDir, BatchMember
from jobs.contract import Metric, Reason, StepMetrics
from jobs.rundir import RunDir
from jobs.runners import render as rnd
from jobs.runners.errors import classify_exception
from jobs.runners.families import FamilyAdapter, get_adapter
from jobs.runners.infer import plan_prompts, prepare_model
from jobs.runners.inputs import Checked, check_infer
from jobs.runners.load import apply_vram_cap, resolve_device, resolve_dtype
from jobs.runners.telemetry import HostMemoryWatch, MetricsWriter, json_safe
from jobs.spec import JobSpec, load_spec

__all__ = ["lead", "images_per_pass", "ACTIVATION_FACTOR"]

# Bytes of activations one image holds at the peak of a transformer block, per (token x model width x
# element size): the residual streams, q/k/v, the attention output and the 4x MLP, with room for
# the allocator. An estimate on the safe side, for the default of infer.max_batch.
ACTIVATION_FACTOR = 24
MAX_DEFAULT_ROWS = 16


def images_per_pass(cap: int | None, held: int, tokens: int, width: int, elem: int) -> int:
    """How many images one pass renders when infer.max_batch is unset: what the VRAM cap leaves after
    the engine's own bytes (`held`, measured after loading) and a 10% margin, over one image's
    activations (`ACTIVATION_FACTOR x tokens x width x elem`). No cap (the CPU): MAX_DEFAULT_ROWS."""
    if not cap:
        return MAX_DEFAULT_ROWS
    per_image = max(1, ACTIVATION_FACTOR * tokens * width * elem)
    return max(1, min(MAX_DEFAULT_ROWS, int((cap * 0.9 - held) // per_image)))


@dataclass(eq=False)  # rows are matched by identity
class _Job:
    member: BatchMember
    spec: JobSpec | None = None
    checked: Checked | None = None
    prompts: list[rnd.PromptSpec] = field(default_factory=list)
    error: tuple[str, str, int] | None = None  # (reason, message, exit code) of a failed setup
    records: list[dict[str, Any]] = field(default_factory=list)
    sheet: list[Any] = field(default_factory=list)
    finished: bool = False

    @property
    def id(self) -> str:
        return self.member.job_id

    @property
    def run_dir(self) -> Path:
        return Path(self.member.run_dir)

    def stopped(self) -> bool:
        return RunDir(self.run_dir).read_stop(self.member.attempt) is not None


class _Lead:
    def __init__(self, bd: BatchDir, leader: str, jobs: list[_Job]) -> None:
        self.bd, self.leader, self.jobs = bd, leader, jobs
        self.ids = [j.id for j in jobs]

    # ------------------------------------------------------------ per job output
    def say(self, job: _Job, line: str) -> None:
        if job.id == self.leader:
            print(line, flush=True)
        else:
            self.bd.log(job.id, line)

    def event(self, job: _Job, type: str, **data: Any) -> None:
        record = {"ts": time.time(), "type": f"runner.{type}", **json_safe(data)}
        with open(job.run_dir / "events.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        self.say(job, f"[offload-jobs] {type}: " + ", ".join(f"{k}={v}" for k, v in data.items()))

    def metrics(self, job: _Job) -> MetricsWriter:
        return MetricsWriter(job.run_dir / "metrics.jsonl")

    def end(self, job: _Job, code: int, reason: str | None = None, message: str | None = None) -> None:
        """Job `job` is done here: its waiter exits with `code` (the leader's own exit comes last)."""
        job.finished = True
        if reason is not None:  # its child prints the one line (`fail`)
            job.error = (reason, message or reason, code)
        if job.id != self.leader:
            self.bd.write_result(job.id, code, reason, message)

    # ------------------------------------------------------------ setup
    def check(self, job: _Job) -> None:
        """The job's own inputs, as it would check them alone; a failure ends that job only."""
        try:
            job.spec = load_spec(job.run_dir / "spec.yaml")
            job.checked = check_infer(job.spec, job.run_dir.parent.parent)
            job.prompts = plan_prompts(job.spec, get_adapter(job.checked.family), job.checked.prompts)
            (job.run_dir / "outputs").mkdir(parents=True, exist_ok=True)
        except Exception as exc:
            known = classify_exception(exc)
            if known is None:
                known = (Reason.SETUP_FAILED, f"{type(exc).__name__}: {exc}", 2)
            self.end(job, known[2], known[0], known[1])


def lead(spec: JobSpec, run_dir: Path) -> None:
    """The leader child's work; exits as its own job's result says (jobs.runners.infer_main)."""
    bd = BatchDir(os.environ[BATCH_DIR_ENV])
    leader, members = bd.read()
    lead_ = _Lead(bd, leader, [_Job(m) for m in members])
    print(f"[offload-jobs] co-scheduled: this child renders the images of {len(members)} jobs in one batch: "
          + ", ".join(lead_.ids), flush=True)
    for job in lead_.jobs:
        if job.stopped():
            job.finished = True  # cancelled before it ran: left out
        else:
            lead_.check(job)
    ok = [j for j in lead_.jobs if not j.finished]
    try:
        if ok:
            _run(lead_, ok)
    except Exception as exc:
        known = classify_exception(exc)
        for job in ok:
            if not job.finished:  # a bug: the members fail as a lost child's would (worker_lost, retried)
                reason, message, code = known or (Reason.WORKER_LOST, f"the batch's child (job {leader}) failed: "
                                                   f"{type(exc).__name__}: {exc}", 1)
                lead_.end(job, code, reason, message)
        if known is None:
            raise
    own = lead_.jobs[0]
    if own.error is not None:
        from jobs.runners._entry import fail

        fail(*own.error)


def _run(lead_: _Lead, ok: list[_Job]) -> None:
    first = ok[0]
    spec, checked = first.spec, first.checked
    assert spec is not None and checked is not None
    device = resolve_device(spec.offload.target_device)
    cap = apply_vram_cap(device)
    dtype = resolve_dtype(spec.model.dtype, device)
    family = get_adapter(checked.family)
    every = [p for j in ok for p in j.prompts]
    watch = HostMemoryWatch(first.run_dir)
    with watch:
        def on_row(row: dict[str, Any]) -> None:
            for j in ok:
                lead_.metrics(j).write(row)

        ready = prepare_model(spec, first.run_dir, device, cap, dtype, checked.model_dir, family, checked.lora, every,
                              watch, on_row, checked.transformer, files=checked.parts)
        held = int(ready.loaded.stats().get(Metric.vram_allocated_bytes) or 0)  # the engine's own bytes
        per_pass = spec.infer.max_batch or images_per_pass(cap, held, _tokens(spec, family, ready.max_len),
                                                           _width(ready.loaded.model), torch.finfo(dtype).bits // 8)
        for j in ok:
            lead_.event(j, "batch", batch_of=lead_.leader, batch_with=lead_.ids, images_per_pass=per_pass)
        watch.phase("render")
        pending = [(j, n, p) for j in ok for n, p in enumerate(j.prompts)]
        while pending:
            pending = [r for r in pending if not r[0].finished and not r[0].stopped()]
            if not pending:
                break
            key = _settings(pending[0][2])
            chunk = [r for r in pending if _settings(r[2]) == key][:per_pass]
            _pass(lead_, ready, family, chunk, device, dtype, cap, watch)
            pending = [r for r in pending if r not in chunk]
        if ready.loaded.handle is not None:
            ready.loaded.handle.remove()


def _settings(p: rnd.PromptSpec) -> tuple[Any, ...]:
    """What one pipeline call must share (a job's inline --w/--steps/... may differ per prompt)."""
    return (p.width, p.height, p.steps, p.guidance, p.negative, p.frames)


def _tokens(spec: JobSpec, family: FamilyAdapter, text_len: int) -> int:
    frames = (spec.infer.num_frames + 3) // 4 if family.is_video else 1  # Wan's VAE: 4x in time
    return spec.infer.width * spec.infer.height // 256 * frames + text_len  # 8x VAE, 2x2 patches


def _width(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    heads, dim = getattr(cfg, "num_attention_heads", None), getattr(cfg, "attention_head_dim", None)
    return int(heads * dim) if heads and dim else 3072


def _pass(lead_: _Lead, ready: Any, family: FamilyAdapter, chunk: list[tuple[_Job, int, rnd.PromptSpec]],
          device: torch.device, dtype: torch.dtype, cap: int | None, watch: HostMemoryWatch) -> None:
    """One pipeline call for `chunk`'s rows; each finished row written into its own job."""
    jobs = list(dict.fromkeys(j for j, _, _ in chunk))
    texts = [ready.texts[p.prompt] for _, _, p in chunk]
    negs = [ready.texts[p.negative] for _, _, p in chunk] if family.uses_negative else None

    def on_step(pipe: Any) -> None:
        if all(j.stopped() for j in jobs):
            pipe._interrupt = True  # every row left the batch: stop at this step

    t0 = time.perf_counter()
    images = rnd.render_batch(family, ready.pipe, ready.vae, texts, negs, chunk[0][2], [p.seed for _, _, p in chunk],
                              device, dtype, cap, on_step=on_step, before_decode=ready.loaded.release_growth)
    seconds = time.perf_counter() - t0
    per_image = seconds / len(chunk)
    stats = ready.loaded.stats()
    for (job, n, p), frames in zip(chunk, images):
        if job.finished or job.stopped():
            continue  # it left the batch during the pass: discarded
        assert job.spec is not None
        outputs = job.run_dir / "outputs"
        if family.is_video:
            files = rnd.save_frames(frames, outputs / f"video_{n:03d}", fps=job.spec.infer.fps)
            job.sheet.append(frames[len(frames) // 2])
        else:
            files = [outputs / f"image_{n:03d}.png"]
            frames[0].save(files[0])
            job.sheet.append(frames[0])
        job.records.append({**p.as_dict(), "index": n, "files": [str(f) for f in files],
                            Metric.seconds: round(per_image, 3), "batch_rows": len(chunk)})
        row = StepMetrics(step=len(job.records), total_steps=len(job.prompts), seconds=seconds, image_seconds=per_image,
                          batch_of=lead_.leader, batch_with=lead_.ids, host_rss_bytes=watch.sample(),
                          host_total_bytes=watch.total)
        lead_.metrics(job).write_step(row, stats)
        shown = files[0].parent if family.is_video else files[0]
        lead_.say(job, f"[{len(job.records)}/{len(job.prompts)}] {p.prompt!r} seed {p.seed} -> {shown.name} "
                       f"({per_image:.2f}s an image; a pass of {len(chunk)} images, {seconds:.1f}s)")
        if len(job.records) == len(job.prompts):
            _finish(lead_, job, ready, family, dtype, device, cap, watch)


def _finish(lead_: _Lead, job: _Job, ready: Any, family: FamilyAdapter, dtype: torch.dtype, device: torch.device,
            cap: int | None, watch: HostMemoryWatch) -> None:
    """A job's last image is written: its contact sheet, params.json, the done row, then its result."""
    assert job.spec is not None and job.checked is not None
    i, outputs = job.spec.infer, job.run_dir / "outputs"
    lora = job.checked.lora
    rnd.contact_sheet(job.sheet, outputs / "contact_sheet.png")
    params = {"family": family.name, "model": str(job.checked.model_dir), "dtype": str(dtype).removeprefix("torch."),
              "device": str(device), "lora": str(lora) if lora else None, "lora_scale": i.lora_scale if lora else None,
              "max_sequence_length": ready.max_len, "offload": ready.engine_keys, "vram_cap_bytes": cap,
              "images": job.records, "host_rss_peak_bytes": watch.peak,
              Metric.weight_bytes: ready.loaded.weight_bytes, Metric.batch_of: lead_.leader,
              Metric.batch_with: lead_.ids}
    rnd.write_params(outputs / "params.json", params)
    per = [r[Metric.seconds] for r in job.records]
    lead_.metrics(job).write({"phase": "done", "images": len(job.records), "host_rss_peak_bytes": watch.peak,
                              Metric.batch_of: lead_.leader, Metric.batch_with: lead_.ids,
                              Metric.image_seconds: sum(per) / max(1, len(per))})
    lead_.event(job, "outputs", files=len(job.records), contact_sheet=str(outputs / "contact_sheet.png"))
    lead_.end(job, 0)
