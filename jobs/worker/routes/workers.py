"""GET /v1/workers: every worker on this store, its GPUs and what it runs."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

__all__ = ["router"]


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, ident = ctx.store, ctx.ident

    @router.get("/v1/workers")
    def workers() -> Response:
        """Every worker on this store: its host, GPUs (and the job on each), slots, heartbeat, running attempts."""
        return _json({"workers": store.workers(), "this": ident.id, "shared": store.shared,
                      "store": "postgresql" if store.is_postgres else "sqlite"})

    return router
