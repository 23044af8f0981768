"""Server-sent events: GET /v1/events (with ids, so clients resume) and /v1/events/last.

Streams sleep on the `EventBus` until any thread writes an event (the store's on_event, or the
Postgres listener for other workers' events): an idle client costs no CPU."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from jobs import strict_json
from jobs.errors import StoreError
from jobs.store import JobStore
from jobs.worker.routes.common import WorkerContext
from jobs.worker.routes.common import json_response as _json

__all__ = ["EventBus", "router", "KEEPALIVE_S"]

KEEPALIVE_S = 15.0


class EventBus:
    """Wakes event-stream handlers (on the event loop) when any thread writes an event."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.stopping = threading.Event()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._event = asyncio.Event()

    def waiter(self) -> asyncio.Event:
        assert self._event is not None
        return self._event

    def notify(self) -> None:
        if self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._fire)

    def _fire(self) -> None:
        if self._event is not None:
            ev, self._event = self._event, asyncio.Event()
            ev.set()


def router(ctx: WorkerContext) -> APIRouter:
    router = APIRouter()
    store, bus = ctx.store, ctx.bus

    @router.get("/v1/events")
    async def events(request: Request, last_event_id: int | None = None, job_id: str | None = None) -> StreamingResponse:
        header = request.headers.get("last-event-id")
        start = int(header) if header and header.isdigit() else last_event_id
        if start is None:
            start = await asyncio.to_thread(store.last_event_id)  # only what happens from now on
        return StreamingResponse(_stream(store, bus, request, start, job_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    @router.get("/v1/events/last")
    def last_event() -> Response:
        # A dashboard lists jobs after reading this, then streams events from it: no gap between.
        return _json({"id": store.last_event_id()})

    return router


async def _stream(store: JobStore, bus: EventBus, request: Request, last_id: int,
                  job_id: str | None = None) -> AsyncIterator[str]:
    # An idle stream costs nothing: it sleeps until the bus wakes it (an event was written) or a
    # keep-alive is due; no per-client polling. A client that goes away is noticed by Starlette,
    # which listens for the disconnect and cancels this generator.
    yield "retry: 1000\n\n"
    while not bus.stopping.is_set():
        waiter = bus.waiter()  # taken before reading, so no event slips between read and wait
        try:
            batch = await asyncio.to_thread(store.events_since, last_id, 500, job_id)
        except StoreError:
            batch = []
        for ev in batch:
            last_id = ev["id"]
            yield f"id: {ev['id']}\nevent: {ev['type']}\ndata: {strict_json.dumps(ev)}\n\n"
        if batch:
            continue
        try:
            await asyncio.wait_for(waiter.wait(), timeout=KEEPALIVE_S)
        except asyncio.TimeoutError:
            yield ": keep-alive\n\n"
