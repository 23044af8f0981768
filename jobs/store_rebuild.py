"""A store that lost its history: refused at start, rebuilt from the run dirs on request.

The state dir's SQLite store and its `runs/<id>/` dirs are written side by side. After a crash, a
deleted `jobs.db` (or only its `jobs.db-wal`, where a quiet worker keeps everything) leaves run dirs
that the store knows nothing of: starting there would drop every such job silently, and leave any
of them still running unmanaged. So:

    check_history   at start: run dirs whose job the store does not hold -> StoreError naming them
    deleting        around a delete or prune: markers a restart reads to finish a half-done delete
    rebuild         `offload-jobs worker --rebuild-store`: each such job back from its run dir:
                    spec.yaml (the job), events.jsonl (its attempts and last state), exit.json and
                    stop.json (how an attempt that was live really ended). An attempt still live
                    whose launcher left no exit is stopped (every process tagged with its id and
                    attempt) and recorded worker_lost, then retried per its policy, so nothing runs
                    unmanaged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select

from jobs.contract import TERMINAL, JobState, Reason
from jobs import strict_json
from jobs.errors import StoreError
from jobs.tables import attempts_t, jobs_t

__all__ = ["lost_run_dirs", "check_history", "rebuild", "deleting", "finish_deletes"]

log = logging.getLogger("offload_jobs.store")

_MAX_SPEC = 1 << 20
_MAX_EVENTS = 8 << 20


DELETING = "deleting"  # home/deleting/<job id>: a delete in progress (written before the store row goes)


@contextmanager
def deleting(home: Path, job_ids: Iterable[str]) -> Iterator[None]:
    """Mark `job_ids` as being deleted while the block removes their store rows and run dirs.

    A worker that dies between the two would otherwise leave run dirs the store no longer knows,
    and its next start would take them for a lost store and refuse. The next start finishes what a
    marker names instead (finish_deletes). Markers go once the block ends, raised or not."""
    marks = home / DELETING
    marks.mkdir(mode=0o700, exist_ok=True)
    made = []
    try:
        for job_id in job_ids:
            (marks / job_id).touch()
            made.append(marks / job_id)
        yield
    finally:
        for m in made:
            m.unlink(missing_ok=True)


def finish_deletes(store: Any, home: Path) -> None:
    """At start: the deletes a dead worker left half done (their markers): a run dir whose store row
    is gone is removed; a job whose row is still there stays. The markers go."""
    marks = home / DELETING
    try:
        names = os.listdir(marks)
    except OSError:
        return
    dirs = _run_dirs(home)
    with store.engine.connect() as conn:
        known = set(conn.execute(select(jobs_t.c.id).where(jobs_t.c.id.in_(names))).scalars()) if names else set()
    for job_id in names:
        path = dirs.get(job_id)
        if job_id not in known and path is not None and not path.is_symlink():
            log.warning("removing %s: its job was deleted, then the worker stopped before the run dir went", path)
            shutil.rmtree(path, ignore_errors=True)
        (marks / job_id).unlink(missing_ok=True)


def _run_dirs(home: Path) -> dict[str, Path]:
    runs = home / "runs"
    out: dict[str, Path] = {}
    try:
        names = os.listdir(runs)
    except OSError:
        return out
    for name in names:
        p = runs / name
        try:
            if stat.S_ISDIR(os.lstat(p).st_mode) and stat.S_ISREG(os.lstat(p / "spec.yaml").st_mode):
                out[name] = p
        except OSError:
            continue
    return out


def lost_run_dirs(store: Any, home: Path) -> list[str]:
    """Ids of the run dirs under `home/runs` whose job the store does not hold, oldest first."""
    dirs = _run_dirs(home)
    if not dirs:
        return []
    known: set[str] = set()
    ids = sorted(dirs)
    with store.engine.connect() as conn:
        for i in range(0, len(ids), 500):
            known.update(conn.execute(select(jobs_t.c.id).where(jobs_t.c.id.in_(ids[i:i + 500]))).scalars())
    lost = [i for i in ids if i not in known and not _unborn(dirs[i])]
    return sorted(lost, key=lambda i: _mtime(dirs[i] / "spec.yaml"))


def _unborn(path: Path) -> bool:
    """A submit that never committed (the worker died between making the run dir and the job): no
    event at all, not even job.created, which is written only once the job is in the store."""
    try:
        outputs = os.listdir(path / "outputs")
    except OSError:
        outputs = []
    return not _read(path / "events.jsonl", 1) and not _read(path / "output.log", 1) and not outputs


def _remove_unborn(store: Any, home: Path) -> None:
    dirs = _run_dirs(home)
    if not dirs:
        return
    known: set[str] = set()
    ids = sorted(dirs)
    with store.engine.connect() as conn:
        for i in range(0, len(ids), 500):
            known.update(conn.execute(select(jobs_t.c.id).where(jobs_t.c.id.in_(ids[i:i + 500]))).scalars())
    for job_id in ids:
        if job_id not in known and _unborn(dirs[job_id]):
            log.warning("removing %s: a submit that never reached the store (the worker died mid-submit)",
                        dirs[job_id])
            shutil.rmtree(dirs[job_id], ignore_errors=True)


def check_history(store: Any, home: Path) -> None:
    """Refuse (StoreError, one line) a store that holds none of some run dirs' jobs (after removing the
    run dirs of submits that never committed, and of deletes a dead worker left half done)."""
    finish_deletes(store, home)
    _remove_unborn(store, home)
    lost = lost_run_dirs(store, home)
    if not lost:
        return
    db, runs = store.path_label, home / "runs"
    shown = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    raise StoreError(f"{db} holds no record of {len(lost)} jobs whose run dirs are in {runs} ({shown}): the store "
                     "lost its history (deleted, or its -wal file lost after a crash); start the worker with "
                     f"--rebuild-store to rebuild them from their run dirs, restore {db} from a backup, or move "
                     f"{runs} aside to start empty")


def _read(path: Path, limit: int) -> bytes:
    """A regular file's first `limit` bytes, never following a link or blocking on a FIFO; b'' if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        os.set_blocking(fd, True)
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _mtime(p: Path) -> float:
    try:
        return os.lstat(p).st_mtime
    except OSError:
        return 0.0


