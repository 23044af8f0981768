"""Finding and stopping every process of an attempt: a cgroup v2 where the kernel lets us, else
the launcher's subtree (it is a child subreaper, so setsid and double-fork orphans stay in it).

Stdlib only and free of package imports on purpose: the launcher (`launcher.py`, run as a plain
script with `python -S`) imports this file as a sibling module.

Identity is (pid, start time in clock ticks since boot) from /proc/<pid>/stat: a pid alone can be
reused by an unrelated process after a crash; the pair cannot.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["ProcStat", "proc_stat", "alive", "children_map", "descendants", "signal_pids", "Cgroup",
           "cgroup_root", "vmstat_oom_kills", "find_tagged"]


class ProcStat(tuple):
    """(state, ppid, pgid, starttime) of a process, from /proc/<pid>/stat."""

    state = property(lambda self: self[0])
    ppid = property(lambda self: self[1])
    pgid = property(lambda self: self[2])
    starttime = property(lambda self: self[3])


def proc_stat(pid: int) -> ProcStat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()  # the command name may hold spaces and parens
    try:
        return ProcStat((rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[19])))
    except (IndexError, ValueError):
        return None


def alive(pid: int | None, starttime: int | None = None) -> bool:
    """Is `pid` running (not a zombie) and, when `starttime` is given, the same process as then?"""
    if not pid or pid <= 0:
        return False
    st = proc_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return starttime is None or st.starttime == starttime


def _pids() -> list[int]:
    try:
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return []


def children_map() -> dict[int, list[int]]:
    """ppid -> live child pids, for every process we can see."""
    out: dict[int, list[int]] = {}
    for pid in _pids():
        st = proc_stat(pid)
        if st is not None and st.state not in ("Z", "X"):
            out.setdefault(st.ppid, []).append(pid)
    return out


def descendants(root: int) -> list[int]:
    """Every live process below `root` (not `root` itself), parents before children."""
    kids = children_map()
    out: list[int] = []
    todo = list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, ()))
    return out


def signal_pids(pids: list[int], sig: int) -> int:
    """Send `sig` to each pid that still exists; returns how many got it."""
    sent = 0
    me = os.getpid()
    for pid in pids:
        if pid <= 1 or pid == me:
            continue
        try:
            os.kill(pid, sig)
            sent += 1
        except (ProcessLookupError, PermissionError):
            pass
    return sent


def vmstat_oom_kills() -> int | None:
    """The host's count of kernel OOM kills so far (/proc/vmstat oom_kill), None if unknown."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def find_tagged(job_id: str, attempt: int) -> list[int]:
    """Live processes whose environment carries this attempt's OFFLOAD_JOBS_JOB_ID and ATTEMPT.

    The last resort after a crash that lost the launcher too: every job process inherits these
    two variables, so they find it wherever it was reparented.
    """
    want_id = f"OFFLOAD_JOBS_JOB_ID={job_id}".encode()
    want_n = f"OFFLOAD_JOBS_ATTEMPT={attempt}".encode()
    me = os.getpid()
    found = []
    for pid in _pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if want_id in env and want_n in env and alive(pid):
            found.append(pid)
    return found


# ---------------------------------------------------------------- cgroup v2


def _cgroup2_mount() -> str | None:
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split(" ", 1)[0] == "cgroup2":
                    return left.split()[4]
    except OSError:
        pass
    return None


def _own_cgroup2_path() -> str | None:
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def cgroup_root(name: str = "offload-jobs") -> str | None:
    """A writable cgroup v2 directory for our attempts (made here, below our own cgroup), or None.

    None when there is no cgroup2 mount, or we may not create or join cgroups in it (not root,
    no delegation, a read-only mount in a container): then the launcher's subreaper is used.
    """
    if os.environ.get("OFFLOAD_JOBS_NO_CGROUP"):
        return None
    mount, own = _cgroup2_mount(), _own_cgroup2_path()
    if mount is None or own is None:
        return None
    base = os.path.join(mount, own.lstrip("/"), name)
    try:
        os.makedirs(base, exist_ok=True)
        probe = os.path.join(base, f"probe-{os.getpid()}")
        os.mkdir(probe)
        try:
            if not os.path.exists(os.path.join(probe, "cgroup.kill")):
                return None  # kernel < 5.14: no atomic kill; the subreaper does better
            with open(os.path.join(probe, "cgroup.procs"), "r"):
                pass
        finally:
            os.rmdir(probe)
    except OSError:
        return None
    try:  # memory.events (oom_kill) for each attempt, where the parent delegates the controller
        with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
    except OSError:
        pass
    return base


class Cgroup:
    """One attempt's cgroup v2 directory."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, root: str, name: str) -> "Cgroup":
        path = os.path.join(root, name)
        os.makedirs(path, exist_ok=True)
        return cls(path)

    def exists(self) -> bool:
        return os.path.isdir(self.path)

    def join(self, pid: int = 0) -> None:
        """Move `pid` (0: the caller) into this cgroup."""
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def procs(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs"), "r") as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill(self) -> bool:
        """SIGKILL every process in it, atomically with respect to forks (cgroup.kill)."""
        try:
            with open(os.path.join(self.path, "cgroup.kill"), "w") as f:
                f.write("1")
            return True
        except OSError:
            return signal_pids(self.procs(), signal.SIGKILL) > 0

    def oom_kills(self) -> int | None:
        """The kernel OOM kills inside it (memory.events), None without the memory controller."""
        try:
            with open(os.path.join(self.path, "memory.events"), "r") as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return None

    def wait_empty(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.procs():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def remove(self) -> bool:
        try:
            os.rmdir(self.path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False
