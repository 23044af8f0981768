"""The scheduler: claims jobs (FIFO with priority), starts, watches and stops their attempts.

One thread. It wakes at once on submit or cancel (an Event) and otherwise every `tick` seconds
to poll children, enforce `limits.max_duration` and finish SIGTERM -> SIGKILL escalations. A
worker of its own store with nothing running and nothing to claim waits `IDLE_TICK_S` instead:
only a submit, a retry or a reap (each wakes it) can give it work then. For the same reason, while
its children run it reads its store (claims, cancellations) only when woken, when an attempt ended,
or `IDLE_TICK_S` after the last read, not every tick.
GPU jobs take GPU slots (one job per GPU); gpus == 0 jobs share `max_cpu_jobs` slots.

Exactly once, through crashes:
- a child runs only after its identity is committed (`Executor.prepare`, `mark_running`,
  `Executor.release`); a crash in between leaves a held child that exits unrun;
- an ended attempt keeps its place (and its slot) until its completion is written; a failed store
  write (a full disk, a lock) is retried every tick with back-off, never dropped;
- at start, `recover` adopts attempts whose child still runs, records the real exit of those that
  ended while no worker watched (exit.json, the container's state), and kills what is left of any
  other before it is retried.

With a shared store (Postgres, workers on several hosts) it also:
- claims only what fits its free GPUs (count and `resources.min_vram`), CPU slots and Slurm slots,
  each attempt held by this worker under a lease that the heartbeat renews;
- stops an attempt whose lease the heartbeat did not renew (another worker's reaper took it) and
  records nothing over the retry; stops every attempt itself before its local lease deadline when
  the store cannot be reached (jobs/worker/heartbeat.py);
- ships each attempt's log and metrics to the store (jobs/worker/shipping.py), and delivers the
  `signal` controls sent through other workers' APIs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jobs.contract import JobState, Reason
from jobs.errors import JobNotFound, RunDirError, SpecError, StoreError
from jobs.executors import Executor, Exit, Handle, Launch, SetupFailed, classify, get_executor
from jobs.batchdir import BatchDir
from jobs.rundir import RunDir
from jobs.runners import get_runner
from jobs.spec import JobSpec, parse_spec
from jobs.store import JobStore, LeaseLost
from jobs.worker.cosched import Batch, claim_members, hold_for_partners
from jobs.worker.faults import FaultPoints
from jobs.worker.heartbeat import Heartbeat, LeaseFiles
from jobs.worker.loop_thread import LoopThread
from jobs.worker.shipping import SHIP_EVERY_S, Shipment

__all__ = ["Scheduler", "worker_env"]

log = logging.getLogger("offload_jobs.scheduler")

RETRY_MAX_S = 5.0  # back-off ceiling between attempts to write a completion
IDLE_TICK_S = 1.0  # an idle worker's store poll (10 Hz cost ~2.5% of a core per idle worker)


@dataclass
class _Outcome:
    status: str
    reason: str | None
    exit_code: int | None
    message: str | None
    never_ran: bool = False


@dataclass
class _Running:
    job_id: str
    attempt: int
    spec: JobSpec | None
    run_dir: RunDir
    executor: Executor | None
    handle: Handle | None
    gpus: list[int]
    started: float
    stop_reason: str | None = None  # cancelled / timeout / shutdown, once we began stopping it
    kill_at: float | None = None
    killed: bool = False
    metrics_offset: int = 0
    metrics_checked: float = 0.0
    outcome: _Outcome | None = None  # set once it ended, until the store has it
    retry_at: float = 0.0
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    claim_sent: float = 0.0  # monotonic time the claim was sent (its local lease deadline counts from then)
    claimed: float = 0.0  # and when it had committed: only a renewal sent after that must have renewed it
    fenced: bool = False  # its lease is gone: stopped, and its end is not ours to record
    ship: Shipment | None = None  # shared stores: what of its output reached the store


def worker_env(environ: Any) -> dict[str, str]:
    """The environment jobs start from: the worker's own, with its interpreter first on PATH.

    A worker started as `.venv/bin/offload-jobs up --local` from a shell whose `python` is some
    other interpreter still runs `python train.py` with the venv's python (and its torch): the
    interpreter's bin dir leads PATH and VIRTUAL_ENV names the venv. The token never reaches a job.
    """
    env = {k: v for k, v in environ.items() if not k.startswith("OFFLOAD_JOBS_TOKEN")}
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != bindir]
    env["PATH"] = os.pathsep.join([bindir, *rest])
    if sys.prefix != sys.base_prefix:
        env["VIRTUAL_ENV"] = sys.prefix
    env.pop("PYTHONHOME", None)
    return env


class Scheduler(LoopThread):
    thread_name = "offload-jobs-scheduler"

    def __init__(self, store: JobStore, home: Path, *, gpu_count: int = 0, max_cpu_jobs: int = 4,
                 tick: float = 0.1, on_finish: Callable[[dict[str, Any]], None] | None = None,
                 on_start: Callable[[dict[str, Any]], None] | None = None, job_umask: int = 0o022,
                 gpu_vram: list[int] | None = None, worker_id: str | None = None,
                 heartbeat: Heartbeat | None = None, max_slurm_jobs: int = 0) -> None:
        super().__init__()
        self.store = store
        self.home = Path(home)
        self.gpu_count = gpu_count
        # With no GPU, "GPU" jobs still run one at a time (on the CPU).
        self.gpu_slots = max(1, gpu_count)
        self.gpu_vram = {i: int(v) for i, v in enumerate(gpu_vram or []) if i < gpu_count}  # bytes; absent: unknown
        self.worker_id = worker_id
        self.heartbeat = heartbeat
        self.shared = store.shared and heartbeat is not None  # leases, fencing and shipping apply
        self.leases = LeaseFiles(self.home)
        self.max_slurm_jobs = max_slurm_jobs
        self._control_cursor: int | None = None
        self._controls_checked = 0.0
        self.max_cpu_jobs = max_cpu_jobs
        self.tick = tick
        self.on_finish = on_finish
        self.on_start = on_start
        self.job_umask = job_umask
        self.running: dict[str, _Running] = {}
        self._free_gpus = list(range(self.gpu_slots))
        self._wake = threading.Event()
        self._executors: dict[str, Executor] = {}
        self._base_env = worker_env(os.environ)
        self._faults = FaultPoints(self.home)
        self._claim_blocked_until = 0.0
        self._last_store_warning = 0.0

    # ------------------------------------------------------------ lifecycle
    def wake(self) -> None:
        self._wake.set()

    def stop(self, stop_running: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop; running attempts get SIGTERM, SIGKILL after their grace, then worker_lost."""
        self._end_loop(self._wake)
        if not stop_running:
            return
        for r in list(self.running.values()):
            if r.outcome is None and r.handle is not None and r.executor is not None:
                grace = r.spec.limits.stop_grace if r.spec is not None else 10.0
                self._begin_stop(r, "shutdown", grace=min(grace, timeout))
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            self._poll_running(final=True)
            time.sleep(0.05)

    # ------------------------------------------------------------ API hooks
    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self.store.request_cancel(job_id)
        self._wake.set()
        return job

    # ------------------------------------------------------------ loop
    def _loop(self) -> None:
        idle = False
        store_due = 0.0  # own store: when it is read again without a wake
        while not self._stop.is_set():
            woken = self._wake.wait(max(self.tick, IDLE_TICK_S) if idle else self.tick)
            self._wake.clear()
            idle = False
            now = time.monotonic()
            # Shared stores keep the tick: other workers' submits and cancels reach this one's queue
            # too. Its own store changes only through this worker, whose API wakes the loop (a submit, a
            # cancel, a retry; an ended attempt wakes it too): the tick's reads while children run would
            # find nothing new (two queries a tick, ~3% of a core per running worker).
            read_store = woken or self.store.shared or now >= store_due
            try:
                self._poll_running(read_store=read_store)
                if not self._stop.is_set() and read_store:
                    store_due = now + IDLE_TICK_S
                    idle = self._start_pending() and not self.running and not self.shared
                    if self._claim_blocked_until > now:  # held for a batch's partners: read again then
                        store_due = min(store_due, self._claim_blocked_until)
            except Exception:  # the loop must survive a bad job; log it and go on
                log.exception("scheduler iteration failed")
                time.sleep(self.tick)

    def _store_trouble(self, what: str, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_store_warning > 30.0:
            self._last_store_warning = now
            log.warning("%s: %s (retrying)", what, exc)

    def _start_pending(self) -> bool:
        """Claim and start what fits; True when the store had nothing for this worker."""
        if time.monotonic() < self._claim_blocked_until or not self._may_claim():
            return False
        hold = hold_for_partners(self.store, time.time())
        if hold > 0:  # a batchable infer job just arrived: jobs submitted with it join its batch
            self._claim_blocked_until = time.monotonic() + min(hold, self.tick)
            return False
        while not self._stop.is_set():
            local = [r for r in self.running.values() if not _is_slurm(r) and not _rides(r)]
            cpu_free = self.max_cpu_jobs - sum(1 for r in local if r.spec is None or r.spec.gpus == 0)
            slurm_free = self.max_slurm_jobs - sum(1 for r in self.running.values() if _is_slurm(r))
            sent = time.monotonic()
            try:
                job = self.store.claim_next(
                    gpu_slots=len(self._free_gpus), cpu_slots=cpu_free, slurm_slots=slurm_free,
                    gpu_vram=[self.gpu_vram.get(g, 0) for g in self._free_gpus], worker_id=self.worker_id,
                    lease_s=self.heartbeat.timeout if self.shared else None,
                    run_root=str(self.home / "runs") if self.shared else None)
            except StoreError as exc:
                self._store_trouble("cannot claim jobs", exc)
                self._claim_blocked_until = time.monotonic() + 1.0
                return False
            if job is None:
                return True
            self._launch_claimed(job, sent, time.monotonic())
        return False

    def _launch_claimed(self, job: dict[str, Any], sent: float, claimed: float) -> None:
        """Start `job`, with the queued infer jobs that may share its child (jobs/worker/cosched.py)."""
        members = claim_members(self.store, job, worker_id=self.worker_id,
                                lease_s=self.heartbeat.timeout if self.shared else None,
                                run_root=str(self.home / "runs") if self.shared else None)
        if not members:
            self._launch(job, sent, claimed)
            return
        jobs = [job, *members]
        run_dirs = {j["id"]: j["run_dir"] or str(RunDir.for_job(self.home, j["id"]).path) for j in jobs}
        try:
            plans: list[Batch | None] = list(Batch.plan(job, members, run_dirs))
        except (OSError, RunDirError) as exc:  # the batch folder cannot be written: each runs on its own
            log.warning("job %s: cannot write its batch folder (%s); its %d members run apart", job["id"], exc,
                        len(members))
            plans = [None] * len(jobs)
        for j, plan in zip(jobs, plans):
            self._launch(j, sent, claimed, batch=plan)

    def _may_claim(self) -> bool:
        """Shared stores: only with a fresh lease (a worker cut off from the store takes no more work)."""
        if not self.shared:
            return True
        hb = self.heartbeat
        assert hb is not None
        return not hb.lost_id and hb.deadline is not None and time.monotonic() < hb.deadline - hb.timeout / 2

    def _pick_gpus(self, spec: JobSpec) -> list[int]:
        """`spec.gpus` free GPUs with at least `min_vram` each, the smallest that fit first."""
        need, floor = spec.gpus, spec.resources.min_vram or 0
        fit = sorted((g for g in self._free_gpus if self.gpu_vram.get(g, 0) >= floor),
                     key=lambda g: (self.gpu_vram.get(g, 0), g))
        chosen = fit[:need] if len(fit) >= need else self._free_gpus[:need]
        self._free_gpus = [g for g in self._free_gpus if g not in chosen]
        return sorted(chosen)

    def _launch(self, job: dict[str, Any], claim_sent: float | None = None, claimed: float | None = None,
                batch: Batch | None = None) -> None:
        """Start a claimed attempt: prepare its child (not yet running), record it, then let it run."""
        job_id, number = job["id"], job["attempt"]
        run_dir = RunDir(job["run_dir"] or RunDir.for_job(self.home, job_id).path)
        try:
            spec = parse_spec(job["spec"])
        except SpecError as exc:  # a spec that no longer validates (older schema)
            self._settle(self._pending(job_id, number, run_dir), _Outcome(JobState.FAILED, Reason.SETUP_FAILED, None, f"spec: {exc}"))
            return
        slurm = spec.executor == "slurm"
        rides = batch is not None and not batch.leads  # a member: its images are rendered in the leader's child
        gpus = self._pick_gpus(spec) if spec.gpus > 0 and not slurm and not rides else []
        r = _Running(job_id, number, spec, run_dir, None, None, gpus, time.monotonic())
        if batch is not None:
            r.extra["batch"] = batch
        r.claim_sent = claim_sent if claim_sent is not None else time.monotonic()
        r.claimed = claimed if claimed is not None else time.monotonic()
        self.running[job_id] = r
        if not self._prepare(r, job):
            return
        self._faults.pause("prepared")
        if self._record_start(r):
            r.executor.release(r.handle)
            if self.on_start and number == 1:
                self.on_start(job)

    def _prepare(self, r: _Running, job: dict[str, Any]) -> bool:
        """The run dir, the lease file, the log's first line and the executor's prepared child; False
        (the attempt settled as setup_failed) when any of it fails."""
        job_id, number, spec, run_dir = r.job_id, r.attempt, r.spec, r.run_dir
        assert spec is not None
        lease_file = None
        try:
            if not run_dir.spec_file.exists():
                run_dir.create(job["spec"])
            if self.shared:
                assert self.heartbeat is not None
                lease_file = str(self.leases.path(job_id, number))
                self.leases.write(job_id, number, self.heartbeat.claim_deadline(r.claim_sent),
                                  self.heartbeat.lease_grace(job_id, number))
                r.ship = Shipment.begin(run_dir)
            run_dir.clear_report()
            run_dir.append_log(self._start_note(job) + "\n")
            plan = get_runner(spec.kind)(spec, run_dir, self._base_env)
            plan.env.update({"OFFLOAD_JOBS_JOB_ID": job_id, "OFFLOAD_JOBS_ATTEMPT": str(number)})
            batch = r.extra.get("batch")
            if batch is not None:
                plan.env.update(batch.env())
            if self.worker_id:
                plan.env["OFFLOAD_JOBS_WORKER_ID"] = self.worker_id
            r.executor = self._executor(spec.executor)
            r.handle = r.executor.prepare(Launch(
                job_id=job_id, attempt=number, argv=plan.argv, env=plan.env, cwd=plan.cwd, run_dir=run_dir,
                gpus=r.gpus if self.gpu_count else [], image=spec.image, shm_size=spec.resources.shm_size,
                job_env={k: v for k, v in plan.env.items() if self._base_env.get(k) != v}, umask=self.job_umask,
                lease_file=lease_file, time_limit=spec.limits.max_duration, stop_grace=spec.limits.stop_grace,
                name=spec.display_name(), gpu_request=spec.gpus, warm=plan.warm,
            ))
            if r.ship is not None:
                r.handle.info.update(log_start=r.ship.log_start, metrics_start=r.ship.metrics_start)
            if batch is not None:
                r.handle.info["batch"] = batch.info()  # recorded with the attempt: an adopting worker knows it
        except Exception as exc:  # SetupFailed, or anything else that kept the attempt from starting
            if not isinstance(exc, (SetupFailed, OSError)):
                log.exception("could not start job %s", job_id)
            msg = str(exc) if isinstance(exc, SetupFailed) else f"{type(exc).__name__}: {exc}"
            run_dir.append_log(f"[offload-jobs] setup_failed: {msg}\n")
            self._leave_batch(r, Reason.SETUP_FAILED)
            r.handle = None
            self._settle(r, _Outcome(JobState.FAILED, Reason.SETUP_FAILED, None, msg))
            return False
        return True

    def _start_note(self, job: dict[str, Any]) -> str:
        note = f"[offload-jobs] attempt {job['attempt']}/{job['max_attempts']} of job {job['id']} starting"
        if self.shared:
            note += f" on worker {self.worker_id}"
        if job["attempt"] > 1 and job.get("reason"):
            note += f" (previous attempt: {job['reason']})"
        return note

    def _record_start(self, r: _Running) -> bool:
        """Record the prepared attempt as RUNNING; False (its child aborted unrun) when it must not run:
        taken over, unrecorded, cancelled while STARTING, or its lease ran out meanwhile."""
        job_id, number, h = r.job_id, r.attempt, r.handle
        assert r.executor is not None and h is not None
        try:
            go = self.store.mark_running(job_id, number, executor=r.executor.name, pid=h.pid, pgid=h.pgid,
                                         handle=h.info, worker_pid=os.getpid(),
                                         worker_id=self.worker_id if self.shared else None)
        except LeaseLost:
            # Reaped while we prepared it (a stall past the lease): drop it unrun, record nothing.
            log.warning("job %s: attempt %d was taken over before it started; not starting it", job_id, number)
            r.executor.abort(h)
            self._leave_batch(r, "unrecorded")
            self._drop(r)
            return False
        except StoreError as exc:
            # Unrecorded children never run: drop it; the attempt is retried once the store answers.
            log.warning("job %s: cannot record attempt %d (%s); not starting it", job_id, number, exc)
            r.executor.abort(h)
            self._leave_batch(r, "unrecorded")
            r.stop_reason = "unrecorded"
            return False
        self._faults.pause("recorded")
        if not go:  # cancelled while STARTING
            r.executor.abort(h)
            r.stop_reason = Reason.CANCELLED
            self._leave_batch(r, Reason.CANCELLED)
            return False
        if self.shared and not self._lease_fresh(r):
            # The claim's lease is past its local deadline (a stall, the store gone): another worker may
            # retry it any moment, so it must not start here. Stopped unrun, it is queued again.
            log.warning("job %s: attempt %d's lease ran out before it started; not starting it", job_id, number)
            r.executor.abort(h)
            self._leave_batch(r, "unrecorded")
            r.stop_reason = "unrecorded"
            return False
        return True

    def _lease_fresh(self, r: _Running) -> bool:
        """Shared stores: this attempt's lease still has its stop grace left on this host's clock."""
        hb = self.heartbeat
        assert hb is not None
        if hb.lost_id:
            return False
        deadline = max(hb.claim_deadline(r.claim_sent), hb.deadline or 0.0)
        return time.monotonic() < deadline - hb.lease_grace(r.job_id, r.attempt)

    def _drop(self, r: _Running) -> None:
        """Forget a stopped attempt: recorded, or not ours to record (its lease was taken)."""
        if r.handle is not None and r.executor is not None:
            try:
                r.executor.cleanup(r.handle)
            except Exception:
                log.exception("cleanup of job %s failed", r.job_id)
        self.leases.remove(r.job_id, r.attempt)
        self.running.pop(r.job_id, None)
        self._free_gpus.extend(g for g in r.gpus if g not in self._free_gpus)
        self._free_gpus.sort()

    def _leave_batch(self, r: _Running, why: str) -> None:
        """An attempt of a batch that will not run: its leader leaves it out (a stop record in its run dir),
        or, when it is the leader, its members stop waiting (the batch is marked ended)."""
        batch = r.extra.get("batch")
        if batch is None:
            return
        if batch.leads:
            BatchDir(batch.dir).mark_ended()
        else:
            r.run_dir.write_stop(r.attempt, why)

    def _live_members(self, r: _Running) -> bool:
        """`r` leads a batch some other member of which still has a live child here."""
        batch = r.extra.get("batch")
        if batch is None or not batch.leads:
            return False
        return any(m.outcome is None and m.job_id != r.job_id and m.extra.get("batch") is not None
                   and m.extra["batch"].of == batch.of for m in self.running.values())

    def _pending(self, job_id: str, number: int, run_dir: RunDir) -> _Running:
        r = _Running(job_id, number, None, run_dir, None, None, [], time.monotonic())
        self.running[job_id] = r
        return r

    def _executor(self, name: str) -> Executor:
        if name not in self._executors:
            self._executors[name] = get_executor(name)
        return self._executors[name]

    def _poll_running(self, final: bool = False, read_store: bool = True) -> None:
        if not self.running:
            return
        now = time.monotonic()
        cancelling = self._cancelling_ids() if read_store else set()  # a cancel wakes the loop
        if self.shared and not final:
            self._deliver_controls(now)
        for r in list(self.running.values()):
            if r.outcome is not None:
                if now >= r.retry_at:
                    self._record(r)
                continue
            if r.handle is None or r.executor is None:
                continue
            if self.shared:
                self._fence(r, now)
            ex = r.executor.poll(r.handle)
            if ex is not None:
                self._on_exit(r, ex)
                continue
            limits = r.spec.limits if r.spec is not None else None
            own_limit = limits and limits.max_duration and not r.executor.enforces_time_limit
            if r.stop_reason is None and r.job_id in cancelling:
                self._begin_stop(r, Reason.CANCELLED)
            elif r.stop_reason is None and own_limit and now - r.started > limits.max_duration:
                r.run_dir.append_log(f"[offload-jobs] max_duration {limits.max_duration:g}s exceeded; stopping\n")
                self._begin_stop(r, Reason.TIMEOUT)
            elif r.extra.get("soft_stop") and not self._live_members(r):
                self._begin_stop(r, r.stop_reason or Reason.CANCELLED)
            elif r.kill_at is not None and not r.killed and now >= r.kill_at:
                r.killed = True
                r.executor.kill(r.handle)
            if not final and r.ship is not None and now - r.ship.last > SHIP_EVERY_S:
                self._ship(r)
            elif not final and r.ship is None and now - r.metrics_checked > self.METRICS_EVERY_S:
                self._read_metrics(r)

    def _fence(self, r: _Running, now: float) -> None:
        """Stop `r` when its lease is gone (taken: at once) or about to run out locally (from grace before)."""
        hb = self.heartbeat
        assert hb is not None and r.executor is not None and r.handle is not None
        if not r.fenced and (hb.lost_id or not hb.holds(r.job_id, r.attempt, r.claimed)):
            r.fenced = True
            r.run_dir.append_log(f"[offload-jobs] attempt {r.attempt} is no longer this worker's (its lease ran out "
                                 "and another worker took it over); stopping it\n")
            log.warning("job %s attempt %d: lease lost; killing it", r.job_id, r.attempt)
            r.stop_reason = r.stop_reason or "fenced"
            r.killed = True
            r.executor.kill(r.handle)
            return
        deadline = hb.deadline
        if deadline is None or r.fenced or r.stop_reason == "fenced":
            return
        grace = hb.lease_grace(r.job_id, r.attempt)
        if now >= deadline - grace:
            r.run_dir.append_log("[offload-jobs] cannot renew the lease on the store; stopping the attempt before "
                                 "another worker may retry it\n")
            self._begin_stop(r, "fenced", grace=max(0.0, deadline - now))

    def _ship(self, r: _Running) -> None:
        assert r.ship is not None and self.worker_id is not None
        r.ship.last = time.monotonic()
        data, records, offset = r.ship.take(r.run_dir)
        if not data and not records:
            return
        try:
            self.store.append_output(r.job_id, r.attempt, self.worker_id, log=data, metrics=records)
        except LeaseLost:
            return  # the heartbeat's next renewal will say so, and _fence stops it
        except StoreError as exc:
            self._store_trouble(f"job {r.job_id}: cannot ship its output", exc)
            return
        r.ship.sent(data, records, offset)

    def _deliver_controls(self, now: float) -> None:
        """`signal` controls sent through any worker's API reach the run dir of the attempt running here."""
        if now - self._controls_checked < SHIP_EVERY_S:
            return
        self._controls_checked = now
        try:
            if self._control_cursor is None:
                self._control_cursor = self.store.last_event_id()
                return
            events = self.store.events_since(self._control_cursor, 500, types=["job.control"])
        except StoreError as exc:
            self._store_trouble("cannot read job controls", exc)
            return
        for ev in events:
            self._control_cursor = ev["id"]
            r = self.running.get(ev.get("job_id") or "")
            if r is None or r.attempt != ev.get("attempt") or ev.get("worker_id") != self.worker_id:
                continue
            try:
                r.run_dir.append_control({"ts": ev.get("ts"), "action": ev.get("action"), "attempt": r.attempt})
            except (OSError, RunDirError) as exc:
                log.warning("job %s: cannot deliver control %s: %s", r.job_id, ev.get("action"), exc)

    def _cancelling_ids(self) -> set[str]:
        # One cheap indexed query per tick instead of one per running job.
        try:
            return {j["id"] for j in self.store.list_jobs(status=JobState.CANCELLING, summary=True)}
        except StoreError as exc:
            self._store_trouble("cannot read cancellations", exc)
            return set()

    def _begin_stop(self, r: _Running, reason: str, grace: float | None = None) -> None:
        assert r.executor is not None and r.handle is not None
        r.stop_reason = reason
        r.run_dir.write_stop(r.attempt, reason)  # first: a crash mid-stop still knows why
        if reason in (Reason.CANCELLED, Reason.TIMEOUT) and self._live_members(r):
            # A batch's leader renders its members' images too: it only leaves its own rows out (it
            # reads the stop record above) and is stopped once no member waits on it any more.
            r.extra["soft_stop"] = True
            r.run_dir.append_log(f"[offload-jobs] {reason}: this job's images are left out of its batch; its child "
                                 "goes on for the other jobs of the batch\n")
            return
        r.extra.pop("soft_stop", None)
        if grace is None:
            grace = r.spec.limits.stop_grace if r.spec is not None else 10.0
        r.executor.terminate(r.handle)
        r.kill_at = time.monotonic() + grace
        if grace == 0:
            r.killed = True
            r.executor.kill(r.handle)

    # How often a running job's newest metrics row reaches the store (and so `ps` and the dashboard's
    # table): faster than the dashboard's 2 Hz refresh, one small write per running job.
    METRICS_EVERY_S = 0.4

    def _read_metrics(self, r: _Running) -> None:
        r.metrics_checked = time.monotonic()
        records, r.metrics_offset = r.run_dir.read_metrics(r.metrics_offset)
        if records:
            try:
                self.store.set_last_metrics(r.job_id, records[-1])
            except StoreError as exc:
                self._store_trouble(f"job {r.job_id}: cannot record metrics", exc)

    # ------------------------------------------------------------ completions
    def _on_exit(self, r: _Running, ex: Exit) -> None:
        self._read_metrics(r)
        outcome = self._judge(r.stop_reason, r.killed, ex)
        tail = f"[offload-jobs] attempt {r.attempt} ended: {outcome.status}" + (f" ({outcome.reason})" if outcome.reason else "")
        if outcome.message and outcome.reason != Reason.CANCELLED:
            tail += f": {outcome.message}"
        r.run_dir.append_log(tail + "\n")
        self._faults.pause("ended")  # the crash tests kill the worker here: ended, not yet recorded
        self._settle(r, outcome)

    @staticmethod
    def _judge(stop_reason: str | None, killed: bool, ex: Exit) -> _Outcome:
        code = ex.exit_code if ex.exit_code is not None else (-ex.signal if ex.signal else None)
        if not ex.ran:
            if stop_reason == Reason.CANCELLED:
                return _Outcome(JobState.CANCELLED, Reason.CANCELLED, None, None)
            return _Outcome(JobState.FAILED, Reason.WORKER_LOST, None, "the attempt was stopped before it ran; it is queued again",
                            never_ran=True)
        if stop_reason == "shutdown":
            return _Outcome(JobState.FAILED, Reason.WORKER_LOST, code, "the worker stopped while the job ran")
        if stop_reason == "fenced" or (ex.fenced and stop_reason != Reason.CANCELLED):
            return _Outcome(JobState.FAILED, Reason.WORKER_LOST, code, "its worker could not renew the lease on the store (cut "
                                                             "off, or stopped); the attempt was stopped so that a "
                                                             "retry never runs beside it")
        if ex.timed_out and stop_reason != Reason.CANCELLED:
            return _Outcome(JobState.FAILED, Reason.TIMEOUT, code, "exceeded limits.max_duration (the executor's time limit)")
        if ex.unknown:
            if stop_reason == Reason.CANCELLED:
                return _Outcome(JobState.CANCELLED, Reason.CANCELLED, None, None)
            return _Outcome(JobState.FAILED, Reason.WORKER_LOST, None, "the attempt ended with no exit record (its launcher "
                                                             "was killed?)")
        status, reason, msg = classify(ex, stop_reason=stop_reason, killed_by_us=killed, exit_report=None)
        return _Outcome(status, reason, code, msg)

    def _settle(self, r: _Running, outcome: _Outcome) -> None:
        batch = r.extra.get("batch")
        if batch is not None and batch.leads:
            BatchDir(batch.dir).mark_ended()  # members still waiting learn at once that no result will come
        r.outcome = outcome
        self._record(r)

    def _record(self, r: _Running) -> None:
        """Write r's completion; on a store failure keep it (and its slot) and try again later."""
        o = r.outcome
        assert o is not None
        retry_on = list(r.spec.retry.on) if r.spec is not None else []
        output, shipped = None, None
        if r.ship is not None:
            shipped = r.ship.take(r.run_dir, final=True)
            output = {"log": shipped[0], "metrics": shipped[1]}
        try:
            job = self.store.finish_attempt(r.job_id, r.attempt, status=o.status, reason=o.reason,
                                            exit_code=o.exit_code, message=o.message, retry_on=retry_on,
                                            never_ran=o.never_ran, worker_id=self.worker_id if self.shared else None,
                                            output=output)
        except StoreError as exc:
            r.failures += 1
            r.retry_at = time.monotonic() + min(RETRY_MAX_S, 0.1 * 2 ** r.failures)
            if r.failures == 1 or r.failures % 20 == 0:
                log.warning("job %s: completion of attempt %d not recorded yet (%s); kept, retrying",
                            r.job_id, r.attempt, exc)
            return
        if self.shared and not job.get("recorded", True):
            late = None
            if o.reason != Reason.WORKER_LOST:  # a real end, which a reaper closed as lost: keep it, name the re-run
                late = self._record_late(r.job_id, r.attempt, o, retry_on)
            if late is None:
                log.warning("job %s: attempt %d was closed by a reaper meanwhile (its lease ran out; the job is %s, "
                            "attempt %s on %s); its end here (%s) is not recorded", r.job_id, r.attempt,
                            job.get("status"), job.get("attempt"), job.get("worker_id"), o.reason or o.status)
            else:
                job = late
        elif r.failures:
            log.warning("job %s: completion of attempt %d recorded after %d failed writes", r.job_id, r.attempt,
                        r.failures)
        if r.ship is not None and shipped is not None:
            r.ship.sent(*shipped)
        self._drop(r)
        if self.on_finish:
            self.on_finish(job)
        self._wake.set()

    def _record_late(self, job_id: str, number: int, o: _Outcome, retry_on: list[str]) -> dict[str, Any] | None:
        assert self.worker_id is not None
        try:
            job = self.store.record_late_end(job_id, number, worker_id=self.worker_id, status=o.status,
                                             reason=o.reason, exit_code=o.exit_code, message=o.message,
                                             retry_on=retry_on, found_by=self.worker_id)
        except StoreError as exc:
            log.warning("job %s: cannot record the late end of attempt %d: %s", job_id, number, exc)
            return None
        if job is not None:
            log.warning("job %s: attempt %d ended %s after a reaper closed it; recorded late (the job is %s)",
                        job_id, number, o.status, job["status"])
        return job

    def find_end(self, a: dict[str, Any]) -> _Outcome | None:
        """How attempt `a` really ended, from its run dir's exit.json, if that is readable here (this
        host, or a run root shared between workers) and says it ended on its own: None when it has no
        record, never ran, or was stopped for its lease (then it is lost, and retried)."""
        path = a.get("run_dir")
        if not path:
            return None
        run_dir = RunDir(path)
        try:
            rec = run_dir.read_exit(a["number"])
        except (OSError, RunDirError):
            return None
        if rec is None or rec.get("job_id") != a["job_id"]:
            return None  # another job's dir under the same path on another host, or nothing
        from jobs.executors.process import exit_from_record

        ex = exit_from_record(rec)
        if not ex.ran or ex.fenced:
            return None
        stop = run_dir.read_stop(a["number"])
        if stop in ("fenced", "shutdown", "unrecorded"):
            return None
        outcome = self._judge(stop, stop is not None, ex)
        return None if outcome.reason == Reason.WORKER_LOST else outcome

    def _settle_reaped(self) -> None:
        """At start: this worker's attempts that a reaper closed as lost while it was away, whose real
        end is in their run dir, get that end recorded (or their re-run named)."""
        assert self.worker_id is not None
        try:
            reaped = self.store.reaped_attempts(self.worker_id)
        except StoreError as exc:
            log.warning("cannot look for reaped attempts: %s", exc)
            return
        for a in reaped:
            outcome = self.find_end(a)
            if outcome is None:
                continue
            try:
                spec = parse_spec(self.store.get_job(a["job_id"])["spec"])
                retry_on = list(spec.retry.on)
            except (SpecError, JobNotFound, StoreError):
                retry_on = []
            self._record_late(a["job_id"], a["number"], outcome, retry_on)

    # ------------------------------------------------------------ recovery
    def recover(self) -> list[str]:
        """Settle every attempt a dead worker left live: adopt, record its real end, or retry it.

        Returns the ids of the jobs whose attempt was not adopted.
        """
        settled = []
        for a in self.store.live_attempts(worker_id=self.worker_id if self.shared else None):
            job_id, number = a["job_id"], a["number"]
            job = self.store.get_job(job_id)
            run_dir = RunDir(job["run_dir"] or RunDir.for_job(self.home, job_id).path)
            try:
                spec: JobSpec | None = parse_spec(job["spec"])
            except SpecError:
                spec = None
            try:
                executor: Executor | None = self._executor(a["executor"] or (spec.executor if spec else "process"))
            except SetupFailed:
                executor = None
            stop = run_dir.read_stop(number)
            if stop is None and job["status"] == JobState.CANCELLING:
                stop = Reason.CANCELLED
            rec = executor.recover(job_id, number, a["handle"], run_dir) if executor is not None else None
            if rec is not None and rec.state == "running" and spec is not None and rec.handle is not None:
                self._adopt(job, a, spec, run_dir, executor, rec.handle, stop)
                continue
            if executor is not None:
                executor.reap(job_id, number, a["handle"], run_dir)  # nothing of it may run beside a retry
            batch = Batch.from_info(a["handle"])
            if batch is not None and batch.leads:
                BatchDir(batch.dir).mark_ended()  # its adopted members stop waiting for it
            if rec is not None and rec.state == "ended" and rec.exit is not None:
                outcome = self._judge(stop, stop is not None, rec.exit)
                how = f"it ended while no worker watched: {outcome.status}" + (f" ({outcome.reason})" if outcome.reason else "")
            elif rec is not None and rec.state == "never_ran":
                outcome = self._judge(stop, False, Exit(None, ran=False))
                how = "it had not started yet; " + ("so cancelled" if outcome.status == JobState.CANCELLED else "queued again")
            elif stop == Reason.CANCELLED:
                outcome, how = _Outcome(JobState.CANCELLED, Reason.CANCELLED, None, None), "recovered as cancelled"
            elif stop == Reason.TIMEOUT:
                outcome, how = _Outcome(JobState.FAILED, Reason.TIMEOUT, None, "exceeded limits.max_duration"), "recovered as timeout"
            else:
                msg = (rec.message if rec is not None else None) or "the worker died while this attempt ran"
                outcome, how = _Outcome(JobState.FAILED, Reason.WORKER_LOST, None, msg), f"lost ({msg})"
            if run_dir.path.exists():
                run_dir.append_log(f"[offload-jobs] worker restarted; attempt {number}: {how}\n")
            r = _Running(job_id, number, spec, run_dir, None, None, [], time.monotonic())
            self.running[job_id] = r
            self._settle(r, outcome)
            settled.append(job_id)
        if self.shared:
            self._settle_reaped()
        self._sweep()
        self.leases.sweep(lambda job_id, attempt: job_id in self.running and self.running[job_id].attempt == attempt)
        return settled

    def _sweep(self) -> None:
        """Remove cgroups left by attempts whose worker died after recording them, before cleanup."""
        try:
            process = self._executor("process")
        except SetupFailed:
            return
        sweep = getattr(process, "sweep", None)
        if sweep is None:
            return

        def keep(job_id: str, attempt: int) -> bool:
            r = self.running.get(job_id)
            if r is not None and r.attempt == attempt:
                return True  # adopted, or its completion is still to be written
            try:
                self.store.get_job(job_id)
            except JobNotFound:
                return True  # not this store's job: another worker's
            if self.shared:  # workers on this host share the cgroup root: leave the others' live attempts
                a = self.store.attempt(job_id, attempt)
                if a is None or (a["status"] in (JobState.STARTING, JobState.RUNNING) and a.get("worker_id") != self.worker_id):
                    return True
            return False

        try:
            n = sweep(keep)
        except OSError as exc:
            log.warning("could not sweep stale cgroups: %s", exc)
            return
        if n:
            log.info("removed %d cgroups of attempts that ended during a crash", n)

    def _adopt(self, job: dict[str, Any], a: dict[str, Any], spec: JobSpec, run_dir: RunDir, executor: Executor,
               handle: Handle, stop: str | None) -> None:
        gpus = [g for g in (handle.info.get("gpus") or []) if g in self._free_gpus]
        self._free_gpus = [g for g in self._free_gpus if g not in gpus]
        age = max(0.0, time.time() - (a.get("started_at") or time.time()))
        r = _Running(job["id"], a["number"], spec, run_dir, executor, handle, gpus, time.monotonic() - age)
        batch = Batch.from_info(handle.info)
        if batch is not None:
            r.extra["batch"] = batch
        try:
            r.metrics_offset = run_dir.metrics_file.stat().st_size
        except OSError:
            pass
        if self.shared:
            r.claim_sent = r.claimed = 0.0  # held only if the first renewal renewed it
            try:
                r.ship = Shipment.resume(run_dir, handle.info, self.store.shipped(job["id"], a["number"]))
            except StoreError:
                r.ship = Shipment.begin(run_dir)
        self.running[job["id"]] = r
        run_dir.append_log(f"[offload-jobs] worker restarted; attempt {a['number']} is still running and was adopted\n")
        if stop is not None:
            self._begin_stop(r, stop)
        log.info("adopted job %s attempt %d (pid %s)", job["id"], a["number"], handle.pid)


def _rides(r: _Running) -> bool:
    """A batch member: its child waits on the leader's, and takes no slot of its own."""
    batch = r.extra.get("batch")
    return batch is not None and not batch.leads


def _is_slurm(r: _Running) -> bool:
    return r.spec is not None and r.spec.executor == "slurm"