def _events(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in _read(path, _MAX_EVENTS).splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue  # a torn last line, or the job's own scribbles
        if isinstance(ev, dict) and isinstance(ev.get("type"), str):
            out.append(ev)
    return out


def rebuild(store: Any, home: Path) -> list[dict[str, Any]]:
    """Put back every job whose run dir the store does not hold; returns them as rebuilt."""
    finish_deletes(store, home)  # a job deleted just before the crash stays deleted
    import yaml

    from jobs.executors import Exit, SetupFailed, get_executor
    from jobs.executors.process import exit_from_record
    from jobs.rundir import RunDir
    from jobs.spec import parse_spec
    from jobs.worker.scheduler import Scheduler

    done = []
    for job_id in lost_run_dirs(store, home):
        path = home / "runs" / job_id
        rd = RunDir(path)
        try:
            data = yaml.safe_load(_read(path / "spec.yaml", _MAX_SPEC).decode("utf-8", "replace"))
        except yaml.YAMLError:
            data = None
        if not isinstance(data, dict):
            log.warning("run dir %s: spec.yaml is unreadable; left out of the rebuilt store", path)
            continue
        try:
            spec = parse_spec(data)
            fields = dict(kind=spec.kind, name=spec.display_name(), priority=spec.priority, gpus=spec.gpus,
                          max_attempts=spec.retry.max_attempts, executor=spec.executor,
                          min_vram=spec.resources.min_vram or 0)
            retry_on, executor = list(spec.retry.on), spec.executor
        except Exception:  # a spec of an older schema: keep the job, with what it says
            fields = dict(kind=str(data.get("kind") or "command"), name=str(data.get("name") or job_id),
                          priority=0, gpus=0, max_attempts=1, executor="process", min_vram=0)
            retry_on, executor = [], "process"
        events = _events(path / "events.jsonl")
        born = [e["ts"] for e in events if e["type"] == "job.created" and isinstance(e.get("ts"), (int, float))]
        created = born[0] if born else _mtime(path / "spec.yaml")
        attempts: dict[int, dict[str, Any]] = {}
        last: dict[str, Any] = {"status": JobState.PENDING, "attempt": 0}
        for e in events:
            if (e["type"] != "job.status" or not isinstance(e.get("attempt"), int)
                    or not isinstance(e.get("status"), str)):
                continue
            last = e
            n = e["attempt"]
            if n < 1:
                continue
            a = attempts.setdefault(n, {"number": n, "status": JobState.STARTING, "started_at": e.get("ts"),
                                        "executor": executor, "reason": None, "exit_code": None,
                                        "message": None, "finished_at": None})
            ended = e.get("retry_of") or (e["status"] if e["status"] in TERMINAL else None)
            if e["status"] == JobState.RUNNING:
                a.update(status=JobState.RUNNING, pid=e.get("pid"))
            elif ended:
                a.update(status=ended, reason=e.get("reason"), exit_code=e.get("exit_code"),
                         message=e.get("message"), finished_at=e.get("ts"))
        n = int(last.get("attempt") or 0)
        job: dict[str, Any] = dict(status=last["status"], reason=last.get("reason"), exit_code=last.get("exit_code"),
                                   message=last.get("message"), attempt=n,
                                   finished_at=last.get("ts") if last["status"] in TERMINAL else None)
        live = attempts.get(n) if job["status"] in (JobState.STARTING, JobState.RUNNING, JobState.CANCELLING) else None
        if live is not None:
            # It was live when the store was lost: its real end if its launcher wrote one, else stop it.
            stop = rd.read_stop(n) or (Reason.CANCELLED if job["status"] == JobState.CANCELLING else None)
            rec = rd.read_exit(n)
            if rec is None or rec.get("job_id") not in (None, job_id):
                try:
                    stopped = get_executor(executor).reap(job_id, n, None, rd)
                except (SetupFailed, Exception) as exc:  # an executor that cannot answer here
                    log.warning("job %s: could not stop what is left of attempt %d: %s", job_id, n, exc)
                    stopped = 0
                rec = rd.read_exit(n)
                how = (f"was still running unmanaged ({stopped} processes) and was stopped" if stopped
                       else "left no exit record")
                if stop is None:
                    # No exit record before the rebuild's own stop: any record now (the launcher
                    # saw the signal) is that stop's doing, whatever `stopped` counted (a cgroup
                    # kill empties the group before its pids are counted): its worker was lost.
                    stop = "shutdown"
            else:
                how = "had ended while no store recorded it"
            if rec is not None and rec.get("job_id") in (None, job_id):
                ex = exit_from_record(rec)
            else:
                ex = Exit(None, ran=live["status"] == JobState.RUNNING, unknown=True)
            outcome = Scheduler._judge(stop, stop is not None, ex)
            requeue = (outcome.status == JobState.FAILED and (outcome.never_ran or (outcome.reason in retry_on
                                                                           and n < fields["max_attempts"])))
            now = time.time()
            live.update(status=outcome.status, reason=outcome.reason, exit_code=outcome.exit_code,
                        message=outcome.message or f"the store was rebuilt; this attempt {how}", finished_at=now)
            job.update(status=JobState.PENDING if requeue else outcome.status, reason=outcome.reason,
                       exit_code=outcome.exit_code, message=live["message"], finished_at=None if requeue else now)
            rd.append_log(f"[offload-jobs] store rebuilt from the run dirs; attempt {n} {how}: {outcome.status}"
                          + (f" ({outcome.reason})" if outcome.reason else "")
                          + ("; queued again" if requeue else "") + "\n")
        for a in attempts.values():  # an earlier attempt whose end no event recorded: it is over, unrecorded
            if a is not live and a["status"] not in TERMINAL:
                a.update(status=JobState.FAILED, reason=Reason.WORKER_LOST, message="no record of its end", finished_at=time.time())
        if job["status"] not in TERMINAL and job["status"] != JobState.PENDING:
            job["status"] = JobState.PENDING  # STARTING with no attempt record: it never ran
        with store.engine.begin() as conn:
            seq = (conn.execute(select(func.max(jobs_t.c.seq))).scalar() or 0) + 1
            started = [a["started_at"] for a in attempts.values() if a.get("started_at")]
            conn.execute(insert(jobs_t).values(
                id=job_id, seq=seq, spec=strict_json.dumps(data), created_at=created, run_dir=str(path),
                started_at=min(started) if started else None, **fields, **job))
            for a in sorted(attempts.values(), key=lambda x: x["number"]):
                conn.execute(insert(attempts_t).values(
                    job_id=job_id, number=a["number"], status=a["status"], reason=a["reason"],
                    message=a["message"], executor=a["executor"], pid=a.get("pid"), started_at=a["started_at"],
                    finished_at=a["finished_at"], exit_code=a["exit_code"]))
            store._event(conn, job_id, "job.rebuilt", {"status": job["status"], "attempt": n,
                                                       "from": str(path)})
        done.append({"id": job_id, **job})
        log.warning("job %s rebuilt from %s: %s", job_id, path, job["status"])
    return done
