"""The worker's HTTP routes, one module a resource, each an APIRouter that `create_app` includes.

    common.py    WorkerContext (what the routes share) and the strict-JSON helpers
    health.py    /healthz, /readyz (StoreHealth) and /metrics (Prometheus)
    submit.py    POST /v1/jobs and /v1/validate: a spec read, checked and stored
    jobs.py      the job list and one job: show, delete, cancel, retry, prune
    controls.py  POST /v1/jobs/{id}/signal: runner controls for train jobs
    files.py     a job's run-dir files: logs, metrics, events, outputs (through the safe reader)
    events.py    GET /v1/events (server-sent events) and /v1/events/last (EventBus)
    workers.py   GET /v1/workers
"""

from __future__ import annotations

from jobs.worker.routes.common import WorkerContext

__all__ = ["WorkerContext"]
