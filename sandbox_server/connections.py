"""Bounds on the connections the server holds before a request can be authenticated.

uvicorn reads a request's headers with no time limit and takes any number of connections: one
sandbox with ``network: true`` held 17,754 half-sent requests open (the server's limit was 20,000).
Authentication happens once the headers are complete, so these bounds live below the application,
in uvicorn's HTTP protocol: a connection whose next request's headers are not complete within
``header_timeout_s`` of its opening (or of the last answer) is closed, and one client address holds
at most ``max_connections_per_client`` connections (more are closed at once). The body's time
limit is the guard middleware's (``app.GuardMiddleware``).
"""

from __future__ import annotations

import asyncio
from collections import Counter

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # uvicorn without httptools: the pure-Python parser has the same hooks
    from uvicorn.protocols.http.h11_impl import H11Protocol as _BaseProtocol


def bounded_protocol(header_timeout_s: float, max_connections_per_client: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the bounds above (pass as ``uvicorn.run(..., http=...)``); one
    class per server: the per-client counts are its own."""
    open_per_client: Counter[str] = Counter()

    class BoundedProtocol(_BaseProtocol):
        _counted: str | None = None
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if open_per_client[host] >= max_connections_per_client:
                transport.abort()
                return
            open_per_client[host] += 1
            self._counted = host
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._counted is not None:
                open_per_client[self._counted] -= 1
                if open_per_client[self._counted] <= 0:
                    del open_per_client[self._counted]
                self._counted = None
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()  # the next request's headers get the same time

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._close_if_no_request)

        def _close_if_no_request(self) -> None:
            waiting = self.cycle is None or self.cycle.response_complete  # no request whose headers arrived
            if waiting and not self.transport.is_closing():
                self.transport.abort()

    return BoundedProtocol
