"""The base of the worker's pure ASGI middlewares (the auth guard, the body limit, request timing).

Pure ASGI rather than Starlette's BaseHTTPMiddleware: no per-request task or body buffering. Each
one acts on HTTP requests only; lifespan and other scopes pass straight through to the app.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HttpMiddleware"]


class HttpMiddleware:
    """Calls `handle` for each HTTP request; any other scope goes to the wrapped app untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise NotImplementedError
