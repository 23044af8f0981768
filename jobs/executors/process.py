"""The `process` executor: each attempt is a child in its own process group (own session).

The child's stdout and stderr are output.log itself (opened O_APPEND), so no line passes through
the worker and none is lost when the worker dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

import psutil

from jobs.executors.base import Executor, Exit, Handle, Launch, SetupFailed

__all__ = ["ProcessExecutor"]


class ProcessExecutor(Executor):
    name = "process"

    def start(self, launch: Launch) -> Handle:
        env = dict(launch.env)
        if launch.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in launch.gpus)
        log = open(launch.run_dir.log_file, "ab", buffering=0)
        try:
            proc = subprocess.Popen(
                launch.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=launch.cwd, env=env, start_new_session=True, close_fds=True,
            )
        except (OSError, ValueError) as exc:
            raise SetupFailed(f"cannot start {launch.argv[0]!r}: {exc}") from None
        finally:
            log.close()  # the child holds its own descriptor
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = None
        info = {"pid": proc.pid, "pgid": proc.pid, "create_time": create_time}
        return Handle(pid=proc.pid, pgid=proc.pid, info=info, obj=proc)

    def poll(self, handle: Handle) -> Exit | None:
        rc = handle.obj.poll()
        if rc is None:
            return None
        if rc < 0:
            return Exit(exit_code=None, signal=-rc)
        return Exit(exit_code=rc)

    def terminate(self, handle: Handle) -> None:
        _killpg(handle.pgid, signal.SIGTERM)

    def kill(self, handle: Handle) -> None:
        _killpg(handle.pgid, signal.SIGKILL)

    def cleanup(self, handle: Handle) -> None:
        # Background children outlive their leader; the job's tree ends with the job.
        _killpg(handle.pgid, signal.SIGKILL)

    def kill_orphan(self, info: dict[str, Any], pid: int | None, pgid: int | None) -> bool:
        pid = pid or info.get("pid")
        pgid = pgid or info.get("pgid") or pid
        if not pgid:
            return False
        if pid:
            try:
                p = psutil.Process(pid)
                ct = info.get("create_time")
                if ct is not None and abs(p.create_time() - ct) > 1.0:
                    return False  # the pid was reused by an unrelated process
            except psutil.NoSuchProcess:
                pass  # the leader is gone; members of its group may not be
            except psutil.Error:
                return False
        return _killpg(pgid, signal.SIGKILL)


def _killpg(pgid: int | None, sig: int) -> bool:
    if not pgid or pgid <= 1 or pgid == os.getpgrp():
        return False  # never signal our own group or init
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
