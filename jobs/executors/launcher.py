"""The launcher: the first process of every `process` attempt, between the worker and the job.

Run as `python -S -E launcher.py --go-fd R --info-fd W ... -- ARGV` (a plain script, stdlib only,
about 25 ms to start). In order:

1. It becomes a child subreaper, so descendants that setsid or double-fork are reparented to it,
   not to init, and are found and stopped with the attempt.
2. It forks the job's process, which joins the attempt's cgroup (when there is one), enters its
   own process group, and then blocks on the go pipe.
3. It writes its identity (its pid and start time, the child's pid) to the info pipe and closes
   it. The worker records that identity in the store, and only then writes the go byte.
   If the worker dies before that, the go pipe reads EOF and the job exits without running:
   nothing unrecorded ever runs.
4. It waits for the job, stops whatever the job left behind, and writes `exit.json`
   atomically (into space it reserved before the job started, so a full disk cannot lose it),
   then exits with the job's status. A job that ended while no worker was watching is thus
   recorded as it really ended, never as lost.

On a shared store (workers on several hosts) the worker also passes `--lease-file`: a small JSON
file it rewrites after every heartbeat the store accepted, `{"until": <CLOCK_MONOTONIC s>,
"grace": s}`. `until` comes before the lease runs out in the store, so when the worker dies or is
cut off, the launcher itself stops the job (SIGTERM at `until - grace`, SIGKILL at `until`) before
any other worker's reaper may retry it: a job never runs on two hosts at once, even when its
worker cannot say so. exit.json then says `"fenced": "lease"`.

Under Slurm (`--forward-signals`, no go or info pipe: sbatch --hold is the hold), a SIGTERM or
SIGUSR1 to the launcher (Slurm's `--signal=B:TERM@N` before the time limit, or scancel) is passed
to the job's processes as SIGTERM, and exit.json names it (`"signalled"`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import stat
import sys
import time

import proctree  # the sibling file jobs/executors/proctree.py (this directory is sys.path[0])

PR_SET_CHILD_SUBREAPER = 36
EXIT_RESERVE = 8192  # bytes kept for exit.json; the record is far smaller
NOGO = b"nogo"
SETUP = b"setup:"
# Set by the warm process (jobs/executors/warm.py), which runs this file's `main` in a fork of itself:
# called in the job's process where the launcher would exec, it runs a runner module there and never
# returns; for any other command it returns and the exec goes ahead.
WARM_RUN = None


def _subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _child(args: argparse.Namespace, argv: list[str], go_fd: int | None, err_w: int) -> None:
    """In the forked child: join the cgroup, wait for go, exec. Never returns."""
    try:
        os.setpgid(0, 0)
        if args.cgroup:
            proctree.Cgroup(args.cgroup).join(0)
        os.umask(args.umask)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE/SIGXFSZ; the job must not inherit that
        if go_fd is not None:
            got = os.read(go_fd, 1)
            os.close(go_fd)
            if got != b"g":  # EOF: the worker died (or refused) before recording us
                os.write(err_w, NOGO)
                os._exit(0)
        if args.cwd:
            try:
                os.chdir(args.cwd)
            except OSError as exc:
                os.write(err_w, SETUP + f"workdir {args.cwd}: {exc.strerror}".encode())
                os._exit(126)
        if WARM_RUN is not None:
            WARM_RUN(argv, err_w)
        try:
            os.execvpe(argv[0], argv, os.environ)
        except OSError as exc:
            os.write(err_w, SETUP + f"cannot start {argv[0]!r}: {exc.strerror or exc}".encode())
            os._exit(127)
    except BaseException as exc:  # never fall back into the launcher's code in the child
        try:
            os.write(err_w, SETUP + f"launcher: {type(exc).__name__}: {exc}".encode())
        finally:
            os._exit(126)


def _reserve(run_dir: str, name: str) -> int | None:
    """An fd of a hidden file with EXIT_RESERVE bytes already allocated, or None."""
    try:
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                pass
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            os.posix_fallocate(fd, 0, EXIT_RESERVE)
        except OSError:
            try:
                os.pwrite(fd, b" " * EXIT_RESERVE, 0)
            except OSError:
                pass  # no space now; the final write may still find some
        return fd
    except OSError:
        return None


def _write_exit(run_dir: str, tmp_name: str, fd: int | None, record: dict) -> bool:
    data = json.dumps(record, allow_nan=False).encode()
    try:
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if fd is None:
            fd = os.open(tmp_name, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        os.pwrite(fd, data, 0)  # into the reserved blocks: no allocation needed
        os.ftruncate(fd, len(data))
        os.fsync(fd)
        os.close(fd)
        os.replace(tmp_name, "exit.json", src_dir_fd=dfd, dst_dir_fd=dfd)
        os.fsync(dfd)
        return True
    except OSError as exc:
        print(f"[offload-jobs] launcher: could not write exit.json: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        os.close(dfd)


def _read_report(run_dir: str) -> dict | None:
    try:
        dfd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fd = os.open("report.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        finally:
            os.close(dfd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
        rep = json.loads(data, parse_constant=lambda _c: None)
    except (OSError, ValueError):
        return None
    if not isinstance(rep, dict):
        return None
    return {k: rep[k] for k in ("reason", "message") if isinstance(rep.get(k), str)}


def _stop_leftovers(cgroup: proctree.Cgroup | None, timeout: float = 5.0) -> None:
    """SIGKILL what the job left behind and reap it (we are its subreaper)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cgroup is not None:
            if cgroup.procs():
                cgroup.kill()
        proctree.signal_pids(proctree.descendants(os.getpid()), signal.SIGKILL)
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
        except ChildProcessError:
            if cgroup is None or not cgroup.procs():
                return
        time.sleep(0.01)


