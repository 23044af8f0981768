"""GET /v1/models: the checkpoints this worker sees under its model roots (jobs.catalog)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

__all__ = ["router"]


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    home = ctx.home

    @router.get("/v1/models")
    def models() -> Response:
        """Every diffusers folder and .safetensors checkpoint under the model roots: kind, family, layout,
        dtype, size, and whether the model cache already holds it converted or sharded (headers only)."""
        from jobs.catalog import list_models

        return _json(list_models(home))

    return router
