"""Workers on one store: who they are, their heartbeats, the leases of their attempts, the reaper.

    register_worker  a worker's row: host, GPUs, slots, executors, its URL; refused while another
                     live process holds the same worker id
    heartbeat        every few seconds, one transaction: the worker's row and the lease of each
                     of its live attempts move to now + heartbeat_timeout (the database's clock);
                     returns the attempts renewed, so the worker learns which it no longer holds
    reap_expired     any worker: attempts whose lease ran out are closed as worker_lost (a
                     STARTING one as never run) and retried per their policy, each exactly once
                     (the close is conditional on the lease still being past due)

A lease that ran out is never renewed, only reaped; the worker that lost it stops the attempt
itself before that can happen (jobs/worker/heartbeat.py), and its late writes are fenced.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import insert, select, update

from jobs import strict_json
from jobs.contract import JobState
from jobs.store_base import LeaseLost, reads, writes
from jobs.tables import attempts_t, jobs_t, workers_t

__all__ = ["ClusterMixin"]

_HELD = (JobState.STARTING, JobState.RUNNING)


class ClusterMixin:
    # ------------------------------------------------------------ workers
    @writes
    def register_worker(self, worker_id: str, *, instance: str, host: str, boot_id: str | None, pid: int,
                        url: str | None, heartbeat_timeout: float, info: dict[str, Any]) -> dict[str, Any] | None:
        """Insert or take over `worker_id`'s row for this process (`instance`).

        Returns the previous row when it still held a live lease under another instance (the
        caller decides whether that process is really gone), else None.
        """
        w = workers_t.c
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            now = self.db_now(conn)  # type: ignore[attr-defined]
            prev = conn.execute(select(workers_t).where(w.id == worker_id).with_for_update()).mappings().first()
            values = dict(instance=instance, host=host, boot_id=boot_id, pid=pid, url=url, status="up",
                          started_at=time.time(), heartbeat_at=now, lease_until=now + heartbeat_timeout,
                          heartbeat_timeout=heartbeat_timeout, info=strict_json.dumps(info))
            if prev is None:
                conn.execute(insert(workers_t).values(id=worker_id, **values))
                return None
            live = prev["status"] == "up" and (prev["lease_until"] or 0) > now and prev["instance"] != instance
            conn.execute(update(workers_t).where(w.id == worker_id).values(**values))
            return _worker_dict(prev, now) if live else None

    @writes
    def heartbeat(self, worker_id: str, instance: str, timeout: float, *, renew_attempts: bool,
                  info: dict[str, Any] | None = None) -> set[tuple[str, int]]:
        """Renew this worker's lease, and its attempts' (unexpired ones only); returns those renewed.

        Raises LeaseLost when another process has registered under this worker id since.
        """
        w, a = workers_t.c, attempts_t.c
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            now = self.db_now(conn)  # type: ignore[attr-defined]
            values: dict[str, Any] = dict(heartbeat_at=now, lease_until=now + timeout, status="up",
                                          heartbeat_timeout=timeout)
            if info is not None:
                values["info"] = strict_json.dumps(info)
            res = conn.execute(update(workers_t).where(w.id == worker_id, w.instance == instance).values(**values))
            if res.rowcount != 1:
                raise LeaseLost(f"worker id {worker_id} was registered by another process")
            if not renew_attempts:
                return set()
            rows = conn.execute(update(attempts_t).where(
                a.worker_id == worker_id, a.status.in_(_HELD), a.lease_until >= now).values(
                lease_until=now + timeout).returning(a.job_id, a.number)).all()
            return {(r[0], int(r[1])) for r in rows}

    @writes
    def worker_stopped(self, worker_id: str, instance: str) -> None:
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            conn.execute(update(workers_t).where(workers_t.c.id == worker_id, workers_t.c.instance == instance)
                         .values(status="stopped", lease_until=None))

    @reads
    def workers(self) -> list[dict[str, Any]]:
        """Every worker with its state and the attempts it holds (`running`)."""
        a, j = attempts_t.c, jobs_t.c
        with self._read() as conn:  # type: ignore[attr-defined]
            now = self.db_now(conn)  # type: ignore[attr-defined]
            rows = conn.execute(select(workers_t).order_by(workers_t.c.id)).mappings().all()
            held = conn.execute(select(a.job_id, a.number, a.worker_id, a.status, a.executor, a.handle, j.name, j.kind)
                                .join(jobs_t, j.id == a.job_id).where(a.status.in_(_HELD))).mappings().all()
        by_worker: dict[str, list[dict[str, Any]]] = {}
        for h in held:
            handle = _json(h["handle"]) or {}
            by_worker.setdefault(h["worker_id"] or "", []).append({
                "job_id": h["job_id"], "attempt": h["number"], "name": h["name"], "kind": h["kind"],
                "status": h["status"], "executor": h["executor"], "gpus": handle.get("gpus") or [],
                "slurm_job_id": handle.get("slurm_job_id")})
        out = []
        for r in rows:
            d = _worker_dict(r, now)
            d["running"] = by_worker.get(r["id"], [])
            used = {g: run["job_id"] for run in d["running"] for g in run["gpus"]}
            for gpu in d.get("gpus") or []:
                gpu["job_id"] = used.get(gpu.get("index"))
            out.append(d)
        return out

    # ------------------------------------------------------------ reaper
    @reads
    def expired_attempts(self, limit: int = 100) -> list[dict[str, Any]]:
        """Live attempts whose lease ran out, with their job's spec (for the retry policy)."""
        a, j = attempts_t.c, jobs_t.c
        with self._read() as conn:  # type: ignore[attr-defined]
            now = self.db_now(conn)  # type: ignore[attr-defined]
            rows = conn.execute(select(a.job_id, a.number, a.status, a.worker_id, a.executor, a.handle, a.lease_until,
                                       a.run_dir, j.spec)
                                .join(jobs_t, j.id == a.job_id)
                                .where(a.status.in_(_HELD), a.lease_until.is_not(None), a.lease_until < now)
                                .order_by(a.lease_until).limit(limit)).mappings().all()
        out = []
        for r in rows:
            d = dict(r)
            d["handle"] = _json(d["handle"])
            d["spec"] = _json(d["spec"]) or {}
            d["overdue_s"] = now - (r["lease_until"] or now)
            out.append(d)
        return out

    @writes
    def mark_lost_workers(self) -> list[str]:
        """Workers whose own lease ran out become `lost`; returns their ids."""
        w = workers_t.c
        with self.engine.begin() as conn:  # type: ignore[attr-defined]
            now = self.db_now(conn)  # type: ignore[attr-defined]
            rows = conn.execute(update(workers_t).where(w.status == "up", w.lease_until < now)
                                .values(status="lost").returning(w.id)).all()
            return [r[0] for r in rows]


def _json(value: str | None) -> Any:
    if not value:
        return None
    try:
        return strict_json.loads(value)
    except ValueError:
        return None


def _worker_dict(r: Any, now: float) -> dict[str, Any]:
    d = dict(r)
    info = _json(d.pop("info", None)) or {}
    d.update({k: v for k, v in info.items() if d.get(k) is None})
    d.pop("instance", None)
    if d["status"] == "up" and (d.get("lease_until") or 0) < now:
        d["status"] = "lost"  # not yet marked by a reaper, but silent past its lease
    d["heartbeat_age_s"] = None if d.get("heartbeat_at") is None else max(0.0, now - d["heartbeat_at"])
    return d
