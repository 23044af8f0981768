"""`RunDir`: the files of one job, `runs/<id>/` under the state dir.

    spec.yaml     the validated spec as submitted
    output.log    stdout+stderr of every attempt, appended by the child itself (survives restarts)
    metrics.jsonl one JSON object per line, written by the job
    events.jsonl  the job's status changes, one JSON object per line
    exit.json     optional exit report of the last attempt ({"reason": "cuda_oom", ...})
    outputs/      what the job produces
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

__all__ = ["RunDir"]


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
    exit_file = property(lambda self: self.path / "exit.json")
    outputs_dir = property(lambda self: self.path / "outputs")

    def create(self, spec: dict[str, Any]) -> "RunDir":
        self.outputs_dir.mkdir(parents=True, exist_ok=True)
        for f in (self.log_file, self.metrics_file, self.events_file):
            f.touch(exist_ok=True)
        tmp = self.spec_file.with_suffix(".yaml.tmp")
        tmp.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
        os.replace(tmp, self.spec_file)
        return self

    def append_event(self, record: dict[str, Any]) -> None:
        record = {"ts": time.time(), **record}
        with open(self.events_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def append_log(self, text: str) -> None:
        """A line from the worker itself (e.g. why an attempt could not start)."""
        with open(self.log_file, "ab+") as f:
            if f.tell() > 0:  # a child killed mid-line must not glue its last line to ours
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    text = "\n" + text
            f.write(text.encode("utf-8", "replace"))

    def read_log(self, offset: int = 0, limit: int | None = None) -> tuple[int, bytes, int]:
        """(start, bytes, size): a chunk of output.log; a negative offset counts from the end."""
        try:
            size = self.log_file.stat().st_size
        except FileNotFoundError:
            return 0, b"", 0
        start = max(0, size + offset) if offset < 0 else min(offset, size)
        n = size - start if limit is None else min(limit, size - start)
        if n <= 0:
            return start, b"", size
        with open(self.log_file, "rb") as f:
            f.seek(start)
            data = f.read(n)
        return start, data, size

    def read_metrics(self, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
        """(records, next_offset): complete lines of metrics.jsonl from `offset`; bad lines are skipped."""
        try:
            with open(self.metrics_file, "rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        end = data.rfind(b"\n") + 1  # a half-written last line waits for the next read
        records = []
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                records.append(rec)
        return records, offset + end

    def last_metrics(self, tail_bytes: int = 65536) -> dict[str, Any] | None:
        try:
            size = self.metrics_file.stat().st_size
        except FileNotFoundError:
            return None
        start = max(0, size - tail_bytes)
        with open(self.metrics_file, "rb") as f:
            f.seek(start)
            data = f.read()
        for line in reversed(data.splitlines()):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                return rec
        return None

    def read_exit_report(self) -> dict[str, Any] | None:
        try:
            rep = json.loads(self.exit_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return rep if isinstance(rep, dict) else None

    def clear_exit_report(self) -> None:
        self.exit_file.unlink(missing_ok=True)


def utf8_safe_end(data: bytes) -> int:
    """Length of `data` without a trailing partial UTF-8 character (so chunks decode cleanly)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 != 0x80:  # a lead byte or ASCII
            need = 1 if b < 0x80 else 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
            return n if need <= back else n - back
    return n
