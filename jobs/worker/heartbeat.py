"""The worker's heartbeat: its lease on the store, its attempts' leases, and the reaper.

One thread, every `interval` (heartbeat_timeout / 4, at most 5 s):

1. renew: one transaction moves this worker's lease, and that of each of its live attempts whose
   lease has not run out, to now + heartbeat_timeout on the database's clock. The attempts it did
   not renew are no longer this worker's (fenced): the scheduler kills them and records nothing.
2. the local deadline: `deadline = t_sent + heartbeat_timeout - margin`, where t_sent is when the
   last renewal that committed was sent (this host's monotonic clock). The store's lease ends
   later than that, whatever the database's clock says, so stopping every attempt by `deadline`
   (the scheduler, and the launcher from the lease file, where the job runs) means no attempt of
   a worker that is cut off or dead still runs once another worker may retry it.
3. lease files: after each renewal, `leases/<job>.<attempt>.json` gets the new deadline, which
   the attempt's launcher enforces even when this worker is dead.
4. reap: attempts of any worker whose lease ran out are closed as worker_lost and retried per
   their policy (`JobStore.reap_attempt`, conditional, so two reapers close each one once); then
   what is left of them on this host, or in Slurm, is stopped.

On SQLite (one worker per store) only the worker's row is kept fresh, for `ps` and /v1/workers:
nothing else can take its attempts, so nothing is fenced (a full disk must not kill jobs).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jobs.contract import JobState, Reason
from jobs.errors import JobsError, StoreError
from jobs.executors import SetupFailed, get_executor
from jobs.rundir import RunDir
from jobs.store import JobStore, LeaseLost
from jobs.worker.inventory import WorkerIdentity
from jobs.worker.loop_thread import LoopThread

__all__ = ["Heartbeat", "LeaseFiles", "DEFAULT_HEARTBEAT_TIMEOUT"]

log = logging.getLogger("offload_jobs.heartbeat")

DEFAULT_HEARTBEAT_TIMEOUT = 30.0


class LeaseFiles:
    """`<home>/leases/<job>.<attempt>.json`: the deadline each attempt's launcher enforces."""

    def __init__(self, home: Path) -> None:
        self.dir = home / "leases"

    def path(self, job_id: str, attempt: int) -> Path:
        return self.dir / f"{job_id}.{attempt}.json"

    def write(self, job_id: str, attempt: int, until: float, grace: float, *, create: bool = True) -> None:
        p = self.path(job_id, attempt)
        if not create and not p.exists():
            return  # the attempt ended meanwhile
        self.dir.mkdir(mode=0o700, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"until": until, "grace": grace}))
        os.replace(tmp, p)

    def remove(self, job_id: str, attempt: int) -> None:
        self.path(job_id, attempt).unlink(missing_ok=True)

    def sweep(self, keep: Callable[[str, int], bool]) -> None:
        if not self.dir.is_dir():
            return
        for p in self.dir.glob("*.json"):
            job_id, _, rest = p.name.partition(".")
            number = rest.split(".")[0]
            if not (number.isdigit() and keep(job_id, int(number))):
                p.unlink(missing_ok=True)