class _Lease:
    """The worker's lease file, read at most every READ_EVERY_S; a bad read keeps the last good value."""

    READ_EVERY_S = 0.2

    def __init__(self, path: str) -> None:
        self.path = path
        self.until: float | None = None
        self.grace = 0.0
        self.read_at = 0.0
        self.termed = False
        self.killed = False
        self.read(force=True)

    def read(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.read_at < self.READ_EVERY_S:
            return
        self.read_at = now
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                data = json.loads(os.read(fd, 4096))
            finally:
                os.close(fd)
            until, grace = float(data["until"]), float(data.get("grace") or 0.0)
        except (OSError, ValueError, KeyError, TypeError):
            return
        self.until, self.grace = until, max(0.0, grace)

    def step(self, cgroup: proctree.Cgroup | None) -> None:
        """Stop the job's tree when the lease is about to run out (TERM) or has (KILL)."""
        self.read()
        if self.until is None or self.killed:
            return
        now = time.monotonic()
        if now >= self.until:
            self.killed = True
            _signal_tree(cgroup, signal.SIGKILL)
            print("[offload-jobs] launcher: the worker's lease ran out; job killed", file=sys.stderr, flush=True)
        elif now >= self.until - self.grace and not self.termed:
            self.termed = True
            _signal_tree(cgroup, signal.SIGTERM)
            print("[offload-jobs] launcher: the worker stopped renewing its lease on the store; stopping the job "
                  f"(SIGTERM, SIGKILL in {self.until - now:.1f}s)", file=sys.stderr, flush=True)


def _signal_tree(cgroup: proctree.Cgroup | None, sig: int) -> None:
    """`sig` to every process below the launcher (and in the attempt's cgroup)."""
    if cgroup is not None:
        if sig == signal.SIGKILL and cgroup.procs():
            cgroup.kill()
        proctree.signal_pids([p for p in cgroup.procs() if p != os.getpid()], sig)
    proctree.signal_pids(proctree.descendants(os.getpid()), sig)


def _wait(pid: int, lease: _Lease | None, cgroup: proctree.Cgroup | None) -> int:
    """The child's wait status; with a lease, checked between short waits."""
    if lease is None:
        while True:
            try:
                wpid, status = os.waitpid(pid, 0)
            except InterruptedError:
                continue
            if wpid == pid:
                return status
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        while True:
            wpid, status = os.waitpid(pid, os.WNOHANG)
            if wpid == pid:
                return status
            lease.step(cgroup)
            if pidfd is not None:
                select.select([pidfd], [], [], 0.1)
            else:
                time.sleep(0.05)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launcher.py")
    p.add_argument("--go-fd", type=int, default=None)
    p.add_argument("--info-fd", type=int, default=None)
    p.add_argument("--lease-file", default=None)
    p.add_argument("--forward-signals", action="store_true")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--job-id", required=True)
    p.add_argument("--attempt", type=int, required=True)
    p.add_argument("--cgroup", default=None)
    p.add_argument("--cwd", default=None)
    p.add_argument("--umask", type=lambda s: int(s, 8), default=0o022)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("[offload-jobs] launcher: no command", file=sys.stderr)
        return 2

    # The worker's signals are for the job, which it reaches directly; a stray one must not
    # take the launcher down and lose the exit record.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: None)
    forwarded: list[str] = []
    child_pid: list[int] = []
    if args.forward_signals:
        def forward(signum: int, frame: object) -> None:
            forwarded.append(signal.Signals(signum).name)
            if child_pid:
                try:
                    os.killpg(child_pid[0], signal.SIGTERM)
                except OSError:
                    pass

        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, forward)
    subreaper = _subreaper()
    tmp_name = f".exit.json.{args.attempt}.tmp"
    reserved = _reserve(args.run_dir, tmp_name)
    cgroup = proctree.Cgroup(args.cgroup) if args.cgroup else None
    oom_before = proctree.vmstat_oom_kills()
    cg_oom_before = cgroup.oom_kills() if cgroup is not None else None

    err_r, err_w = os.pipe()  # the child's setup errors; close-on-exec, so EOF once it execs
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        if args.info_fd is not None:
            os.close(args.info_fd)
        if reserved is not None:  # the exit record's space is the launcher's (exec would close it too)
            os.close(reserved)
        _child(args, cmd, args.go_fd, err_w)
    child_pid.append(pid)
    os.close(err_w)
    if args.go_fd is not None:
        os.close(args.go_fd)
    try:  # also from this side, so both hold before the identity is reported (no race with the child)
        os.setpgid(pid, pid)
    except OSError:
        pass
    if cgroup is not None:
        try:
            cgroup.join(pid)
        except OSError:
            pass
    me = proctree.proc_stat(os.getpid())
    child = proctree.proc_stat(pid)
    info = {"pid": os.getpid(), "starttime": me.starttime if me else None, "child": pid,
            "child_starttime": child.starttime if child else None, "subreaper": subreaper}
    if args.info_fd is not None:
        try:
            os.write(args.info_fd, (json.dumps(info) + "\n").encode())
        except OSError:
            pass  # the worker is gone: the child will read EOF on its go pipe
        os.close(args.info_fd)

    started = time.time()
    lease = _Lease(args.lease_file) if args.lease_file else None
    status = _wait(pid, lease, cgroup)
    finished = time.time()
    err = b""
    while chunk := os.read(err_r, 4096):
        err += chunk
    os.close(err_r)
    _stop_leftovers(cgroup)

    record: dict = {"job_id": args.job_id, "attempt": args.attempt, "ran": err != NOGO, "pid": pid,
                    "exit_code": None, "signal": None, "oom": None, "started_at": started, "finished_at": finished}
    if os.WIFSIGNALED(status):
        record["signal"] = os.WTERMSIG(status)
    else:
        record["exit_code"] = os.WEXITSTATUS(status)
    if err.startswith(SETUP):
        record["setup_error"] = err[len(SETUP):].decode("utf-8", "replace")
    killed = record["signal"] == signal.SIGKILL or record["exit_code"] == 128 + signal.SIGKILL
    if killed:
        cg_after = cgroup.oom_kills() if cgroup is not None else None
        if cg_after is not None and cg_oom_before is not None:
            record["oom"] = cg_after > cg_oom_before
        else:
            after = proctree.vmstat_oom_kills()
            record["oom"] = None if after is None or oom_before is None else after > oom_before
    if record["ran"]:
        record["report"] = _read_report(args.run_dir)
    if lease is not None and (lease.termed or lease.killed):
        record["fenced"] = "lease"
    if forwarded:
        record["signalled"] = forwarded[0]
    _write_exit(args.run_dir, tmp_name, reserved, record)
    if record["signal"] is not None:
        return 128 + record["signal"]
    return record["exit_code"] or 0


if __name__ == "__main__":
    sys.exit(main())
