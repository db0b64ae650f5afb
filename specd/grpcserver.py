"""The gRPC server plumbing every specd service shares: health, reflection, TLS, graceful stop.

`start_server` builds and starts a `grpc.aio` server on a port it holds exclusively
(TLS or mutual TLS when configured, `specd.tls`); `serve_until_signalled` runs it until
SIGTERM/SIGINT, flipping health to NOT_SERVING first (so a Kubernetes readiness probe
takes the pod out of rotation) and then draining in-flight requests.
"""
from __future__ import annotations

import asyncio
import errno
import inspect
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from specd.config import ServerSettings
from specd.interceptors import ClientNameInterceptor, ErrorMappingInterceptor
from specd.telemetry import server_interceptors
from specd.tls import server_credentials

# Probabilities of a whole vocabulary for γ+1 positions exceed gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted worker should be found again within a second, not after gRPC's
    # default reconnect backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# gRPC sets SO_REUSEPORT by default on Linux: a second server on a taken port then binds
# without error and the kernel splits connections between the two (two `specd serve` on
# one host served each other's models). A port is one server's, or start-up fails.
SERVER_OPTIONS = [*CHANNEL_OPTIONS[:2], ("grpc.so_reuseport", 0)]


class PortInUse(OSError):
    """The address a server was told to listen on is taken (or cannot be bound); `reason`,
    when the cause is known to be another (a Unix socket's directory that is gone)."""

    def __init__(self, address: str, what: str = "port", reason: str | None = None) -> None:
        super().__init__(errno.EADDRINUSE if reason is None else errno.ENOENT,
                         f"cannot listen on {address}: " + (reason or (
                             f"the {what} is taken by another process (another specd?) or the address is not "
                             f"this host's; stop that process or choose another {what}")))
        self.address = address


@dataclass
class RunningServer:
    """A started server, the port it bound and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    on_stop: Callable[[], Awaitable[None] | None] | None = None
    health_server: grpc.aio.Server | None = None  # the plaintext health-only port, if any
    servicer: object | None = None  # the service's servicer (tests read the workers' sessions)
    # What else drains beside the gRPC server, over the same grace (the gateway's HTTP front end).
    draining: Callable[[float], Awaitable[None]] | None = None

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING first, then let in-flight requests finish for up to grace_s."""
        await self.health.enter_graceful_shutdown()
        if self.draining is None:
            await self.server.stop(grace_s)
        else:
            await asyncio.gather(self.server.stop(grace_s), self.draining(grace_s))
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.on_stop is not None and inspect.isawaitable(result := self.on_stop()):
            await result


# The health name a liveness probe asks: SERVING from the moment a server's health port
# is up until it shuts down, whatever its dependencies do. "" and the service names follow
# the dependencies (the gateway's verifiers), which is readiness, not liveness: a
# liveness probe on "" restarted every gateway in an outage of the verifiers.
LIVENESS = "specd.liveness"
# A health check is a few bytes: the health-only port takes small messages, not the
# workers' 256 MiB.
HEALTH_PORT_OPTIONS = [("grpc.max_receive_message_length", 4096), ("grpc.max_send_message_length", 4096),
                       ("grpc.so_reuseport", 0)]


@dataclass
class HealthPort:
    """A server's health servicer, and the plaintext health-only server on its health
    port when it has one, started before the server itself (`start_health`)."""

    health: health_aio.HealthServicer
    server: grpc.aio.Server | None


async def start_health(settings: ServerSettings) -> HealthPort:
    """The health servicer, on settings.health_port at once when set: LIVENESS SERVING,
    "" NOT_SERVING until `start_server` has the services up. A service that waits for
    something before serving (the gateway, for its workers) starts this first, so that a
    probe finds the process alive meanwhile."""
    health = health_aio.HealthServicer()
    await health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    server = None
    if settings.health_port:
        server = grpc.aio.server(options=HEALTH_PORT_OPTIONS)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        _bind(server, f"{settings.host}:{settings.health_port}", None, what="health port")
        await server.start()
    return HealthPort(health, server)



async def start_server(
    settings: ServerSettings,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    on_stop: Callable[[], Awaitable[None] | None] | None = None,
    options: Sequence[tuple[str, int | str]] = (),
    health_port: HealthPort | None = None,
) -> RunningServer:
    """Build, register and start a server on settings.address; report SERVING.

    TLS per settings.tls. The port is bound exclusively: a taken one raises PortInUse.
    With settings.health_port, grpc.health.v1 is also served alone, in plaintext, there
    (`health_port`: one `start_health` started already).
    With tracing on, every RPC but health checks also gets an OpenTelemetry server span.
    Every server maps errors to real statuses (`specd.interceptors`), outside `interceptors`.
    `options` (gRPC channel arguments) replace the internal defaults they name: the public
    gateway takes small limits, the workers keep the large ones distributions need.
    """
    merged = {**dict(SERVER_OPTIONS), **dict(options)}
    identity = [ClientNameInterceptor(settings.tls.client_names)] if settings.tls.client_names else []
    server = grpc.aio.server(
        interceptors=[*server_interceptors(), ErrorMappingInterceptor(), *identity, *interceptors],
        options=list(merged.items()))
    register(server)
    if health_port is None:
        health_port = await start_health(settings)
    health = health_port.health
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    try:
        port = _bind(server, settings.address, server_credentials(settings.tls))
        await server.start()
    except BaseException:
        if health_port.server is not None:
            await health_port.server.stop(0)
        raise
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health, on_stop, health_port.server)


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None,
          what: str = "port") -> int:
    """Add the listening port; PortInUse naming the address if it cannot be had."""
    if address.startswith("unix:"):
        directory = Path(address.removeprefix("unix:")).parent
        if not directory.is_dir():
            raise PortInUse(address, what, f"the socket's directory {directory} does not exist (was it removed "
                                           f"while the service ran?); create it or choose another --socket")
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpc's "Failed to bind to address ..."
        raise PortInUse(address, what) from exc
    if port == 0:  # older grpc releases report a failed bind this way
        raise PortInUse(address, what)
    return port


async def serve_until_signalled(running: RunningServer, grace_s: float) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(grace_s)
