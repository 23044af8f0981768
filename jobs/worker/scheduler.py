"""The scheduler: claims jobs (FIFO with priority), starts, watches and stops their attempts.

One thread. It wakes at once on submit or cancel (an Event) and otherwise every `tick` seconds
to poll children, enforce `limits.max_duration` and finish SIGTERM -> SIGKILL escalations.
GPU jobs take GPU slots (one job per GPU); gpus == 0 jobs share `max_cpu_jobs` slots.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jobs.errors import SpecError
from jobs.executors import Executor, Handle, Launch, SetupFailed, classify, get_executor
from jobs.rundir import RunDir
from jobs.runners import get_runner
from jobs.spec import JobSpec, parse_spec
from jobs.store import JobStore

__all__ = ["Scheduler"]

log = logging.getLogger("offload_jobs.scheduler")


@dataclass
class _Running:
    job_id: str
    attempt: int
    spec: JobSpec
    run_dir: RunDir
    executor: Executor
    handle: Handle
    gpus: list[int]
    started: float
    stop_reason: str | None = None  # cancelled / timeout / shutdown, once we began stopping it
    kill_at: float | None = None
    killed: bool = False
    metrics_offset: int = 0
    metrics_checked: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Scheduler:
    def __init__(self, store: JobStore, home: Path, *, gpu_count: int = 0, max_cpu_jobs: int = 4,
                 tick: float = 0.1, on_finish: Callable[[dict[str, Any]], None] | None = None,
                 on_start: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.store = store
        self.home = Path(home)
        self.gpu_count = gpu_count
        # With no GPU, "GPU" jobs still run one at a time (on the CPU).
        self.gpu_slots = max(1, gpu_count)
        self.max_cpu_jobs = max_cpu_jobs
        self.tick = tick
        self.on_finish = on_finish
        self.on_start = on_start
        self.running: dict[str, _Running] = {}
        self._free_gpus = list(range(self.gpu_slots))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._executors: dict[str, Executor] = {}
        self._base_env = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_JOBS_TOKEN")}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="offload-jobs-scheduler", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, stop_running: bool = True, timeout: float = 30.0) -> None:
        """Stop the loop; running attempts get SIGTERM, SIGKILL after their grace, then worker_lost."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5)
        if not stop_running:
            return
        for r in list(self.running.values()):
            r.stop_reason = "shutdown"
            r.executor.terminate(r.handle)
            r.kill_at = time.monotonic() + min(r.spec.limits.stop_grace, timeout)
        deadline = time.monotonic() + timeout
        while self.running and time.monotonic() < deadline:
            self._poll_running()
            time.sleep(0.05)

    # ------------------------------------------------------------ API hooks
    def cancel(self, job_id: str) -> dict[str, Any]:
        job = self.store.request_cancel(job_id)
        self._wake.set()
        return job

    # ------------------------------------------------------------ loop
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.tick)
            self._wake.clear()
            try:
                self._poll_running()
                if not self._stop.is_set():
                    self._start_pending()
            except Exception:  # the loop must survive a bad job; log it and go on
                log.exception("scheduler iteration failed")
                time.sleep(self.tick)

    def _start_pending(self) -> None:
        while not self._stop.is_set():
            cpu_free = self.max_cpu_jobs - sum(1 for r in self.running.values() if r.spec.gpus == 0)
            gpu_free = len(self._free_gpus)
            job = self.store.claim_next(gpu_slots=gpu_free, cpu_slots=cpu_free)
            if job is None:
                return
            self._launch(job)

    def _launch(self, job: dict[str, Any]) -> None:
        job_id, number = job["id"], job["attempt"]
        run_dir = RunDir(job["run_dir"] or RunDir.for_job(self.home, job_id).path)
        try:
            spec = parse_spec(job["spec"])
        except SpecError as exc:  # a spec that no longer validates (older schema)
            self._finish(job_id, number, None, "FAILED", "setup_failed", None, f"spec: {exc}")
            return
        gpus: list[int] = []
        if spec.gpus > 0:
            gpus, self._free_gpus = self._free_gpus[: spec.gpus], self._free_gpus[spec.gpus:]
        try:
            if not run_dir.spec_file.exists():
                run_dir.create(job["spec"])
            run_dir.clear_exit_report()
            note = f"[offload-jobs] attempt {number}/{job['max_attempts']} of job {job_id} starting"
            if number > 1 and job.get("reason"):
                note += f" (previous attempt: {job['reason']})"
            run_dir.append_log(note + "\n")
            plan = get_runner(spec.kind)(spec, run_dir, self._base_env)
            plan.env.update({"OFFLOAD_JOBS_JOB_ID": job_id, "OFFLOAD_JOBS_ATTEMPT": str(number)})
            executor = self._executor(spec.executor)
            handle = executor.start(Launch(
                job_id=job_id, attempt=number, argv=plan.argv, env=plan.env, cwd=plan.cwd, run_dir=run_dir,
                gpus=gpus if self.gpu_count else [], image=spec.image, shm_size=spec.resources.shm_size,
                job_env={k: v for k, v in plan.env.items() if self._base_env.get(k) != v},
            ))
        except Exception as exc:  # SetupFailed, or anything else that kept the attempt from starting
            if not isinstance(exc, SetupFailed):
                log.exception("could not start job %s", job_id)
                exc = SetupFailed(f"{type(exc).__name__}: {exc}")
            self._free_gpus.extend(gpus)
            try:
                run_dir.append_log(f"[offload-jobs] setup_failed: {exc}\n")
            except OSError:
                pass
            self._finish(job_id, number, spec, "FAILED", "setup_failed", None, str(exc))
            return
        r = _Running(job_id, number, spec, run_dir, executor, handle, gpus, time.monotonic())
        self.running[job_id] = r
        if not self.store.mark_running(job_id, number, executor=executor.name, pid=handle.pid, pgid=handle.pgid,
                                       handle=handle.info, worker_pid=os.getpid()):
            self._begin_stop(r, "cancelled")  # cancelled while STARTING
        elif self.on_start and number == 1:
            self.on_start(job)

    def _executor(self, name: str) -> Executor:
        if name not in self._executors:
            self._executors[name] = get_executor(name)
        return self._executors[name]

    def _poll_running(self) -> None:
        if not self.running:
            return
        now = time.monotonic()
        cancelling = self._cancelling_ids()
        for r in list(self.running.values()):
            ex = r.executor.poll(r.handle)
            if ex is not None:
                self._on_exit(r, ex)
                continue
            if r.stop_reason is None and r.job_id in cancelling:
                self._begin_stop(r, "cancelled")
            elif r.stop_reason is None and r.spec.limits.max_duration and now - r.started > r.spec.limits.max_duration:
                r.run_dir.append_log(f"[offload-jobs] max_duration {r.spec.limits.max_duration:g}s exceeded; stopping\n")
                self._begin_stop(r, "timeout")
            elif r.kill_at is not None and not r.killed and now >= r.kill_at:
                r.killed = True
                r.executor.kill(r.handle)
            if now - r.metrics_checked > 1.0:
                self._read_metrics(r)

    def _cancelling_ids(self) -> set[str]:
        # One cheap indexed query per tick instead of one per running job.
        return {j["id"] for j in self.store.list_jobs(status="CANCELLING")} if self.running else set()

    def _begin_stop(self, r: _Running, reason: str) -> None:
        r.stop_reason = reason
        r.executor.terminate(r.handle)
        r.kill_at = time.monotonic() + r.spec.limits.stop_grace
        if r.spec.limits.stop_grace == 0:
            r.killed = True
            r.executor.kill(r.handle)

    def _read_metrics(self, r: _Running) -> None:
        r.metrics_checked = time.monotonic()
        records, r.metrics_offset = r.run_dir.read_metrics(r.metrics_offset)
        if records:
            self.store.set_last_metrics(r.job_id, records[-1])

    def _on_exit(self, r: _Running, ex: Any) -> None:
        r.executor.cleanup(r.handle)
        self.running.pop(r.job_id, None)
        self._free_gpus.extend(r.gpus)
        self._free_gpus.sort()
        self._read_metrics(r)
        if r.stop_reason == "shutdown":
            status, reason, msg = "FAILED", "worker_lost", "the worker stopped while the job ran"
        else:
            status, reason, msg = classify(ex, stop_reason=r.stop_reason, killed_by_us=r.killed,
                                           exit_report=r.run_dir.read_exit_report())
        code = ex.exit_code if ex.exit_code is not None else (-ex.signal if ex.signal else None)
        tail = f"[offload-jobs] attempt {r.attempt} ended: {status}" + (f" ({reason})" if reason else "")
        r.run_dir.append_log(tail + (f": {msg}" if msg and reason != "cancelled" else "") + "\n")
        self._finish(r.job_id, r.attempt, r.spec, status, reason, code, msg)

    def _finish(self, job_id: str, number: int, spec: JobSpec | None, status: str, reason: str | None,
                exit_code: int | None, message: str | None) -> None:
        requeue = False
        if status == "FAILED" and spec is not None and reason in spec.retry.on:
            job = self.store.get_job(job_id)
            requeue = number < job["max_attempts"] and job["status"] != "CANCELLING"
        job = self.store.finish_attempt(job_id, number, status=status, reason=reason, exit_code=exit_code,
                                        message=message, requeue=requeue)
        if self.on_finish:
            self.on_finish(job)
        self._wake.set()

    # ------------------------------------------------------------ recovery
    def recover(self) -> list[str]:
        """Attempts left STARTING/RUNNING by a dead worker -> FAILED worker_lost, retried per policy."""
        lost = []
        for a in self.store.live_attempts():
            executor = None
            try:
                executor = self._executor(a["executor"] or "process")
            except SetupFailed:
                pass
            if executor is not None:
                executor.kill_orphan(a["handle"] or {}, a["pid"], a["pgid"])
            job = self.store.get_job(a["job_id"])
            run_dir = RunDir(job["run_dir"] or RunDir.for_job(self.home, job["id"]).path)
            try:
                spec: JobSpec | None = parse_spec(job["spec"])
            except SpecError:
                spec = None
            if job["status"] == "CANCELLING":
                status, reason, msg = "CANCELLED", "cancelled", None
            else:
                status, reason, msg = "FAILED", "worker_lost", "the worker died while this attempt ran"
            if run_dir.path.exists():
                run_dir.append_log(f"[offload-jobs] attempt {a['number']} lost: the worker died; recovered as {reason}\n")
            self._finish(job["id"], a["number"], spec, status, reason, None, msg)
            lost.append(job["id"])
        return lost
