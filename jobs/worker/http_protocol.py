"""The worker's HTTP protocol: uvicorn's, with a bound on how long a request's headers may take.

uvicorn's `timeout_keep_alive` is cancelled by every byte received, so a client that trickles its
headers a byte at a time holds a connection (and its memory) open for as long as it likes; 500
of them stayed open in a probe. Here each connection must finish a request's headers within
`HEADER_TIMEOUT_S` of connecting (or of its previous response), whatever it sends meanwhile, or
it is closed. A request whose headers arrived (an event stream, a slow upload) is never cut.

`$OFFLOAD_JOBS_HEADER_TIMEOUT` (seconds) sets the bound.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

__all__ = ["GuardedHTTPProtocol", "HEADER_TIMEOUT_S", "header_timeout"]

HEADER_TIMEOUT_S = 10.0


def header_timeout() -> float:
    try:
        value = float(os.environ.get("OFFLOAD_JOBS_HEADER_TIMEOUT") or HEADER_TIMEOUT_S)
    except ValueError:
        return HEADER_TIMEOUT_S
    return value if value > 0 else HEADER_TIMEOUT_S


class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's protocol (h11 or httptools), closing connections whose headers do not arrive in time.

    Both of uvicorn's protocols make a new `cycle` when a request's headers are complete; the
    timer compares the cycle it was armed with against the current one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout()
        self._header_timer: asyncio.TimerHandle | None = None
        self._armed_cycle: Any = None

    def _arm(self) -> None:
        self._disarm()
        self._armed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if self.cycle is self._armed_cycle and not in_flight and not self.transport.is_closing():
            self.transport.close()  # no complete request line and headers in time: a trickler

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._armed_cycle:  # headers complete: the request runs as long as it needs
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the next request on this kept-alive connection gets the same bound

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
