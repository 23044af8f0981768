"""`RunDir`: the files of one job, `runs/<id>/` under the state dir.

    spec.yaml     the validated spec as submitted
    output.log    stdout+stderr of every attempt, appended by the child itself (survives restarts)
    metrics.jsonl one JSON object per line, written by the job
    events.jsonl  the job's status changes, one JSON object per line
    report.json   optional report of the job itself ({"reason": "cuda_oom", "message": ...})
    exit.json     how the last attempt ended, written atomically by its launcher (process executor)
    stop.json     why the worker is stopping the current attempt (cancelled, timeout, shutdown)
    outputs/      what the job produces

The job can write anything in its run dir (for `executor: docker` the directory is bind-mounted
into the container), so the worker, which may be root, treats every name in it as hostile: it
opens files relative to the directory's own descriptor with O_NOFOLLOW, never blocks on a FIFO,
and reads or appends only regular files with one link. A symlink planted as `output.log` is
refused, never followed.

Every read of a run dir by the worker's API, `report` and the shipping of output goes through
`_open` (O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file with one link) and `_read_fd`
(bounded bytes, bounded time): a FIFO, a device, a symlink or a hard link planted by the job is a
`RunDirError` naming the file, answered at once, never a thread blocked for good.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jobs import strict_json
from jobs.errors import RunDirError

__all__ = ["RunDir", "utf8_safe_end", "EXIT_FILE", "REPORT_FILE", "MAX_READ", "READ_DEADLINE_S"]

log = logging.getLogger("offload_jobs.rundir")

EXIT_FILE = "exit.json"
REPORT_FILE = "report.json"
STOP_FILE = "stop.json"
_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
MAX_READ = 64 << 20  # no single read of a run-dir file returns more
READ_DEADLINE_S = 2.0  # a read slower than this (a stalled network filesystem) is refused, not waited on
_CHUNK = 1 << 20


class RunDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def for_job(cls, home: str | os.PathLike[str], job_id: str) -> "RunDir":
        return cls(Path(home) / "runs" / job_id)

    spec_file = property(lambda self: self.path / "spec.yaml")
    log_file = property(lambda self: self.path / "output.log")
    metrics_file = property(lambda self: self.path / "metrics.jsonl")
    events_file = property(lambda self: self.path / "events.jsonl")
    exit_file = property(lambda self: self.path / EXIT_FILE)
    report_file = property(lambda self: self.path / REPORT_FILE)
    outputs_dir = property(lambda self: self.path / "outputs")

    # ------------------------------------------------------------ safe access
    @contextmanager
    def _open(self, name: str, flags: int, *, write: bool = False) -> Iterator[int]:
        """A descriptor of `name` (a plain name, or a/b/c under this dir) refusing anything but a
        regular file with one link, reached through no symlink."""
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise RunDirError(f"refusing {self.path / name}: not a plain relative path")
        dfd = self._dir_fd()
        shown = self.path / name
        try:
            for part in parts[:-1]:  # each directory on the way, never through a link
                try:
                    sub = os.open(part, os.O_RDONLY | os.O_DIRECTORY | _SAFE, dir_fd=dfd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise RunDirError(f"refusing {shown}: {part} is not a plain directory") from None
                    raise
                os.close(dfd)
                dfd = sub
            try:
                fd = os.open(parts[-1], flags | _SAFE, 0o600, dir_fd=dfd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise RunDirError(f"refusing {shown}: it is a symbolic link") from None
                if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened for writing
                    raise RunDirError(f"refusing {shown}: not a regular file (a FIFO)") from None
                raise
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RunDirError(f"refusing {shown}: not a regular file ({_kind(st.st_mode)})")
            if st.st_nlink != 1:  # a hard link to a file elsewhere: neither read nor written
                raise RunDirError(f"refusing {shown}: it has {st.st_nlink} hard links")
            os.set_blocking(fd, True)
            yield fd
        finally:
            os.close(fd)

    def _read_fd(self, fd: int, name: str, offset: int, n: int) -> bytes:
        """`n` bytes from `offset`, in chunks, within READ_DEADLINE_S (a stalled file is refused)."""
        deadline = time.monotonic() + READ_DEADLINE_S
        out: list[bytes] = []
        while n > 0:
            if time.monotonic() > deadline:
                raise RunDirError(f"refusing {self.path / name}: reading it took over {READ_DEADLINE_S:g} s")
            data = os.pread(fd, min(n, _CHUNK), offset)
            if not data:
                break
            out.append(data)
            offset += len(data)
            n -= len(data)
        return b"".join(out)

    def _dir_fd(self) -> int:
        try:
            return os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RunDirError(f"refusing {self.path}: not a plain directory (a symbolic link?)") from None
            raise

    def open_log_fd(self) -> int:
        """A descriptor appending to output.log (for a child's stdout and stderr); the caller closes it."""
        with self._open("output.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, write=True) as fd:
            return os.dup(fd)

    def _read_bytes(self, name: str, offset: int = 0, limit: int | None = None) -> tuple[bytes, int]:
        """(bytes from `offset`, at most `limit` or MAX_READ, file size); a missing file reads as empty."""
        limit = MAX_READ if limit is None else min(limit, MAX_READ)
        try:
            with self._open(name, os.O_RDONLY) as fd:
                size = os.fstat(fd).st_size
                return self._read_fd(fd, name, offset, min(limit, size - offset)), size
        except FileNotFoundError:
            return b"", 0

    def read_bytes(self, name: str, offset: int = 0, limit: int | None = None) -> tuple[bytes, int]:
        """(bytes of `name` from `offset`, at most `limit` or MAX_READ, its size); RunDirError when unsafe."""
        return self._read_bytes(name, offset, limit)

    def size_of(self, name: str) -> int:
        """The size of `name`, through the safe open (0 when missing); RunDirError when unsafe."""
        try:
            with self._open(name, os.O_RDONLY) as fd:
                return os.fstat(fd).st_size
        except FileNotFoundError:
            return 0

    def read_file(self, name: str, max_bytes: int = MAX_READ) -> bytes:
        """The whole of `name` (a/b under this dir), refused (RunDirError) when over `max_bytes` or unsafe.
        A missing file raises FileNotFoundError."""
        with self._open(name, os.O_RDONLY) as fd:
            size = os.fstat(fd).st_size
            if size > max_bytes:
                raise RunDirError(f"refusing {self.path / name}: {size} bytes, over the {max_bytes}-byte limit")
            return self._read_fd(fd, name, 0, size)

    def copy_file(self, name: str, dest: str | os.PathLike[str]) -> int:
        """Copy `name` (a/b under this dir) to `dest` through the safe open; bytes copied. RunDirError when
        unsafe (a FIFO, device, link or hard link swapped in after a listing is refused, not followed)."""
        with self._open(name, os.O_RDONLY) as fd:
            size = os.fstat(fd).st_size
            with open(dest, "wb") as out:
                offset = 0
                while offset < size:
                    data = os.pread(fd, min(_CHUNK * 8, size - offset), offset)
                    if not data:
                        break
                    out.write(data)
                    offset += len(data)
            return offset

    def read_events(self, max_bytes: int = 8 << 20) -> list[dict[str, Any]]:
        """The job's events.jsonl as records (the first `max_bytes`); RunDirError when unsafe."""
        data, _ = self._read_bytes("events.jsonl", 0, max_bytes)
        return _records(data.splitlines())

    def _append(self, name: str, data: bytes, *, newline_guard: bool = False) -> bool:
        """Append `data` to a regular file of this dir; False (and a warning) when refused or failed."""
        try:
            mode = os.O_RDWR if newline_guard else os.O_WRONLY
            with self._open(name, mode | os.O_APPEND | os.O_CREAT, write=True) as fd:
                if newline_guard:  # a child killed mid-line must not glue its last line to ours
                    size = os.fstat(fd).st_size
                    if size and os.pread(fd, 1, size - 1) != b"\n":
                        data = b"\n" + data
                os.write(fd, data)
            return True
        except (OSError, RunDirError) as exc:
            log.warning("could not append to %s: %s", self.path / name, exc)
            return False

    # ------------------------------------------------------------ writing (the worker)
    def create(self, spec: dict[str, Any]) -> "RunDir":
        """Make the dir (0700) and its files; write spec.yaml atomically. Idempotent."""
        import yaml  # only the worker writes specs; readers of the run dir do not need it

        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.outputs_dir.mkdir(mode=0o700, exist_ok=True)
        for name in ("output.log", "metrics.jsonl", "events.jsonl"):
            with self._open(name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, write=True):
                pass
        text = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True).encode("utf-8")
        self._replace("spec.yaml", text)
        return self

    def append_event(self, record: dict[str, Any]) -> bool:
        record = {"ts": time.time(), **record}
        return self._append("events.jsonl", (strict_json.dumps(record) + "\n").encode("utf-8"))

    def append_control(self, record: dict[str, Any]) -> bool:
        """A runner control (`offload-jobs signal`) for the train runner to read (jobs.runners.controls)."""
        return self._append("control.jsonl", (strict_json.dumps(record) + "\n").encode("utf-8"))

    def append_log(self, text: str) -> bool:
        """A line from the worker itself (e.g. why an attempt could not start)."""
        return self._append("output.log", text.encode("utf-8", "replace"), newline_guard=True)

    # ------------------------------------------------------------ reading
    def read_log(self, offset: int = 0, limit: int | None = None) -> tuple[int, bytes, int]:
        """(start, bytes, size): a chunk of output.log (at most `limit` or MAX_READ bytes); a negative
        offset counts from the end.

        Raises RunDirError when output.log is a symlink or not a regular file.
        """
        limit = MAX_READ if limit is None else min(limit, MAX_READ)
        try:
            with self._open("output.log", os.O_RDONLY) as fd:
                size = os.fstat(fd).st_size
                start = max(0, size + offset) if offset < 0 else min(offset, size)
                data = self._read_fd(fd, "output.log", start, min(limit, size - start))
                return start, data, size
        except FileNotFoundError:
            return 0, b"", 0

    def read_metrics(self, offset: int = 0, *, strict: bool = False) -> tuple[list[dict[str, Any]], int]:
        """(records, next_offset): complete lines of metrics.jsonl from `offset` (MAX_READ bytes at a
        time; next_offset continues); bad lines are skipped.

        NaN and Infinity read as null. An unsafe metrics file reads as no records, or raises
        RunDirError when `strict` (the API names the refusal).
        """
        try:
            data, _ = self._read_bytes("metrics.jsonl", offset)
        except RunDirError as exc:
            if strict:
                raise
            log.warning("%s", exc)
            return [], offset
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next read
        return _records(data[:end].splitlines()), offset + end

    def last_metrics(self, tail_bytes: int = 65536) -> dict[str, Any] | None:
        try:
            with self._open("metrics.jsonl", os.O_RDONLY) as fd:
                size = os.fstat(fd).st_size
                start = max(0, size - tail_bytes)
                data = self._read_fd(fd, "metrics.jsonl", start, size - start)
        except (FileNotFoundError, RunDirError):
            return None
        for line in reversed(data.splitlines()):
            recs = _records([line])
            if recs:
                return recs[0]
        return None

    def _read_json(self, name: str, max_bytes: int = 1 << 20) -> dict[str, Any] | None:
        try:
            data, _ = self._read_bytes(name, 0, max_bytes)
            rep = strict_json.loads(data) if data else None
        except (OSError, ValueError, RunDirError):
            return None
        return rep if isinstance(rep, dict) else None

    def read_report(self) -> dict[str, Any] | None:
        """The job's own report (report.json), if it wrote one."""
        return self._read_json(REPORT_FILE)

    def read_exit(self, attempt: int | None = None) -> dict[str, Any] | None:
        """The launcher's exit.json, if it belongs to `attempt` (when given)."""
        rec = self._read_json(EXIT_FILE)
        if rec is not None and attempt is not None and rec.get("attempt") != attempt:
            return None
        return rec

    def read_stop(self, attempt: int) -> str | None:
        """Why the worker began stopping `attempt` (cancelled, timeout, shutdown), if it did."""
        rec = self._read_json(STOP_FILE)
        if rec is None or rec.get("attempt") != attempt or not isinstance(rec.get("reason"), str):
            return None
        return rec["reason"]

    def write_stop(self, attempt: int, reason: str) -> bool:
        """Record, before signalling it, why the worker stops `attempt`: a worker that dies mid-stop
        still records a cancel as a cancel at its restart."""
        try:
            self._replace(STOP_FILE, (strict_json.dumps({"attempt": attempt, "reason": reason}) + "\n").encode())
            return True
        except OSError as exc:
            log.warning("could not write %s: %s", self.path / STOP_FILE, exc)
            return False

    def _replace(self, name: str, data: bytes) -> None:
        """Write `name` atomically (a temp file renamed over it); raises OSError."""
        tmp = f".{name}.tmp"
        dfd = self._dir_fd()
        try:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _SAFE, 0o600, dir_fd=dfd)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)

    # Kept for callers of the first version: the report a job wrote about itself.
    read_exit_report = read_report

    def clear_report(self) -> None:
        dfd = self._dir_fd()
        try:
            os.unlink(REPORT_FILE, dir_fd=dfd)  # unlinking a planted symlink removes the link only
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    clear_exit_report = clear_report


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return what
    return "not a plain file"


def _records(lines: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        try:
            rec = strict_json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def utf8_safe_end(data: bytes) -> int:
    """Length of `data` without a trailing partial UTF-8 character (so chunks decode cleanly)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 != 0x80:  # a lead byte or ASCII
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return n if need <= back else n - back
    return n
