"""The folder through which a co-scheduled batch's children talk (issue 32), torch-free.

A batch is run by its leader's child (the first job claimed); every other member keeps a child of
its own, a small waiter (`jobs.runners.batch_member`) that holds the job's process, log, exit and
cancel path while the leader renders its images. The folder lives in the leader's run dir:

    <leader run dir>/batch/
        batch.json          {"id": leader id, "members": [{"job_id", "attempt", "run_dir"}, ...]}, leader first
        leader.json         the leader child's pid and start time (members watch it die)
        logs/<job id>.log   lines for that member's output.log (its waiter copies them)
        results/<job id>.json  {"code": 0} or {"code", "reason", "message"}: how that member's child exits
        ended               the worker's mark: the leader's attempt ended (no result will come now)

A member leaves the batch when the worker writes its stop record (cancel, timeout) into its own run
dir; the leader reads those records between passes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["BatchDir", "BatchMember", "BATCH_DIR_ENV", "BATCH_ROLE_ENV"]

BATCH_DIR_ENV = "OFFLOAD_JOBS_BATCH_DIR"  # set in the leader's and every member's child
BATCH_ROLE_ENV = "OFFLOAD_JOBS_BATCH_ROLE"  # "leader" or "member"


@dataclass(frozen=True)
class BatchMember:
    job_id: str
    attempt: int
    run_dir: str


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record), encoding="utf-8")
    os.replace(tmp, path)  # readers see the whole record or none


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class BatchDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @classmethod
    def of_leader(cls, leader_run_dir: str | os.PathLike[str]) -> "BatchDir":
        return cls(Path(leader_run_dir) / "batch")

    # ------------------------------------------------------------ the worker
    def create(self, leader: str, members: list[BatchMember]) -> None:
        """A fresh folder for this batch (an earlier attempt's is removed first)."""
        shutil.rmtree(self.path, ignore_errors=True)
        (self.path / "logs").mkdir(parents=True, mode=0o700)
        (self.path / "results").mkdir(mode=0o700)
        _write_json(self.path / "batch.json", {"id": leader, "members": [m.__dict__ for m in members]})

    def mark_ended(self) -> None:
        if self.path.is_dir():
            (self.path / "ended").touch()

    # ------------------------------------------------------------ the children
    def read(self) -> tuple[str, list[BatchMember]]:
        rec = _read_json(self.path / "batch.json")
        if rec is None:
            raise FileNotFoundError(f"{self.path / 'batch.json'}: no batch record")
        return rec["id"], [BatchMember(m["job_id"], int(m["attempt"]), m["run_dir"]) for m in rec["members"]]

    def ended(self) -> bool:
        return (self.path / "ended").exists()

    def write_leader(self, pid: int, create_time: float) -> None:
        _write_json(self.path / "leader.json", {"pid": pid, "create_time": create_time})

    def leader(self) -> dict[str, Any] | None:
        return _read_json(self.path / "leader.json")

    def result_file(self, job_id: str) -> Path:
        return self.path / "results" / f"{job_id}.json"

    def write_result(self, job_id: str, code: int, reason: str | None = None, message: str | None = None) -> None:
        rec: dict[str, Any] = {"code": code}
        if reason:
            rec.update(reason=reason, message=(message or "")[:2000])
        _write_json(self.result_file(job_id), rec)

    def result(self, job_id: str) -> dict[str, Any] | None:
        return _read_json(self.result_file(job_id))

    def log_file(self, job_id: str) -> Path:
        return self.path / "logs" / f"{job_id}.log"

    def log(self, job_id: str, line: str) -> None:
        with open(self.log_file(job_id), "a", encoding="utf-8") as f:
            f.write(line.rstrip("\n") + "\n")
