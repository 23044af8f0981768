"""The worker's request guards, as pure ASGI middlewares (`jobs.worker.asgi`):
the bearer token and Host header (`AuthMiddleware`), and a size limit on request bodies
(`BodyLimitMiddleware`: a 100 MB spec is refused before it is read, not stored and served back)."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from typing import Any

from jobs.worker.asgi import HttpMiddleware

__all__ = ["AuthMiddleware", "BodyLimitMiddleware", "allowed_hosts"]

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> set[str]:
    """Loopback names, the bind host and any extra names (e.g. a compose service name)."""
    hosts = {"127.0.0.1", "localhost", "::1", "[::1]"}
    if bind_host and bind_host not in ("0.0.0.0", "::"):
        hosts.add(bind_host)
        hosts.add(f"[{bind_host}]" if ":" in bind_host else bind_host)
    hosts.update(h.strip().lower() for h in extra if h.strip())
    return hosts


# A Host header is a name (or a bracketed IPv6 literal) and an optional numeric port, nothing else:
# `127.0.0.1:8765@evil.com` or `127.0.0.1:80/x` is refused, not cut at its last colon.
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?")


def _host_name(value: str) -> str | None:
    """The name part of a Host header, lower-cased; None when the header is not a plain host[:port]."""
    value = value.strip().lower()
    m = _HOST.fullmatch(value)
    if m is not None:
        return m.group(1)
    return value if value in ("::1",) else None  # a bare IPv6 loopback, as older clients send it


class AuthMiddleware(HttpMiddleware):
    """401 without the bearer token (except /healthz and /readyz); 400 for a Host header not in `hosts` (DNS rebinding)."""

    def __init__(self, app: Any, token: str, hosts: set[str]) -> None:
        super().__init__(app)
        self.expected = f"Bearer {token}".encode()
        self.hosts = hosts

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        name = _host_name(host)
        if name is None or name not in self.hosts:
            await _reply(send, 400, {"error": f"refused Host header {host!r}"})
            return
        if scope.get("path") not in OPEN_PATHS:
            got = headers.get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                await _reply(send, 401, {"error": "missing or wrong bearer token"},
                             [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


async def _reply(send: Any, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


class _TooLarge(Exception):
    pass


class BodyLimitMiddleware(HttpMiddleware):
    """413 for a request body over `max_bytes`: at once from Content-Length, else while it streams in."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, int(declared))
            return
        seen = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._refuse(send, seen)

    async def _refuse(self, send: Any, size: int) -> None:
        limit_mib = self.max_bytes / (1 << 20)
        await _reply(send, 413, {"error": f"request body of {size} bytes or more is over the worker's limit "
                                          f"of {self.max_bytes} bytes ({limit_mib:.1f} MiB)", "too_large": True})
