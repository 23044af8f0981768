"""POST /v1/jobs and /v1/validate: a spec read strictly, checked against what can run it, and stored."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from jobs import strict_json
from jobs.errors import RequestTooLarge, SpecError
from jobs.preflight import preflight
from jobs.redact import redact_job, redact_spec
from jobs.spec import JobSpec, parse_spec
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json
from jobs.worker.routes.common import parse_body as _parse_body

__all__ = ["router"]


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, sched, home, metrics, max_spec_bytes = ctx.store, ctx.sched, ctx.home, ctx.metrics, ctx.max_spec_bytes

    def _has_image(image: str) -> bool:
        return sched._executor("docker").has_image(image)  # type: ignore[attr-defined]

    def _check_fits(spec: JobSpec) -> None:
        check_fits(ctx, spec)

    async def _read_spec(request: Request) -> tuple[JobSpec, dict[str, Any]]:
        body = _parse_body(await request.body())
        raw = body.get("spec") if isinstance(body, dict) else None
        if not isinstance(raw, dict):
            raise SpecError(None, "request body must be {\"spec\": {...}}")
        spec = parse_spec(raw)
        await asyncio.to_thread(_check_fits, spec)
        data = spec.model_dump(mode="json", exclude_unset=True)
        if len(strict_json.dumps(data)) > max_spec_bytes:
            raise RequestTooLarge(f"the spec is over {max_spec_bytes} bytes, the worker's limit")
        await asyncio.to_thread(preflight, spec, has_image=_has_image)
        return spec, data

    @router.post("/v1/jobs")
    async def submit(request: Request) -> Response:
        spec, data = await _read_spec(request)

        from jobs.worker.intake import KEY_HEADER, submit_job  # idempotency key, store file, whole run dirs

        job, created = await asyncio.to_thread(submit_job, store, home, spec, data, request.headers.get(KEY_HEADER))
        if not created:
            return _json(redact_job(job), 200)
        sched.wake()
        metrics.submitted.labels(spec.kind).inc()
        return _json(redact_job(job), 201)

    @router.post("/v1/validate")
    async def validate(request: Request) -> Response:
        spec, data = await _read_spec(request)
        return _json({"ok": True, "kind": spec.kind, "name": spec.name, "spec": redact_spec(data)})

    return router


def check_fits(ctx: WorkerContext, spec: JobSpec) -> None:
    """Refuse at submit a job that no worker could ever claim (a typo'd GPU count, say)."""
    store, sched, executors, gpus = ctx.store, ctx.sched, ctx.executors, ctx.gpus
    slurm_job = spec.executor == "slurm"
    if not store.shared:
        if slurm_job and "slurm" not in executors:
            raise SpecError("executor", "this worker cannot run executor: slurm (Slurm's sbatch, squeue, "
                                        "scancel and scontrol are not on its PATH)")
        if not slurm_job and not gpus and spec.kind in ("train", "infer"):
            # no silent CPU run: the scheduler keeps one "GPU" slot on a CPU-only worker, for defaults
            why = "this worker has no GPU (its jobs run on the CPU); set resources.gpus: 0 and " \
                  "offload.target_device: cpu, or submit to a worker with a GPU"
            if spec.resources.gpus:
                raise SpecError("resources.gpus", f"asks for {spec.resources.gpus} GPU(s), but {why}")
            if str(spec.offload.target_device or "").startswith("cuda"):
                raise SpecError("offload.target_device", f"is {spec.offload.target_device}, but {why}")
        wants_gpu = bool(spec.resources.gpus) or str(spec.offload.target_device or "").startswith("cuda")
        if not slurm_job and gpus and wants_gpu and spec.kind in ("train", "infer"):
            from jobs.worker.inventory import torch_cuda_build, torch_installed

            if torch_installed() and torch_cuda_build() is None:  # GPUs that this torch cannot use
                field = "resources.gpus" if spec.resources.gpus else "offload.target_device"
                raise SpecError(field, "asks for a GPU, but this worker's torch is a CPU build: install the "
                                       "CUDA build of torch on the worker (scripts/quickstart.sh does)")
        if not slurm_job and spec.gpus > sched.gpu_slots:
            raise SpecError("resources.gpus", f"asks for {spec.gpus} GPUs; this worker has {sched.gpu_slots}")
        why = _fit_error(spec, [g.memory_total for g in gpus], "this worker")
        if not slurm_job and spec.resources.min_vram and why:
            raise SpecError("resources.min_vram", why)
        return
    known = store.workers()
    if slurm_job:
        if not any("slurm" in (w.get("executors") or []) for w in known):
            raise SpecError("executor", "no worker on this store runs executor: slurm (none has Slurm's client "
                                        "commands on its PATH)")
        return
    errors = [_fit_error(spec, [g.get("memory_total") or 0 for g in (w.get("gpus") or [])] or [0],
                         f"worker {w['id']}") for w in known]
    if known and all(errors):
        raise SpecError("resources.min_vram" if spec.resources.min_vram else "resources.gpus",
                        f"no worker on this store can run it: {'; '.join(e for e in errors[:3] if e)}")


def _fit_error(spec: JobSpec, vram: list[int], who: str) -> str | None:
    """Why `who`, with GPUs of `vram` bytes each (0: unknown), could never run `spec`; None when it could.

    A worker with no GPU has one slot of 0 bytes: GPU jobs without `min_vram` run there on the CPU.
    """
    need = spec.gpus
    floor = spec.resources.min_vram or 0
    if need == 0:
        return None
    if len(vram) < need:
        return f"asks for {need} GPUs; {who} has {len(vram)}"
    if sum(1 for v in vram if v >= floor) < need:
        have = ", ".join(f"{v / 2**30:.1f} GiB" if v else "unknown" for v in sorted(vram, reverse=True))
        return f"asks for {need} GPU(s) of at least {floor / 2**30:.1f} GiB; {who} has {have}"
    return None
