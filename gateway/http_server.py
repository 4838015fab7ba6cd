"""The gateway's HTTP server settings: uvicorn with a deadline on request headers (slowloris).

uvicorn bounds idle keep-alive connections but not a client that connects and sends its headers a byte at a time:
such connections were held indefinitely. `HeaderTimeoutH11Protocol` closes a connection whose request headers are not
complete within `header_timeout_s` of its first byte (or of the connection); the body's deadline is the app's
(`build_app(body_timeout_s=...)`, a 408). It knows nothing about the routes.
"""
from __future__ import annotations

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)
DEFAULT_HEADER_TIMEOUT_S = 10.0


class HeaderTimeoutH11Protocol(H11Protocol):
    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.cycle is None or self.cycle.response_complete:  # between requests: the next headers have a deadline
            self._arm_header_timer()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return  # closed already, or the headers came in time (a request is being served)
        log.info("closing connection from %s: no complete request headers within %gs", self.client,
                 self.header_timeout_s)
        self.transport.close()


def uvicorn_config(app, host: str, port: int, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   **kwargs) -> uvicorn.Config:
    """uvicorn.Config for the gateway's REST app with the header deadline (kwargs: other uvicorn settings)."""
    protocol = type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, host=host, port=port, http=protocol, **kwargs)
