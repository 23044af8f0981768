"""A co-scheduled batch member's own child (issue 32): it waits while the batch's leader renders.

It holds the job's process (its exit, its cancel: the worker's SIGTERM ends it, and the leader,
reading the stop record, leaves its rows out), copies the lines the leader writes for it into its
own output.log, and exits as the leader's result for it says. No torch is imported here.

If the leader's child ends without a result for this job (it crashed, was killed, or the worker
stopped it), this job fails with reason worker_lost, as a job whose own child was lost does, and
is retried by `retry.on` (its default).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from jobs.batchdir import BatchDir
from jobs.contract import Reason

__all__ = ["wait"]

POLL_S = 0.1


def _copy(path: Path, offset: int) -> int:
    """Whole lines of `path` past `offset` to stdout (this job's output.log); the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    end = data.rfind(b"\n") + 1
    if end:
        sys.stdout.write(data[:end].decode("utf-8", "replace"))
        sys.stdout.flush()
    return offset + end


def _leader_gone(bd: BatchDir) -> bool:
    import psutil

    rec = bd.leader()
    if rec is None:
        return False  # not started yet: the worker marks `ended` if it never does
    try:
        return abs(psutil.Process(int(rec["pid"])).create_time() - float(rec["create_time"])) > 0.01
    except (psutil.NoSuchProcess, ValueError, KeyError):
        return True
    except psutil.Error:
        return False


def wait(bd: BatchDir, job_id: str) -> None:
    """Until the leader's result for `job_id`: return on success, else exit with its reason."""
    from jobs.runners._entry import fail

    leader, members = bd.read()
    print(f"[offload-jobs] co-scheduled: this job's images are rendered by the child of job {leader}, in one "
          f"batch with {', '.join(m.job_id for m in members if m.job_id != job_id)}", flush=True)
    offset = 0
    gone_since: float | None = None
    while True:
        offset = _copy(bd.log_file(job_id), offset)
        res = bd.result(job_id)
        if res is not None:
            _copy(bd.log_file(job_id), offset)
            if int(res.get("code", 1)) == 0:
                return
            fail(res.get("reason") or Reason.EXIT_NONZERO, res.get("message") or "failed in its batch",
                 code=int(res["code"]))
        if bd.ended() or _leader_gone(bd):
            # one more look after a moment: the leader writes a result just before it exits
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since > 2 * POLL_S:
                fail(Reason.WORKER_LOST, f"the child of job {leader}, which rendered this job's images in its batch, "
                                         "ended before they were done; the job is queued again (retry.on)", code=1)
        time.sleep(POLL_S)
