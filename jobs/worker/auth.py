"""Bearer-token and Host-header checks, as a pure ASGI middleware (no per-request overhead of BaseHTTPMiddleware)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from typing import Any

__all__ = ["AuthMiddleware", "allowed_hosts"]

OPEN_PATHS = frozenset({"/healthz"})


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> set[str]:
    """Loopback names, the bind host and any extra names (e.g. a compose service name)."""
    hosts = {"127.0.0.1", "localhost", "::1", "[::1]"}
    if bind_host and bind_host not in ("0.0.0.0", "::"):
        hosts.add(bind_host)
        hosts.add(f"[{bind_host}]" if ":" in bind_host else bind_host)
    hosts.update(h.strip().lower() for h in extra if h.strip())
    return hosts


def _host_name(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8765
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AuthMiddleware:
    """401 without the bearer token (except /healthz); 400 for a Host header not in `hosts` (DNS rebinding)."""

    def __init__(self, app: Any, token: str, hosts: set[str]) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()
        self.hosts = hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if _host_name(host) not in self.hosts:
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