class Heartbeat(LoopThread):
    thread_name = "offload-jobs-heartbeat"
    join_timeout = 10.0

    def __init__(self, store: JobStore, ident: WorkerIdentity, *, timeout: float, home: Path,
                 info: Callable[[], dict[str, Any]], grace_of: Callable[[str, int], float] | None = None,
                 url: str | None = None) -> None:
        super().__init__()
        self.store = store
        self.ident = ident
        self.timeout = float(timeout)
        self.interval = max(0.2, min(5.0, self.timeout / 4))
        self.margin = max(0.5, 0.1 * self.timeout)
        self.fencing = store.shared
        self.leases = LeaseFiles(home)
        self.info = info
        self.grace_of = grace_of or (lambda job_id, attempt: 10.0)
        self.url = url
        self.deadline: float | None = None  # monotonic; None until the first renewal
        self.renewed: set[tuple[str, int]] = set()
        self.renewed_sent = 0.0  # when the renewal that produced `renewed` was sent
        self.lost_id = False  # another process registered under our worker id: stop everything
        self.on_reaped: Callable[[dict[str, Any]], None] | None = None
        # How an expired attempt really ended, when its run dir says so (Scheduler.find_end): recorded
        # instead of worker_lost, so a job that finished is never run again for a lost record.
        self.find_end: Callable[[dict[str, Any]], Any] | None = None
        self._last_warning = 0.0
        self.reaped = 0

    # ------------------------------------------------------------ lifecycle
    def register(self) -> None:
        """Put this worker in the store (refusing a live namesake elsewhere), then renew once."""
        prev = self.store.register_worker(
            self.ident.id, instance=self.ident.instance, host=self.ident.host, boot_id=self.ident.boot_id,
            pid=self.ident.pid, url=self.url, heartbeat_timeout=self.timeout, info=self.info())
        if prev is not None and not self._namesake_gone(prev):
            raise JobsError(
                f"worker id {self.ident.id} is in use by pid {prev.get('pid')} on {prev.get('host')} (heartbeat "
                f"{prev.get('heartbeat_age_s') or 0:.0f}s ago); give this worker another --worker-id, or stop that one")
        self.beat()

    def _namesake_gone(self, prev: dict[str, Any]) -> bool:
        # Same host and boot, and its pid is gone (or is us): it was this worker before a crash.
        if prev.get("boot_id") != self.ident.boot_id or prev.get("host") != self.ident.host:
            return False
        pid = prev.get("pid")
        if not pid or pid == os.getpid():
            return True
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def stop(self) -> None:
        self._end_loop()
        try:
            self.store.worker_stopped(self.ident.id, self.ident.instance)
        except StoreError:
            pass

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
                if self.fencing and not self.lost_id:
                    self.reap()
            except Exception:  # the heartbeat must survive anything; the next beat tries again
                log.exception("heartbeat failed")

    # ------------------------------------------------------------ renew
    def beat(self) -> None:
        sent = time.monotonic()
        try:
            renewed = self.store.heartbeat(self.ident.id, self.ident.instance, self.timeout,
                                           renew_attempts=self.fencing, info=self.info())
        except LeaseLost:
            if not self.lost_id:
                log.error("another process registered as worker %s; this one stops its jobs and claims no more",
                          self.ident.id)
            self.lost_id = True
            self.deadline = time.monotonic()
            return
        except StoreError as exc:
            self._warn(f"cannot renew the lease on the store: {exc}")
            return
        self.renewed, self.renewed_sent = renewed, sent
        self.deadline = sent + self.timeout - self.margin
        if self.fencing:
            for job_id, attempt in renewed:
                try:
                    self.leases.write(job_id, attempt, self.deadline, self.lease_grace(job_id, attempt), create=False)
                except OSError as exc:
                    self._warn(f"cannot write the lease file of {job_id}.{attempt}: {exc}")

    def lease_grace(self, job_id: str, attempt: int) -> float:
        """SIGTERM this long before the deadline: the job's stop_grace, at most half the lease."""
        return max(0.0, min(self.grace_of(job_id, attempt), self.timeout / 2 - self.margin))

    def claim_deadline(self, sent: float) -> float:
        """The local deadline of a lease granted by a claim sent at `sent` (monotonic)."""
        return sent + self.timeout - self.margin

    def holds(self, job_id: str, attempt: int, since: float) -> bool:
        """False when the last renewal did not renew this attempt although it was sent after `since` (when
        the attempt's claim had committed, so that renewal saw it): it was taken, or its lease ran out."""
        if not self.fencing or self.renewed_sent <= since:
            return True
        return (job_id, attempt) in self.renewed

    # ------------------------------------------------------------ reap
    def reap(self) -> int:
        """Close the attempts whose lease ran out, whoever held them; returns how many this call closed."""
        try:
            self.store.mark_lost_workers()
            expired = self.store.expired_attempts()
        except StoreError as exc:
            self._warn(f"cannot look for lost attempts: {exc}")
            return 0
        n = 0
        for a in expired:
            holder = a.get("worker_id") or "?"
            retry_on = _retry_on(a.get("spec") or {})
            never_ran = a["status"] == JobState.STARTING
            silent = self.timeout + a.get("overdue_s", 0.0)
            msg = (f"worker {holder} stopped renewing its lease (silent for about {silent:.0f}s); "
                   + ("the attempt had not started" if never_ran else "the attempt is lost"))
            # A STARTING attempt whose run dir says it ran (its RUNNING commit was lost) is judged by that too.
            end = None if self.find_end is None else self.find_end(a)
            try:
                if end is not None:
                    job = self._record_found_end(a, end, holder, retry_on)
                else:
                    job = self.store.reap_attempt(a["job_id"], a["number"], retry_on=retry_on, never_ran=never_ran,
                                                  message=msg, note=f"[offload-jobs] {msg} (reaped by {self.ident.id})")
            except StoreError as exc:
                self._warn(f"cannot reap job {a['job_id']} attempt {a['number']}: {exc}")
                continue
            if job is None:
                continue  # renewed in time, or another reaper was first
            n += 1
            self.reaped += 1
            log.warning("job %s attempt %d of worker %s: lease ran out; %s", a["job_id"], a["number"], holder,
                        "queued again" if job["status"] == JobState.PENDING else job["status"])
            self._stop_remains(a)
            if self.on_reaped is not None:
                self.on_reaped(job)
        return n

    def _record_found_end(self, a: dict[str, Any], end: Any, holder: str, retry_on: list[str]) -> dict[str, Any] | None:
        """Close an expired attempt with the end its run dir records (once: only while still past due)."""
        msg = (f"worker {holder} stopped renewing its lease after the attempt ended; its end ({end.status}"
               + (f", {end.reason}" if end.reason else "") + f") was read from its run dir by {self.ident.id}")
        job = self.store.finish_attempt(a["job_id"], a["number"], status=end.status, reason=end.reason,
                                        exit_code=end.exit_code, message=end.message, retry_on=retry_on,
                                        only_if_expired=True, note=f"[offload-jobs] {msg}")
        return job if job.get("recorded") else None

    def _stop_remains(self, a: dict[str, Any]) -> None:
        """What is left of a reaped attempt, where this worker can reach it (this host, Slurm)."""
        name = a.get("executor") or "process"
        try:
            executor = get_executor(name)
        except SetupFailed:
            return
        try:
            executor.reap(a["job_id"], a["number"], a.get("handle"), RunDir(a.get("run_dir") or "/nonexistent"))
        except Exception as exc:  # a remote executor that cannot answer: its own limits still apply
            log.warning("could not stop the remains of job %s attempt %d (%s): %s", a["job_id"], a["number"], name, exc)

    def _warn(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            log.warning("%s", msg)


def _retry_on(spec: dict[str, Any]) -> list[str]:
    retry = spec.get("retry") if isinstance(spec, dict) else None
    on = retry.get("on") if isinstance(retry, dict) else None
    return list(on) if isinstance(on, list) else [Reason.WORKER_LOST]
