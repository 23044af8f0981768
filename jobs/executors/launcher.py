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
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import stat
import sys
import time

import proctree  # the sibling file jobs/executors/proctree.py (this directory is sys.path[0])

PR_SET_CHILD_SUBREAPER = 36
EXIT_RESERVE = 8192  # bytes kept for exit.json; the record is far smaller
NOGO = b"nogo"
SETUP = b"setup:"


def _subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _child(args: argparse.Namespace, argv: list[str], go_fd: int, err_w: int) -> None:
    """In the forked child: join the cgroup, wait for go, exec. Never returns."""
    try:
        os.setpgid(0, 0)
        if args.cgroup:
            proctree.Cgroup(args.cgroup).join(0)
        os.umask(args.umask)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE/SIGXFSZ; the job must not inherit that
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="launcher.py")
    p.add_argument("--go-fd", type=int, required=True)
    p.add_argument("--info-fd", type=int, required=True)
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
        os.close(args.info_fd)
        _child(args, cmd, args.go_fd, err_w)
    os.close(err_w)
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
    try:
        os.write(args.info_fd, (json.dumps(info) + "\n").encode())
    except OSError:
        pass  # the worker is gone: the child will read EOF on its go pipe
    os.close(args.info_fd)

    started = time.time()
    while True:
        try:
            wpid, status = os.waitpid(pid, 0)
        except InterruptedError:
            continue
        if wpid == pid:
            break
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
    _write_exit(args.run_dir, tmp_name, reserved, record)
    if record["signal"] is not None:
        return 128 + record["signal"]
    return record["exit_code"] or 0


if __name__ == "__main__":
    sys.exit(main())
