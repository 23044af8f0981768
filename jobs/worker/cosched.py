"""Co-scheduled inference, the worker's half (issue 32): which queued infer jobs share one child.

When the scheduler claims an infer job, it also claims the queued infer jobs with the same
`batch_key` (up to `infer.max_batch` jobs, default `DEFAULT_MAX_JOBS`), in queue order. The first
job's child (the leader) loads the model once and renders every member's images in batched passes
(jobs/runners/cosched.py); each other member still gets a child of its own, a waiter with no torch
(jobs/runners/batch_member.py), so every job keeps its own attempt, log, exit, cancel and recovery
exactly as a job that runs alone. Members take no slot of their own: they ride on the leader's.

Jobs submitted together (a script's loop, a few per second) reach the queue one at a time, and the
scheduler wakes at the first: so the queue's head, when it is a batchable infer job younger than
`BATCH_WINDOW_S`, is held that long for partners (`hold_for_partners`) unless its batch is full.
A job submitted while a batch runs waits for the leader's slot, so it joins the next batch.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from jobs.batchdir import BATCH_DIR_ENV, BATCH_ROLE_ENV, BatchDir, BatchMember
from jobs.contract import Executor, Kind
from jobs.errors import SpecError, StoreError
from jobs.rundir import RunDir
from jobs.spec import JobSpec, parse_spec

__all__ = ["DEFAULT_MAX_JOBS", "BATCH_WINDOW_S", "batch_key", "max_jobs", "hold_for_partners", "claim_members", "Batch"]

DEFAULT_MAX_JOBS = 4  # jobs in one batch when infer.max_batch is unset (images per pass: the runner's estimate)
# How long a batchable job at the queue's head waits for partners: a model load takes far longer.
BATCH_WINDOW_S = 0.5

# What every member of a batch must share: one pipeline call honours one size, step count,
# guidance, negative prompt, LoRA and engine; the environment and resources shape the child itself.
_SHARED_INFER = ("lora", "lora_scale", "width", "height", "steps", "guidance", "negative_prompt", "num_frames",
                 "max_sequence_length", "max_batch")


def batch_key(spec: JobSpec) -> str | None:
    """The key of the jobs `spec` may share a child with; None when it runs alone (not infer, opted
    out with infer.share_stream: false, or an executor other than process)."""
    if spec.kind != Kind.INFER or not spec.infer.share_stream or spec.executor != Executor.PROCESS:
        return None
    shared = {
        "model": spec.model.model_dump(mode="json"),
        "offload": spec.offload.model_dump(mode="json"),
        "resources": spec.resources.model_dump(mode="json"),
        "env": dict(sorted(spec.env.items())),
        "workdir": spec.workdir,
        "infer": {k: getattr(spec.infer, k) for k in _SHARED_INFER},
    }
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:20]


def max_jobs(spec: JobSpec) -> int:
    return spec.infer.max_batch or DEFAULT_MAX_JOBS


def hold_for_partners(store: Any, now: float, window: float = BATCH_WINDOW_S) -> float:
    """Seconds to wait before the next claim (0: claim now). Only while the queue's head is a batchable
    infer job submitted less than `window` ago whose batch has room: every claim waits meanwhile, so
    the queue's order holds."""
    try:
        head = store.pending_jobs(limit=1)
        if not head or head[0]["kind"] != Kind.INFER:
            return 0.0
        queued = head[0]["created_at"] or 0.0
        if head[0]["attempt"]:  # queued again after an attempt (the members of a lost batch): since it ended
            last = store.attempt(head[0]["id"], head[0]["attempt"])
            queued = max(queued, (last or {}).get("finished_at") or 0.0)
        if now - queued >= window:
            return 0.0
        spec = parse_spec(head[0]["spec"])
        key = batch_key(spec)
        if key is None:
            return 0.0
        same = 0
        for job in store.pending_jobs(Kind.INFER, limit=max_jobs(spec) * 4):
            try:
                same += batch_key(parse_spec(job["spec"])) == key
            except SpecError:
                continue
        return 0.0 if same >= max_jobs(spec) else window - (now - queued)
    except (SpecError, StoreError):
        return 0.0


def claim_members(store: Any, leader: dict[str, Any], *, worker_id: str | None = None, lease_s: float | None = None,
                  run_root: str | None = None) -> list[dict[str, Any]]:
    """Claim the queued jobs that may share `leader`'s child (none when it runs alone)."""
    try:
        spec = parse_spec(leader["spec"])
    except SpecError:
        return []
    key = batch_key(spec)
    if key is None:
        return []
    room = max_jobs(spec) - 1
    out: list[dict[str, Any]] = []
    try:
        candidates = store.pending_jobs(Kind.INFER) if room > 0 else []
        for job in candidates:
            if len(out) >= room:
                break
            try:
                if batch_key(parse_spec(job["spec"])) != key:
                    continue
            except SpecError:
                continue
            got = store.claim_job(job["id"], worker_id=worker_id, lease_s=lease_s, run_root=run_root)
            if got is not None:
                out.append(got)
    except StoreError:
        pass  # the store hiccuped: run with what was claimed (the rest stay queued)
    return out


class Batch:
    """What the scheduler keeps of one job's place in a batch (`_Running.extra["batch"]`, and the
    attempt's handle info, so a restarted worker that adopts the child knows it too)."""

    def __init__(self, of: str, with_: list[str], role: str, dir: str) -> None:
        self.of, self.with_, self.role, self.dir = of, with_, role, dir

    @classmethod
    def plan(cls, leader: dict[str, Any], members: list[dict[str, Any]], run_dirs: dict[str, str]) -> list["Batch"]:
        """Write every member's run dir (the leader reads their specs) and the batch folder; one Batch for
        the leader and each member, in that order."""
        jobs = [leader, *members]
        ids = [j["id"] for j in jobs]
        for j in jobs:
            run_dir = RunDir(run_dirs[j["id"]])
            if not run_dir.spec_file.exists():
                run_dir.create(j["spec"])
        bd = BatchDir.of_leader(run_dirs[leader["id"]])
        bd.create(leader["id"], [BatchMember(j["id"], j["attempt"], run_dirs[j["id"]]) for j in jobs])
        return [cls(leader["id"], ids, "leader" if n == 0 else "member", str(bd.path)) for n in range(len(jobs))]

    @classmethod
    def from_info(cls, info: dict[str, Any] | None) -> "Batch | None":
        b = (info or {}).get("batch")
        if not isinstance(b, dict):
            return None
        return cls(b["of"], list(b["with"]), b["role"], b["dir"])

    def info(self) -> dict[str, Any]:
        return {"of": self.of, "with": self.with_, "role": self.role, "dir": self.dir}

    def env(self) -> dict[str, str]:
        return {BATCH_DIR_ENV: self.dir, BATCH_ROLE_ENV: self.role}

    @property
    def leads(self) -> bool:
        return self.role == "leader"
