"""Warm starts: the runners' libraries imported once, and each train, infer or shard job forked from there.

A runner job's child spends about 4 s of CPU importing torch, diffusers, transformers and peft before
it reads its spec (measured on a CPU box: `PYTHONPROFILEIMPORTTIME`, tiny train and infer jobs). A
queue of jobs pays that every time. The `process` executor keeps one *warm process* per job
environment instead: `python -m jobs.executors.warm FD`, started with the job's environment
(everything but the per-attempt names: the run dir's paths, the job id and attempt, the batch's
folder), which imports those libraries once and then forks each attempt's launcher on request.

The attempt is the same as a cold one. The launcher runs the same code (`launcher.py`'s `main`, in the
fork rather than from `python -S launcher.py`): its own session, the go pipe, the info pipe, the child
subreaper, the cgroup, exit.json. Only its last step differs: where it would `exec` the runner's
`python -m jobs.runners.<kind>_main RUN_DIR`, the job's process (already holding the libraries) sets
the job's argv, `sys.path[0]`, signals and random seeds as a fresh interpreter has them and runs the
module as `__main__`; at its end it waits for its threads and runs its atexit functions as the
interpreter would. What the libraries read from the environment when imported, they read from the
job's own (the warm process is keyed by it). Anything else (a command job, a job whose `adamw8bit`
needs bitsandbytes, which the warm process keeps out as the runners do) is exec'd as before.

The warm process never starts a thread or touches CUDA: it checks, after its imports, that it has one
thread and no CUDA driver loaded, and refuses to serve otherwise (the executor then starts cold). It
is the parent of the launchers it forks and tells the worker each one's exit status; it leaves when
its socket reads EOF: the worker has exited, or closed it after `IDLE_S` with no request and no
launcher left (the worker decides, under the lock its requests take, so none is sent to a process
on its way out).
`OFFLOAD_JOBS_WARM_START=0` in the worker's environment turns all of this off.
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from jobs.batchdir import BATCH_DIR_ENV, BATCH_ROLE_ENV
from jobs.executors.base import SetupFailed

__all__ = ["WarmPool", "WarmPopen", "WARM_MODULES", "PER_ATTEMPT_ENV", "WARM_ENV", "READY_TIMEOUT_S", "START_WAIT_S",
           "warm_enabled"]

log = logging.getLogger("offload_jobs.executor.warm")

WARM_ENV = "OFFLOAD_JOBS_WARM_START"  # the worker's own: "0" turns warm starts off
WARM_MODULES = frozenset({"jobs.runners.train_main", "jobs.runners.infer_main", "jobs.runners.shard_main"})
# The names that differ between attempts and are read only when the job runs (never at import): left out
# of the warm process's environment and its key, and given to each job's process.
PER_ATTEMPT_ENV = frozenset({
    "OFFLOAD_JOBS_RUN_DIR", "OFFLOAD_JOBS_METRICS", "OFFLOAD_JOBS_OUTPUTS", "OFFLOAD_JOBS_EXIT_REPORT",
    "OFFLOAD_JOBS_JOB_ID", "OFFLOAD_JOBS_ATTEMPT", BATCH_DIR_ENV, BATCH_ROLE_ENV,
    # read when CUDA starts (in the job), never at import; the warm process is checked to hold no CUDA driver
    "CUDA_VISIBLE_DEVICES",
})
POOL_SIZE = 2  # warm processes kept, one per job environment, least recently used leaves first
READY_TIMEOUT_S = 120.0  # the longest a request waits for the warm process's answer
START_WAIT_S = 15.0  # the longest an attempt waits for a new warm process's imports (4-10 s), else it starts cold
IDLE_S = 120.0  # a warm process with no launcher and no request for this long is closed (it exits on EOF)
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch asks NVML, not cuInit, whether CUDA is there
IDLE_CHECK_S = 5.0
MAX_MSG = 1 << 20


def warm_enabled(env: dict[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(WARM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# ---------------------------------------------------------------- the worker's side

class _Zygote:
    """One warm process and the thread that reads what it says."""

    def __init__(self, env: dict[str, str]) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "jobs.executors.warm", str(theirs.fileno())], env=env, cwd="/",
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=None,  # what it prints: the worker's log
                start_new_session=True, close_fds=True, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self.lock = threading.Lock()  # one request at a time
        self.cond = threading.Condition()
        self.replies: list[dict[str, Any]] = []
        self.exits: dict[int, int] = {}  # launcher pid -> wait status, until read
        self.live: set[int] = set()  # launchers it forked that have not ended
        self.dead = False
        self.closed = False
        self.ready: bool | None = None
        self.why = ""
        self.used = time.monotonic()
        threading.Thread(target=self._read, name="warm-reader", daemon=True).start()

    def _read(self) -> None:
        self.sock.settimeout(IDLE_CHECK_S)
        while True:
            try:
                data = self.sock.recv(MAX_MSG)
                msg = json.loads(data) if data else None
            except TimeoutError:
                self._close_if_idle()
                continue
            except (OSError, ValueError):
                msg = None
            with self.cond:
                if msg is None:
                    self.dead = True
                    if self.ready is None:
                        self.ready, self.why = False, "it exited while importing"
                    self.cond.notify_all()
                    break
                if "exit" in msg:
                    self.exits[int(msg["exit"])] = int(msg["status"])
                    self.live.discard(int(msg["exit"]))
                    self.used = time.monotonic()  # idle counts from the last launcher's end too
                elif "ready" in msg:
                    self.ready, self.why = bool(msg["ready"]), str(msg.get("why") or "")
                else:
                    if "pid" in msg:
                        self.live.add(int(msg["pid"]))
                    self.replies.append(msg)
                self.cond.notify_all()
        self.popen.wait()

    def _close_if_idle(self) -> None:
        """The worker, not the warm process, decides it is idle: under the request lock, so no request
        is ever sent to a process on its way out."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            with self.cond:
                idle = self.ready is not None and not self.live and time.monotonic() - self.used > IDLE_S
            if idle:
                self.closed = True
                self.close()
        finally:
            self.lock.release()

    def wait_ready(self, timeout: float) -> bool | None:
        """True when it serves, False when it cannot, None when it is still importing after `timeout`."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready is not None, timeout)
            if self.ready is None:
                return None
            return bool(self.ready) and not self.dead

    def spawn(self, argv: list[str], env: dict[str, str], fds: list[int]) -> int:
        """The pid of a launcher forked with `argv` (its options and the job's command), `env` and `fds`
        (the log, the go pipe's read end, the info pipe's write end)."""
        with self.lock:
            if self.closed or self.dead:
                raise OSError("the warm process has left")  # not sent: the caller starts the launcher cold
            self.used = time.monotonic()
            req = json.dumps({"argv": argv, "env": env}).encode()
            self.sock.sendmsg([req], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            # Sent: a launcher may now exist with these descriptors, so no cold one may start with them.
            with self.cond:
                if not self.cond.wait_for(lambda: self.replies or self.dead, READY_TIMEOUT_S) or not self.replies:
                    self.closed = True
                    self.close()
                    raise SetupFailed("the warm process died before answering (see the worker's log)")
                reply = self.replies.pop(0)
        if "pid" not in reply:  # it did not fork: the descriptors are unused
            raise OSError(str(reply.get("error") or reply))
        return int(reply["pid"])

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class WarmPopen:
    """The part of `subprocess.Popen` the executor uses, for a launcher the warm process forked."""

    def __init__(self, pid: int, zygote: _Zygote, args: list[str]) -> None:
        from jobs.executors import proctree

        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._z = zygote
        st = proctree.proc_stat(pid)  # the launcher waits for its go byte: it cannot have been reaped yet
        self.starttime = st.starttime if st is not None else None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        from jobs.executors import proctree

        with self._z.cond:
            status = self._z.exits.pop(self.pid, None)
            dead = self._z.dead
        if status is not None:
            self.returncode = os.waitstatus_to_exitcode(status)
        elif dead and not proctree.alive(self.pid, self.starttime):
            # The warm process died before telling (it reaps its launchers); the status is not known.
            self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            with self._z.cond:
                self._z.cond.wait(0.05 if left is None else min(left, 0.05))
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        from jobs.executors import proctree

        if self.poll() is None and proctree.alive(self.pid, self.starttime):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class WarmPool:
    """The executor's warm processes, by job environment."""

    def __init__(self, size: int = POOL_SIZE) -> None:
        self.size = size
        self._zygotes: OrderedDict[tuple, _Zygote] = OrderedDict()
        self._refused: set[tuple] = set()
        self._lock = threading.Lock()

    def spawn(self, argv: list[str], env: dict[str, str], fds: list[int],
              wait: float = READY_TIMEOUT_S) -> WarmPopen | None:
        """A launcher forked from the warm process for `env`, or None (start it cold) when there is none,
        or it is still importing after `wait` seconds (it goes on, for the next attempt)."""
        base = {k: v for k, v in env.items() if k not in PER_ATTEMPT_ENV}
        key = tuple(sorted(base.items()))
        with self._lock:
            if key in self._refused:
                return None
            z = self._zygotes.get(key)
            if z is not None and (z.dead or z.closed or z.popen.poll() is not None):
                del self._zygotes[key]
                z = None
            if z is None:
                # Room for one more: close the least recently used that has no launcher left to report on;
                # if every one has, this attempt starts cold.
                idle = [k for k, old in self._zygotes.items() if not old.live]
                if len(self._zygotes) - len(idle) >= self.size:
                    return None
                while len(self._zygotes) >= self.size:
                    old = self._zygotes.pop(idle.pop(0))
                    with old.lock:
                        old.closed = True
                        old.close()
                try:
                    z = _Zygote(base)
                except OSError as exc:
                    log.warning("no warm process (%s); starting jobs cold", exc)
                    self._refused.add(key)
                    return None
                self._zygotes[key] = z
            self._zygotes.move_to_end(key)
        ready = z.wait_ready(wait)
        if ready is None:
            return None
        if not ready:
            log.warning("the warm process cannot serve (%s); starting these jobs cold", z.why or "no answer")
            with self._lock:
                self._refused.add(key)
                if self._zygotes.get(key) is z:
                    del self._zygotes[key]
            z.close()
            return None
        try:
            pid = z.spawn(argv, env, fds)
        except OSError as exc:  # not sent, or refused before forking (SetupFailed passes through)
            log.warning("the warm process could not start a launcher (%s); starting it cold", exc)
            return None
        return WarmPopen(pid, z, argv)

    def close(self) -> None:
        with self._lock:
            for z in self._zygotes.values():
                z.close()
            self._zygotes.clear()


# ---------------------------------------------------------------- the warm process

def _threads() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return {str(t) for t in range(threading.active_count())}


def _preload() -> set[str]:
    """Import what the runners import, as they do (collector off, bitsandbytes hidden, frozen after).
    Returns the ids of the threads a fork may leave behind: the BLAS libraries' (numpy's OpenBLAS,
    and scipy's own copy that peft's import loads), whose thread servers stop themselves before a
    fork and start again after (OpenBLAS's pthread_atfork handlers), and NVML's helper.

    The imports must not start the CUDA driver (a forked child could not use it): diffusers asks
    ``torch.accelerator.is_available()`` at import (``torch_utils.torch_device``), which runs cuInit
    unless torch asks NVML instead, so they run with ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (torch's
    switch for fork-safe checks; a fork uses CUDA after it, measured on an H100), NVML asked first
    so its helper thread is known, and the answer diffusers caches is dropped after."""
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # as _entry.hide_unused_packages
    from jobs.runners._entry import imports_without_gc

    before = _threads()
    import numpy  # noqa: F401  (torch imports it first thing anyway)

    try:
        import scipy.linalg  # noqa: F401  (peft imports it; its OpenBLAS starts its threads here)
    except ImportError:
        pass
    nvml = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"
    try:
        with imports_without_gc():
            import torch

            torch.cuda.is_available()  # through NVML: its helper thread starts here
            allowed = _threads() - before
            import peft  # noqa: F401

            import offload_core  # noqa: F401
            import offload_core.disk  # noqa: F401
            import offload_core.shard  # noqa: F401
            import jobs.runners.convert  # noqa: F401
            import jobs.runners.cosched  # noqa: F401
            import jobs.runners.infer  # noqa: F401
            import jobs.runners.train  # noqa: F401
            from jobs.runners.families import ADAPTERS

            for adapter in ADAPTERS.values():
                adapter.classes()
    finally:
        if nvml is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = nvml
    _forget_device_answers()
    return allowed


def _forget_device_answers() -> None:
    """Drop the device answers the imports cached, so a job (its own CUDA_VISIBLE_DEVICES) asks afresh."""
    try:
        from diffusers.utils.torch_utils import TorchDeviceBackend

        TorchDeviceBackend._detect_device_type.cache_clear()
    except (ImportError, AttributeError):
        pass


def _unsafe(allowed: set[str]) -> str:
    """Why forking this process would not give a job what a fresh interpreter gives it, or ''.

    A started CUDA driver is unusable in a fork. Any thread but the main one, the BLAS libraries' and
    NVML's (an OpenMP pool that ran, a library's helper, the driver's own) would be
    missing in the fork, or hold a lock it never releases there: a forked torch whose OpenMP pool had
    run hangs at its first parallel op (measured), so such a process never serves.
    """
    if _cuda_started():
        return "the CUDA driver was started by the imports"
    others = _threads() - allowed - {str(os.getpid())}
    if others or threading.active_count() != 1:
        return f"{len(others)} threads besides the main one after the imports"
    return ""


def _cuda_started() -> bool:
    """Whether torch started the CUDA driver here: then it marks a fork of this process as unable to
    use CUDA (``torch.cuda._is_in_bad_fork``), which a throwaway fork asks."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return False
    if torch.cuda.is_initialized():
        return True
    pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def _load_launcher() -> Any:
    import importlib.util

    from jobs.executors.process import LAUNCHER

    sys.path.insert(0, str(LAUNCHER.parent))  # launcher.py imports its sibling proctree.py
    try:
        spec = importlib.util.spec_from_file_location("offload_jobs_launcher", LAUNCHER)
        mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(mod)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(LAUNCHER.parent))
    mod.WARM_RUN = run_job
    return mod


def run_job(argv: list[str], err_w: int) -> None:
    """In the job's process, where the launcher would exec `argv`: run it here if it is a runner module
    of this interpreter; else return (and the launcher execs it). Never returns after starting it."""
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m" or argv[2] not in WARM_MODULES:
        return
    import atexit
    import random
    import runpy
    import traceback

    os.close(err_w)  # as exec would (close-on-exec): the launcher reads its EOF
    # A fresh interpreter's signals: Python's SIGINT handler, SIGPIPE and SIGXFSZ ignored, the rest default.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    random.seed()  # a fresh interpreter seeds from the OS; a fork would share the warm process's state
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
    sys.argv = [argv[2], *argv[3:]]  # run_module sets argv[0] to the module's file
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    code: int = 0
    interrupted = False
    try:
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:  # noqa: BLE001 - the interpreter hands it to sys.excepthook and exits 1
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter does at exit: wait for non-daemon threads, then the atexit functions.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:  # what C code printed (libc's buffers, which exit() would flush and os._exit does not)
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    if interrupted:  # as CPython does for an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130
    os._exit(code & 0xFF)


def _spawn(req: dict[str, Any], fds: list[int], closing: list[int], launcher: Any) -> int:
    log_fd, go_r, info_w = fds
    pid = os.fork()
    if pid:
        return pid
    code = 126
    try:
        os.setsid()  # as the worker's Popen(start_new_session=True)
        signal.set_wakeup_fd(-1)  # before its pipe closes
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in closing:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        os.environ.clear()
        os.environ.update(req["env"])
        code = launcher.main(["--go-fd", str(go_r), "--info-fd", str(info_w), *req["argv"]])
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code if isinstance(code, int) else 1)
    return 0  # never reached


def serve(fd: int) -> int:
    sock = socket.socket(fileno=fd)
    try:
        why = _unsafe(_preload())
        launcher = None if why else _load_launcher()
    except BaseException as exc:  # noqa: BLE001
        why, launcher = f"{type(exc).__name__}: {exc}", None
    sock.send(json.dumps({"ready": not why, "why": why}).encode())
    if why:
        return 1
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)
    children: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [], 5.0)
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        while children:  # reap the launchers that ended and tell the worker
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            try:
                sock.send(json.dumps({"exit": pid, "status": status}).encode())
            except OSError:
                pass
        if sock in ready:
            try:
                msg, anc, _flags, _addr = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(3 * array.array("i").itemsize))
            except OSError:
                msg, anc = b"", []
            if not msg:
                return 0  # the worker is gone; the launchers run on without us (as they do without it)
            fds: list[int] = []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    fds.extend(a)
            try:
                req = json.loads(msg)
                if len(fds) != 3:
                    raise ValueError(f"{len(fds)} descriptors, not 3")
                pid = _spawn(req, fds, [sock.fileno(), wake_r, wake_w], launcher)
                children.add(pid)
                reply: dict[str, Any] = {"pid": pid}
            except (OSError, ValueError, KeyError, TypeError) as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                for f in fds:
                    os.close(f)
            try:
                sock.send(json.dumps(reply).encode())
            except OSError:
                return 0  # the worker is gone


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
