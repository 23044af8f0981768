"""The `process` executor: each attempt is a launcher (`launcher.py`) and the job's process below it.

The launcher and the job write output.log themselves (opened O_APPEND), so no line passes through
the worker and none is lost when the worker dies. The job gets a cgroup v2 of its own where the
kernel lets us (every descendant, setsid or not, is in it and `cgroup.kill` stops them all at
once); else the launcher, a child subreaper, keeps every orphan in its subtree. Either way a
worker that restarts finds the attempt again from the identity in the store: the launcher's pid
and start time (never a pid alone), the job's process group and the cgroup.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jobs.batchdir import BATCH_DIR_ENV, BATCH_ROLE_ENV
from jobs.executors import proctree
from jobs.executors.base import Executor, Exit, Handle, Launch, Recovered, SetupFailed
from jobs.executors.warm import START_WAIT_S, WarmPool, WarmPopen, warm_enabled
from jobs.rundir import RunDir
from jobs.contract import RUNNER_ENV_OPTIONS

__all__ = ["ProcessExecutor", "LAUNCHER", "JOB_CONTRACT_ENV", "job_environment"]

log = logging.getLogger("offload_jobs.executor.process")

LAUNCHER = Path(__file__).with_name("launcher.py")
INFO_TIMEOUT_S = 30.0  # the launcher answers in ~30 ms; a loaded box may take seconds

# The OFFLOAD_JOBS_* names a job gets: its run-dir contract and identity (jobs/runners job_env, the
# scheduler), and the runner options a spec may set. Every other OFFLOAD_JOBS_* variable is the
# worker's own (its store URL with a Postgres password, its token, its home) and never reaches a job.
JOB_CONTRACT_ENV = frozenset({
    "OFFLOAD_JOBS_RUN_DIR", "OFFLOAD_JOBS_METRICS", "OFFLOAD_JOBS_OUTPUTS", "OFFLOAD_JOBS_EXIT_REPORT",
    "OFFLOAD_JOBS_JOB_ID", "OFFLOAD_JOBS_ATTEMPT", "OFFLOAD_JOBS_WORKER_ID",
    # the hub fetch runs in the job: where models are kept, and the path of the token's file (a
    # path, not the token; HF_TOKEN itself is the hub's own name and passes as any other variable)
    "OFFLOAD_JOBS_MODEL_CACHE", "OFFLOAD_JOBS_HF_TOKEN_FILE",
    BATCH_DIR_ENV, BATCH_ROLE_ENV,  # co-scheduled inference: the batch's folder, and this child's part in it
}) | RUNNER_ENV_OPTIONS


def job_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` with only the allowed OFFLOAD_JOBS_* names (the launcher's too: a job can read
    /proc/<launcher>/environ, so the launcher starts from this as well)."""
    return {k: v for k, v in env.items() if not k.startswith("OFFLOAD_JOBS_") or k in JOB_CONTRACT_ENV}


class _Held:
    """The worker's side of one attempt it started: the launcher's Popen and the go pipe."""

    def __init__(self, popen: subprocess.Popen[bytes] | WarmPopen | None, go_w: int | None) -> None:
        self.popen = popen
        self.go_w = go_w
        self.released: bool | None = False if go_w is not None else None  # None: adopted, not known here

    def close_go(self, go: bool) -> None:
        if self.go_w is None:
            return
        try:
            if go:
                os.write(self.go_w, b"g")
                self.released = True
        finally:
            os.close(self.go_w)
            self.go_w = None


