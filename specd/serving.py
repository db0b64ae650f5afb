"""What every specd service shares as a gRPC server: health, reflection, graceful stop.

`start_server` builds and starts a `grpc.aio` server; `serve_until_signalled` runs it
until SIGTERM/SIGINT, flipping health to NOT_SERVING first (so a Kubernetes readiness
probe takes the pod out of rotation) and then draining in-flight requests.
"""
from __future__ import annotations

import asyncio
import inspect
import signal
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from specd.config import ServerSettings
from specd.interceptors import ErrorMappingInterceptor
from specd.telemetry import server_interceptors

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


@dataclass
class RunningServer:
    """A started server, the port it bound and its health servicer."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    on_stop: Callable[[], Awaitable[None] | None] | None = None
    servicer: object | None = None  # the service's servicer (tests read the workers' sessions)

    async def stop(self, grace_s: float) -> None:
        """NOT_SERVING first, then let in-flight requests finish for up to grace_s."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.on_stop is not None and inspect.isawaitable(result := self.on_stop()):
            await result


async def start_server(
    settings: ServerSettings,
    register: Callable[[grpc.aio.Server], None],
    service_names: Sequence[str],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    on_stop: Callable[[], Awaitable[None] | None] | None = None,
    options: Sequence[tuple[str, int | str]] = (),
) -> RunningServer:
    """Build, register and start a server on settings.address; report SERVING.

    With tracing on, every RPC but health checks also gets an OpenTelemetry server span.
    Every server maps errors to real statuses (`specd.interceptors`), outside `interceptors`.
    `options` (gRPC channel arguments) replace the internal defaults they name: the public
    gateway takes small limits, the workers keep the large ones distributions need.
    """
    merged = {**dict(CHANNEL_OPTIONS[:2]), **dict(options)}
    server = grpc.aio.server(
        interceptors=[*server_interceptors(), ErrorMappingInterceptor(), *interceptors],
        options=list(merged.items()))
    register(server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(settings.address)
    if port == 0:
        raise OSError(f"could not bind {settings.address}")
    await server.start()
    for name in ("", *service_names):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server, port, health, on_stop)


async def serve_until_signalled(running: RunningServer, grace_s: float) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(grace_s)
