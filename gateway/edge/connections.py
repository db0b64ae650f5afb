"""The HTTP port's connection limits, which uvicorn lacks and a public edge needs
(docs/http.md, "Limits"): a deadline for a request's headers, a cap on open connections,
and accept() failures logged once per interval. `gateway.edge.httpserver` serves through
`edge_protocol`."""
from __future__ import annotations

import asyncio
import logging
import math
import resource
import time
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


# One log line per this many seconds for accept() failing on a lack of file descriptors:
# asyncio logs each failed attempt with its traceback, megabytes a minute under a flood.
ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
# The connection cap when none is given: nginx's worker_connections is 512 to 1024, and a
# quarter of the process's descriptors leaves the rest to the gRPC port and the workers' streams.
MAX_CONNECTIONS_CEILING = 1024


def default_max_connections() -> int:
    """1,024 connections, or a quarter of this process's open-file limit when that is less."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS_CEILING if soft == resource.RLIM_INFINITY else max(8, min(MAX_CONNECTIONS_CEILING,
                                                                                     soft // 4))


@dataclass
class EdgeLimits:
    """What one HTTP connection may hold, and how many may be open."""

    header_timeout_s: float
    max_connections: int
    refused: int = 0  # connections closed at the cap, since start
    displaced: int = 0  # connections closed at the cap to make room for a new one
    late: int = 0  # connections closed for not sending a request's headers in time
    last_warned: float = -math.inf

    def warn(self, what: str) -> None:
        now = time.monotonic()
        if now - self.last_warned >= ACCEPT_ERROR_LOG_INTERVAL_S:
            self.last_warned = now
            log.warning("HTTP edge: %s (since start: %d connections closed for late headers, %d displaced and %d "
                        "refused at the cap of %d)", what, self.late, self.displaced, self.refused,
                        self.max_connections)


class EdgeProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the two limits a public edge needs and uvicorn lacks.

    - A request's headers must be whole within `header_timeout_s` of the connection opening
      or of the previous response ending (nginx's client_header_timeout, Envoy's
      request_headers_timeout): a silent or trickling socket is closed.
    - At most `max_connections` are open. A new one past the cap displaces the oldest
      connection that is waiting for a request (silent, or idle between requests); when
      every connection is in a request, the new one is closed at once. Either way the
      process keeps file descriptors for the gRPC port and the workers' streams.
    """

    limits: EdgeLimits  # set on the subclass `edge_protocol` makes

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.opened = self.loop.time()
        self._headers_due: asyncio.TimerHandle | None = None
        limits = self.limits
        if sum(1 for c in self.connections if not c.transport.is_closing()) > limits.max_connections:
            if not self._displace_one():
                limits.refused += 1
                limits.warn("connection cap reached; a new connection was closed")
                transport.close()
                return
        self._expect_headers()

    def _displace_one(self) -> bool:
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, EdgeProtocol) and c.waiting and not c.transport.is_closing()]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.opened).transport.close()
        self.limits.displaced += 1
        self.limits.warn("connection cap reached; the oldest connection waiting for a request was closed")
        return True

    @property
    def waiting(self) -> bool:
        """No request in progress: nothing received yet, or idle between requests."""
        return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

    def _expect_headers(self) -> None:
        self._headers_due = self.loop.call_later(self.limits.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.limits.late += 1
            self.limits.warn("a connection sent no whole request headers in time and was closed")
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            if self._headers_due is not None:
                self._headers_due.cancel()
            self._expect_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_headers_due", None) is not None:
            self._headers_due.cancel()  # type: ignore[union-attr]
        super().connection_lost(exc)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log accept() failures for want of file descriptors once per interval, with a count,
    not once per attempt with a traceback each (everything else goes where it went)."""
    previous = loop.get_exception_handler()
    state = {"last": -math.inf, "since": 0}

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            state["since"] += 1
            now = time.monotonic()
            if now - state["last"] >= ACCEPT_ERROR_LOG_INTERVAL_S:
                log.error("cannot accept connections: %s (%d times since the last such line); the process is out "
                          "of file descriptors: raise its limit (ulimit -n) or lower --http-max-connections",
                          context.get("exception"), state["since"])
                state["last"], state["since"] = now, 0
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def edge_protocol(limits: EdgeLimits) -> type[EdgeProtocol]:
    """The protocol class uvicorn instantiates per connection, holding these limits."""
    return type("EdgeProtocol", (EdgeProtocol,), {"limits": limits})
