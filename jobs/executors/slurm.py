"""The `slurm` executor: each attempt is one `sbatch`, on a cluster that already runs Slurm.

    prepare   sbatch --hold: the batch job exists, held, its Slurm job id goes in the store
    release   scontrol release: only now may Slurm start it
    poll      squeue (one call for every attempt this worker tracks, at most once a second);
              how it ended from the launcher's exit.json, else sacct (with accounting), else
              scontrol
    terminate scancel --signal=TERM --full (a train job checkpoints on SIGTERM); kill: scancel
    recover   after a worker restart: still queued or running in Slurm means adopt it (Slurm kept
              it running); held means it never ran

The batch script runs the job under the same launcher as `executor: process` (jobs/executors/
launcher.py, with `--forward-signals` and no go pipe: the hold is Slurm's), so exit.json, the
process-tree cleanup and the exit classification are the same. Slurm writes stdout and stderr to
the run dir's output.log, which the worker ships to the store like any other: the run dir, the
checkout and its venv must be on a filesystem the compute nodes share (as on every Slurm site).

Resources: `--gres=gpu:N` for `resources.gpus`; `limits.max_duration` becomes `--time` (rounded
up to whole minutes, Slurm's unit) with `--signal=B:TERM@<stop_grace, at least 10 s>`, so a job
past its limit is told to checkpoint first (Slurm may send it up to 60 s early). The scheduler
leaves the limit to Slurm: time spent queued does not count. Site options (partition, account,
QOS, CPUs, memory) come from the worker: `OFFLOAD_JOBS_SLURM_ARGS="--partition=gpu --account=lab"`.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Any

from jobs.executors.base import Executor, Exit, Handle, Launch, Recovered, SetupFailed
from jobs.executors.process import LAUNCHER, exit_from_record, job_environment
from jobs.rundir import RunDir

__all__ = ["SlurmExecutor", "sbatch_args", "batch_script", "slurm_job_name"]

log = logging.getLogger("offload_jobs.executor.slurm")

POLL_EVERY_S = 1.0
CMD_TIMEOUT_S = 30.0
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "REQUEUED",
          "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
HELD_REASONS = {"JobHeldUser", "JobHeldAdmin"}


def slurm_job_name(job_id: str, attempt: int) -> str:
    return f"offload-{job_id}-{attempt}"


def sbatch_args(launch: Launch, gpus: int, site_args: list[str]) -> list[str]:
    """The sbatch options of one attempt (pure: tested without Slurm)."""
    rd = str(launch.run_dir.path)
    args = ["--parsable", "--hold", f"--job-name={slurm_job_name(launch.job_id, launch.attempt)}",
            f"--output={rd}/output.log", "--open-mode=append", f"--chdir={rd}", "--export=ALL",
            f"--comment=offload-jobs {launch.job_id} attempt {launch.attempt}"]
    if gpus > 0:
        args.append(f"--gres=gpu:{gpus}")
    if launch.time_limit:
        minutes = max(1, math.ceil(launch.time_limit / 60))
        args.append(f"--time={minutes}")
        args.append(f"--signal=B:TERM@{max(10, math.ceil(launch.stop_grace))}")
    return args + site_args


def batch_script(launch: Launch) -> str:
    """The batch script: the launcher, which runs the job and writes exit.json (pure)."""
    argv = [sys.executable, "-S", "-E", str(LAUNCHER), "--run-dir", str(launch.run_dir.path), "--job-id",
            launch.job_id, "--attempt", str(launch.attempt), "--umask", f"{launch.umask:o}", "--forward-signals"]
    if launch.cwd:
        argv += ["--cwd", launch.cwd]
    argv += ["--", *launch.argv]
    return ("#!/bin/sh\n"
            f"# offload-jobs job {launch.job_id} attempt {launch.attempt} (written by the worker; sbatch runs it)\n"
            "exec " + " ".join(shlex.quote(a) for a in argv) + "\n")


class SlurmExecutor(Executor):
    name = "slurm"
    enforces_time_limit = True

    def __init__(self, site_args: list[str] | None = None) -> None:
        if site_args is None:
            site_args = shlex.split(os.environ.get("OFFLOAD_JOBS_SLURM_ARGS", ""))
        self.site_args = site_args
        self._tracked: set[str] = set()
        self._states: dict[str, tuple[str, str]] = {}
        self._polled = 0.0

    # ------------------------------------------------------------ commands
    def _run(self, argv: list[str], env: dict[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S, env=env)
        except FileNotFoundError:
            raise SetupFailed(f"executor: slurm needs {argv[0]} on the worker's PATH") from None
        except subprocess.TimeoutExpired:
            raise SetupFailed(f"{argv[0]} did not answer within {CMD_TIMEOUT_S:.0f}s (is slurmctld up?)") from None

    def _query(self, ids: list[str]) -> dict[str, tuple[str, str]]:
        """{slurm id: (state, reason)} of those Slurm still knows (squeue -t all)."""
        if not ids:
            return {}
        try:
            cp = self._run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r"])
        except SetupFailed as exc:
            log.warning("%s", exc)
            raise
        out = {}
        for line in cp.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) == 3:
                out[parts[0]] = (parts[1], parts[2])
        return out

    def _state(self, sid: str, fresh: bool = False) -> tuple[str, str] | None:
        """(state, reason), refreshed for all tracked attempts at most once per POLL_EVERY_S; None: unknown to Slurm."""
        now = time.monotonic()
        if fresh or now - self._polled >= POLL_EVERY_S or sid not in self._states:
            ids = sorted(self._tracked | {sid})
            try:
                states = self._query(ids)
            except SetupFailed:
                return self._states.get(sid, ("UNREACHABLE", ""))
            self._states = states
            self._polled = now
        return self._states.get(sid)

    # ------------------------------------------------------------ start
    def prepare(self, launch: Launch) -> Handle:
        rd = launch.run_dir
        script = rd.path / f"slurm-{launch.attempt}.sh"
        _write_new(script, batch_script(launch))
        env = {k: v for k, v in job_environment(launch.env).items() if not k.startswith("SLURM_")}
        gpus = launch.gpu_request
        cp = self._run(["sbatch", *sbatch_args(launch, gpus, self.site_args), str(script)], env=env)
        if cp.returncode != 0:
            msg = (cp.stderr or cp.stdout).strip().splitlines()
            raise SetupFailed(f"sbatch refused the job: {msg[-1] if msg else f'exit code {cp.returncode}'}")
        sid = cp.stdout.strip().split(";")[0]
        if not sid.isdigit():
            raise SetupFailed(f"sbatch answered {cp.stdout.strip()[:80]!r}, not a job id")
        self._tracked.add(sid)
        info = {"slurm_job_id": sid, "name": slurm_job_name(launch.job_id, launch.attempt), "job_id": launch.job_id,
                "attempt": launch.attempt, "run_dir": str(rd.path), "gpus": [], "gpu_request": gpus}
        return Handle(pid=None, pgid=None, info=info, obj={"released": False})

    def release(self, handle: Handle) -> None:
        cp = self._run(["scontrol", "release", handle.info["slurm_job_id"]])
        if cp.returncode != 0:
            handle.obj["start_error"] = f"scontrol release failed: {(cp.stderr or cp.stdout).strip()[:200]}"
            self._cancel(handle.info["slurm_job_id"])
        handle.obj["released"] = True

    def abort(self, handle: Handle) -> None:
        handle.obj["aborted"] = True
        self._cancel(handle.info["slurm_job_id"])

    # ------------------------------------------------------------ watch
    def poll(self, handle: Handle) -> Exit | None:
        state = handle.obj
        sid = handle.info["slurm_job_id"]
        if state.get("aborted"):
            return Exit(exit_code=None, ran=False)
        if state.get("start_error"):
            return Exit(exit_code=None, setup_error=state["start_error"])
        if state.get("next_poll", 0.0) > time.monotonic():
            return None
        state["next_poll"] = time.monotonic() + POLL_EVERY_S / 2
        st = self._state(sid)
        if st is not None and (st[0] in ACTIVE or st[0] == "UNREACHABLE"):
            return None
        return self._ended(handle.info, st)

    def _ended(self, info: dict[str, Any], st: tuple[str, str] | None) -> Exit:
        sid = info["slurm_job_id"]
        self._tracked.discard(sid)
        slurm_state = st[0] if st else self._final_state(sid)
        rec = RunDir(info["run_dir"]).read_exit(info.get("attempt")) if info.get("run_dir") else None
        if rec is not None:
            ex = exit_from_record(rec)
            if rec.get("signalled") or slurm_state == "TIMEOUT":
                ex.timed_out = True  # Slurm's --signal before the limit (our own scancel is judged as a cancel)
            return ex
        # No exit.json: the batch job died before or around the launcher.
        if slurm_state == "TIMEOUT":
            return Exit(exit_code=None, signal=signal.SIGKILL, timed_out=True)
        if slurm_state == "OUT_OF_MEMORY":
            return Exit(exit_code=None, signal=signal.SIGKILL, oom=True)
        if slurm_state == "CANCELLED":
            return Exit(exit_code=None, signal=signal.SIGTERM)
        code = self._exit_code(sid)
        if code is not None and slurm_state in ("COMPLETED", "FAILED"):
            return Exit(exit_code=code)
        return Exit(exit_code=None, unknown=True)

    def _final_state(self, sid: str) -> str | None:
        acct = self._sacct(sid)
        if acct is not None:
            return acct[0]
        fields = self._scontrol(sid)
        return fields.get("JobState") if fields else None

    def _exit_code(self, sid: str) -> int | None:
        acct = self._sacct(sid)
        text = acct[1] if acct is not None else (self._scontrol(sid) or {}).get("ExitCode")
        try:
            return int(str(text).split(":")[0]) if text else None
        except ValueError:
            return None

    def _sacct(self, sid: str) -> tuple[str, str] | None:
        try:
            cp = self._run(["sacct", "-n", "-P", "-X", "-j", sid, "-o", "State,ExitCode"])
        except SetupFailed:
            return None
        line = cp.stdout.strip().splitlines()[:1]
        if cp.returncode != 0 or not line or "|" not in line[0]:
            return None  # accounting is off (no slurmdbd): scontrol knows for MinJobAge
        state, code = line[0].split("|", 1)
        return state.split()[0], code

    def _scontrol(self, sid: str) -> dict[str, str] | None:
        try:
            cp = self._run(["scontrol", "show", "job", "-o", sid])
        except SetupFailed:
            return None
        if cp.returncode != 0:
            return None
        return dict(part.split("=", 1) for part in cp.stdout.split() if "=" in part)

    # ------------------------------------------------------------ stop
    def terminate(self, handle: Handle) -> None:
        sid = handle.info["slurm_job_id"]
        st = self._state(sid, fresh=True)
        if st is not None and st[0] == "PENDING":
            self._cancel(sid)  # queued: nothing runs yet
            return
        cp = self._run(["scancel", "--signal=TERM", "--full", sid])
        if cp.returncode != 0:
            self._cancel(sid)
        handle.obj["next_poll"] = 0.0

    def kill(self, handle: Handle) -> None:
        sid = handle.info["slurm_job_id"]
        self._run(["scancel", "--signal=KILL", "--full", sid])
        self._cancel(sid)
        handle.obj["next_poll"] = 0.0

    def _cancel(self, sid: str) -> None:
        try:
            self._run(["scancel", sid])
        except SetupFailed as exc:
            log.warning("could not cancel Slurm job %s: %s", sid, exc)

    # ------------------------------------------------------------ after a crash
    def recover(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> Recovered:
        info = {**(info or {}), "job_id": job_id, "attempt": attempt, "run_dir": str(run_dir.path)}
        sid = info.get("slurm_job_id")
        if not sid:
            n = self._cancel_by_name(job_id, attempt)  # submitted held, never recorded
            return Recovered("never_ran", message="the worker died before recording its Slurm job"
                                                  + (f" ({n} held job(s) cancelled)" if n else ""))
        try:
            st = self._query([sid]).get(sid)
        except SetupFailed as exc:
            return Recovered("lost", message=f"cannot ask Slurm about job {sid}: {exc}")
        if st is not None and st[0] == "PENDING" and st[1] in HELD_REASONS:
            self._cancel(sid)
            return Recovered("never_ran", message=f"its Slurm job {sid} was still held")
        if st is not None and st[0] in ACTIVE:
            self._tracked.add(sid)
            return Recovered("running", handle=Handle(info=info, obj={"released": True}))
        ex = self._ended(info, st)
        if ex.unknown:
            return Recovered("lost", message=f"Slurm job {sid} ended with no exit record")
        return Recovered("ended", exit=ex)

    def reap(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> int:
        sid = (info or {}).get("slurm_job_id")
        n = 0
        if sid:
            self._cancel(sid)
            n += 1
        return n + self._cancel_by_name(job_id, attempt)

    def _cancel_by_name(self, job_id: str, attempt: int) -> int:
        try:
            cp = self._run(["squeue", "-h", "-n", slurm_job_name(job_id, attempt), "-o", "%i"])
        except SetupFailed:
            return 0
        ids = [i.strip() for i in cp.stdout.split() if i.strip().isdigit()]
        for i in ids:
            self._cancel(i)
        return len(ids)


def _write_new(path: Any, text: str) -> None:
    """Write `path` afresh, never through a link planted in its place (the run dir is the job's)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(text)