class ProcessExecutor(Executor):
    name = "process"

    def __init__(self, use_cgroups: bool = True, warm: bool | None = None) -> None:
        self._cgroup_root: str | None | bool = None if use_cgroups else False
        self._warm: WarmPool | None = WarmPool() if (warm_enabled() if warm is None else warm) else None

    @property
    def cgroup_root(self) -> str | None:
        if self._cgroup_root is None:
            self._cgroup_root = proctree.cgroup_root() or False
        return self._cgroup_root or None

    # ------------------------------------------------------------ start
    def prepare(self, launch: Launch) -> Handle:
        env = job_environment(launch.env)
        if launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in launch.gpus)
        cgroup = None
        if self.cgroup_root:
            try:
                cgroup = proctree.Cgroup.create(self.cgroup_root, _cgroup_name(launch.job_id, launch.attempt))
            except OSError as exc:
                log.warning("no cgroup for %s/%s (%s); using the subreaper", launch.job_id, launch.attempt, exc)
        opts = ["--run-dir", str(launch.run_dir.path), "--job-id", launch.job_id, "--attempt", str(launch.attempt),
                "--umask", f"{launch.umask:o}"]
        if cgroup is not None:
            opts += ["--cgroup", cgroup.path]
        if launch.lease_file:
            opts += ["--lease-file", launch.lease_file]
        if launch.cwd:
            opts += ["--cwd", launch.cwd]
        opts += ["--", *launch.argv]
        go_r, go_w = os.pipe()
        info_r, info_w = os.pipe()
        try:
            log_fd = launch.run_dir.open_log_fd()
        except OSError as exc:
            for fd in (go_r, go_w, info_r, info_w):
                os.close(fd)
            raise SetupFailed(f"cannot open {launch.run_dir.log_file}: {exc}") from None
        popen: subprocess.Popen[bytes] | WarmPopen | None = None
        try:
            if launch.warm and self._warm is not None:  # the same launcher, forked with the libraries imported
                # A worker on a shared store has a claim to record in time: it never waits for the imports.
                popen = self._warm.spawn(opts, env, [log_fd, go_r, info_w], wait=0.0 if launch.lease_file else START_WAIT_S)
            if popen is None:
                argv = [sys.executable, "-S", "-E", str(LAUNCHER), "--go-fd", str(go_r), "--info-fd", str(info_w)]
                popen = subprocess.Popen(argv + opts, stdin=subprocess.DEVNULL, stdout=log_fd,
                                         stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True,
                                         close_fds=True, pass_fds=(go_r, info_w))
        except SetupFailed:
            os.close(go_w)
            os.close(info_r)
            raise
        except (OSError, ValueError) as exc:
            os.close(go_w)
            os.close(info_r)
            raise SetupFailed(f"cannot start the launcher ({sys.executable}): {exc}") from None
        finally:
            for fd in (go_r, info_w, log_fd):
                os.close(fd)
        held = _Held(popen, go_w)
        try:
            info = _read_info(info_r, popen)
        except SetupFailed:
            held.close_go(False)
            _wait(popen, 5.0)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            os.close(info_r)
        ident = {"launcher_pid": info["pid"], "launcher_starttime": info.get("starttime"),
                 "pid": info["child"], "pgid": info["child"], "starttime": info.get("child_starttime"),
                 "cgroup": cgroup.path if cgroup is not None else None, "subreaper": bool(info.get("subreaper")),
                 "gpus": list(launch.gpus), "job_id": launch.job_id, "attempt": launch.attempt,
                 "run_dir": str(launch.run_dir.path), "warm": isinstance(popen, WarmPopen)}
        return Handle(pid=info["child"], pgid=info["child"], info=ident, obj=held)

    def release(self, handle: Handle) -> None:
        handle.obj.close_go(True)

    def abort(self, handle: Handle) -> None:
        handle.obj.close_go(False)  # the held child reads EOF and exits unrun

    # ------------------------------------------------------------ watch
    def poll(self, handle: Handle) -> Exit | None:
        held: _Held = handle.obj
        info = handle.info
        if held.popen is not None:
            rc = held.popen.poll()
            if rc is None:
                return None
        elif proctree.alive(info.get("launcher_pid"), info.get("launcher_starttime")):
            return None
        else:
            rc = None
        return self._ended(handle, rc)

    def _ended(self, handle: Handle, launcher_rc: int | None) -> Exit:
        rec = _run_dir(handle).read_exit(handle.info.get("attempt"))
        if rec is not None:
            return exit_from_record(rec)
        # No record: the launcher was killed, or the disk refused even the reserved space.
        self._stop_tree(handle, signal.SIGKILL)
        if handle.obj.released is False:
            return Exit(exit_code=None, ran=False)  # never let go: whatever its exit code, nothing ran
        if launcher_rc is None or launcher_rc < 0 or handle.obj.released is None:
            return Exit(exit_code=None, unknown=True)
        if launcher_rc > 128:  # the launcher mirrors the job's status when it cannot write it
            return Exit(exit_code=None, signal=launcher_rc - 128, oom=None)
        return Exit(exit_code=launcher_rc)

    # ------------------------------------------------------------ stop
    def terminate(self, handle: Handle) -> None:
        self._stop_tree(handle, signal.SIGTERM)

    def kill(self, handle: Handle) -> None:
        self._stop_tree(handle, signal.SIGKILL)

    def _stop_tree(self, handle: Handle, sig: int) -> int:
        return stop_attempt(handle.info, sig)

    def cleanup(self, handle: Handle) -> None:
        held: _Held = handle.obj
        held.close_go(False)
        self._stop_tree(handle, signal.SIGKILL)  # nothing should be left; be sure
        if held.popen is not None:
            _wait(held.popen, 5.0)
        if handle.info.get("cgroup"):
            cg = proctree.Cgroup(handle.info["cgroup"])
            cg.wait_empty(2.0)
            cg.remove()

    # ------------------------------------------------------------ after a crash
    def recover(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> Recovered:
        rec = run_dir.read_exit(attempt)
        if not info or not info.get("launcher_pid"):
            # Never recorded: its child (if one was made) was held and reads EOF on its go pipe.
            return Recovered("never_ran", message="the worker died before the attempt started")
        info = {**info, "attempt": attempt, "run_dir": str(run_dir.path), "job_id": job_id}
        if proctree.alive(info["launcher_pid"], info.get("launcher_starttime")):
            handle = Handle(pid=info.get("pid"), pgid=info.get("pgid"), info=info, obj=_Held(None, None))
            return Recovered("running", handle=handle)
        if rec is None:
            return Recovered("lost", message="the attempt's launcher died with the worker and left no exit record")
        ex = exit_from_record(rec)
        if not ex.ran:
            return Recovered("never_ran", message="the worker died before letting the attempt run")
        return Recovered("ended", exit=ex)

    def reap(self, job_id: str, attempt: int, info: dict[str, Any] | None, run_dir: RunDir) -> int:
        info = dict(info or {})
        info.update(job_id=job_id, attempt=attempt)
        if not info.get("cgroup") and self.cgroup_root:  # made, then the worker died before recording it
            path = os.path.join(self.cgroup_root, _cgroup_name(job_id, attempt))
            info["cgroup"] = path if os.path.isdir(path) else None
        n = stop_attempt(info, signal.SIGKILL, tagged=True)
        if info.get("cgroup"):
            cg = proctree.Cgroup(info["cgroup"])
            cg.wait_empty(2.0)
            cg.remove()
        return n

    def sweep(self, keep: Any) -> int:
        """Remove the cgroups of attempts that ended while their worker could not clean up.

        `keep(job_id, attempt)` is False for attempts this worker's store has settled; cgroups of
        other workers' jobs (unknown ids) and of live attempts are left alone. Returns how many went.
        """
        root = self.cgroup_root
        if not root:
            return 0
        removed = 0
        for name in os.listdir(root):
            job_id, dot, number = name.rpartition(".")
            if not dot or not number.isdigit() or keep(job_id, int(number)):
                continue
            cg = proctree.Cgroup(os.path.join(root, name))
            if cg.procs():
                cg.kill()
                cg.wait_empty(2.0)
            removed += cg.remove()
        return removed


def stop_attempt(info: dict[str, Any], sig: int, *, tagged: bool = False) -> int:
    """Send `sig` to every process of the attempt described by `info`; returns how many got it.

    The cgroup when there is one (SIGKILL through cgroup.kill, atomic against forks); else the
    launcher's subtree, the job's process group, and with `tagged` every process carrying the
    attempt's environment tags. The launcher itself is spared: it records the exit.
    """
    launcher = info.get("launcher_pid")
    launcher_alive = proctree.alive(launcher, info.get("launcher_starttime"))
    pids: set[int] = set()
    cg_path = info.get("cgroup")
    if cg_path:
        cg = proctree.Cgroup(cg_path)
        if sig == signal.SIGKILL and cg.procs():
            cg.kill()
        pids.update(cg.procs())
    if launcher_alive:
        pids.update(proctree.descendants(launcher))
    pgid = info.get("pgid")
    if pgid and pgid > 1 and pgid != os.getpgrp():
        leader = proctree.proc_stat(pgid)
        # The group is ours if its leader is the job's process, or gone (its members may not be).
        if leader is None or leader.state == "Z" or leader.starttime == info.get("starttime"):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    if tagged and info.get("job_id") and info.get("attempt"):
        pids.update(proctree.find_tagged(info["job_id"], int(info["attempt"])))
    pids.discard(launcher or -1)
    return proctree.signal_pids(sorted(pids), sig)


def exit_from_record(rec: dict[str, Any]) -> Exit:
    """An `Exit` from exit.json, trusting only well-typed fields (the job could have written it)."""

    def _int(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    report = rec.get("report") if isinstance(rec.get("report"), dict) else None
    setup = rec.get("setup_error") if isinstance(rec.get("setup_error"), str) else None
    oom = rec.get("oom") if isinstance(rec.get("oom"), bool) else None
    code, sig = _int(rec.get("exit_code")), _int(rec.get("signal"))
    if code is None and sig is None:
        code = -1
    return Exit(exit_code=code, signal=sig, oom=oom, ran=rec.get("ran") is not False, setup_error=setup,
                report=report, fenced=rec.get("fenced") == "lease")


def _cgroup_name(job_id: str, attempt: int) -> str:
    return f"{job_id}.{attempt}"


def _run_dir(handle: Handle) -> RunDir:
    return RunDir(handle.info["run_dir"])


def _read_info(fd: int, popen: subprocess.Popen[bytes] | WarmPopen) -> dict[str, Any]:
    data = b""
    deadline = time.monotonic() + INFO_TIMEOUT_S
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            popen.kill()
            raise SetupFailed(f"the launcher did not start within {INFO_TIMEOUT_S:.0f}s")
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            code = _wait(popen, 5.0)
            raise SetupFailed(f"the launcher exited ({code}) before starting the job; see output.log")
        data += chunk
    try:
        info = json.loads(data)
    except ValueError:
        raise SetupFailed(f"the launcher sent {data[:80]!r}") from None
    return info


def _wait(popen: subprocess.Popen[bytes] | WarmPopen, timeout: float) -> int | None:
    try:
        return popen.wait(timeout)
    except subprocess.TimeoutExpired:
        popen.kill()
        return popen.wait()
