"""The HTTP port: uvicorn in the gateway's own process and event loop, with the edge's
connection limits (`gateway.edge.connections`), and TLS from the files the gRPC port uses,
reloaded when they are renewed."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import ssl
from pathlib import Path

import uvicorn

from gateway.edge.connections import EdgeLimits, edge_protocol, quiet_accept_errors
from gateway.edge.http import OpenAIApp
from specd.grpcserver import PortInUse
from specd.tls import files_stamp

log = logging.getLogger(__name__)

# -- serving ----------------------------------------------------------------------------------

class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


# How often the HTTPS port looks for renewed certificate files.
CERTIFICATE_CHECK_INTERVAL_S = 5.0
class HttpServer:
    """The HTTP app listening on host:port (0: a free port), in the running event loop."""

    def __init__(self, app: OpenAIApp, host: str, port: int, limits: EdgeLimits, certfile: str | None = None,
                 keyfile: str | None = None, client_ca: str | None = None) -> None:
        """With client_ca, callers must present a certificate it signed, as over gRPC.
        A taken port raises PortInUse naming it."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise PortInUse(f"{host}:{port}", "HTTP port") from exc
        self.port = self._socket.getsockname()[1]
        self.app = app
        self.limits = limits
        self._tls_files = (certfile, keyfile, client_ca)
        self._reloading: asyncio.Task | None = None
        # The listen backlog is also how many connections asyncio accepts in one go, before
        # any is closed at the cap: no larger than the cap, so a burst cannot take every
        # descriptor at once (2,048, uvicorn's default, did at a file limit of 512).
        config = uvicorn.Config(app.app, lifespan="off", log_level="warning", access_log=False,
                                http=edge_protocol(limits), backlog=max(16, min(2048, limits.max_connections)),
                                timeout_graceful_shutdown=2, ssl_certfile=certfile, ssl_keyfile=keyfile,
                                ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        for _ in range(1000):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        if self._server.config.ssl is not None:
            self._reloading = asyncio.get_running_loop().create_task(self._reload_certificates())
        log.info("OpenAI-compatible HTTP listening on port %d", self.port)

    async def _reload_certificates(self) -> None:
        """Take renewed certificate files into the live TLS context, for the handshakes after
        (gRPC's ports do the same, `specd.tls`). A pair caught mid-write, which does not load,
        is tried again at the next check. A new client CA is added to the trusted ones."""
        certfile, keyfile, client_ca = self._tls_files
        assert certfile is not None and keyfile is not None  # TLS is on
        paths = [Path(f) for f in self._tls_files if f is not None]
        context = self._server.config.ssl
        assert context is not None  # started with TLS
        seen = files_stamp(paths)
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_INTERVAL_S)
            try:
                stamp = files_stamp(paths)
                if stamp == seen:
                    continue
                # Tried on a context of its own first: a pair caught mid-write must not
                # reach the live one half loaded.
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
                context.load_cert_chain(certfile, keyfile)
                if client_ca is not None:
                    context.load_verify_locations(client_ca)
            except (OSError, ssl.SSLError) as exc:
                log.warning("keeping the HTTPS certificate: its files changed but do not load (%s)", exc)
                continue
            seen = stamp
            log.info("HTTPS certificate files changed: new connections get the new certificate")

    async def drain(self, grace_s: float) -> None:
        """Stop taking connections; let requests in flight finish for up to grace_s. Streams
        still running a moment before the grace ends are ended with an error event and
        [DONE], so that no client reads a cut body."""
        self._server.config.timeout_graceful_shutdown = max(math.ceil(grace_s), 1)
        self._server.should_exit = True
        closing = asyncio.get_running_loop().call_later(max(grace_s - min(1.0, grace_s / 2), 0),
                                                         self.app.closing.set)
        try:
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._task), grace_s + 5)
        finally:
            closing.cancel()

    async def stop(self) -> None:
        if self._reloading is not None:
            self._reloading.cancel()
        self.app.closing.set()
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
        self._socket.close()
        self.app.close()
