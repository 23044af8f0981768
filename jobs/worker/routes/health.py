"""/healthz (the process lives; how its store is), /readyz (503 while the store fails) and /metrics."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

import jobs
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

if TYPE_CHECKING:
    from jobs.store import JobStore

__all__ = ["StoreHealth", "router"]


class StoreHealth:
    """Is the store answering? For /healthz and /readyz, never waiting on it longer than `probe_s`.

    One cheap read at a time (at most every `fresh_s`; concurrent askers share it), plus the last
    StoreError any route answered (a store that reads but cannot write still answers 503s).
    """

    def __init__(self, store: JobStore, probe_s: float = 2.0, fresh_s: float = 1.0, remember_s: float = 10.0) -> None:
        self.store = store
        self.probe_s, self.fresh_s, self.remember_s = probe_s, fresh_s, remember_s
        self._task: asyncio.Future[str | None] | None = None
        self._checked = -1e9
        self._problem: str | None = None
        self._answered: tuple[float, str] | None = None  # (when, what) of the last 503 a route gave

    def answered_503(self, message: str) -> None:
        self._answered = (time.monotonic(), message)

    def _probe(self) -> str | None:
        try:
            self.store.last_event_id()
            return None
        except Exception as exc:  # any failure of the store is the answer, not an error of /healthz
            return " ".join(str(exc).split()) or type(exc).__name__

    async def check(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._checked >= self.fresh_s:
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(asyncio.to_thread(self._probe))
            try:
                self._problem = await asyncio.wait_for(asyncio.shield(self._task), self.probe_s)
            except asyncio.TimeoutError:
                self._problem = f"the store did not answer within {self.probe_s:g} s"
            self._checked = time.monotonic()
        out: dict[str, Any] = {"ok": self._problem is None}
        if self._problem is not None:
            out["error"] = self._problem
        if self._answered is not None and now - self._answered[0] < self.remember_s:
            out["ok"] = False
            out["last_503"] = self._answered[1]
        return out


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    ident, token, metrics, store_health = ctx.ident, ctx.token, ctx.metrics, ctx.store_health

    @router.get("/healthz")
    async def healthz(challenge: str | None = None) -> Response:
        """The process is alive (200), and how its store is: `store.ok` false while it does not answer."""
        out: dict[str, Any] = {"ok": True, "version": jobs.__version__, "pid": os.getpid(), "worker_id": ident.id,
                               "store": await store_health.check()}
        if challenge:  # proves to a client that we hold its token, before it sends the token
            out["proof"] = hmac.new(token.encode(), challenge[:256].encode(), hashlib.sha256).hexdigest()
        return _json(out)

    @router.get("/readyz")
    async def readyz() -> Response:
        """200 when the worker can take and record jobs; 503 naming the store's problem when not."""
        health = await store_health.check()
        return _json({"ready": health["ok"], "store": health}, 200 if health["ok"] else 503)

    @router.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return router
