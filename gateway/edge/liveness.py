"""The gateway's health follows its verifiers: NOT_SERVING while none answers.

A gateway whose verifiers all hang (stopped, wedged, cut off) can serve nothing, and
its readiness must say so, so that a load balancer sends traffic elsewhere. Every
`interval_s` the gateway asks each verifier endpoint for its grpc.health.v1 status over
the channel its requests use; when no endpoint has answered SERVING within `timeout_s`
for `failures` rounds in a row, the gateway reports NOT_SERVING; it is SERVING again at
the first round in which one answers. (The draft is not watched: without it the gateway
still serves, by plain decoding.)
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from gateway.workers.backend import WorkerPool

log = logging.getLogger(__name__)


async def watch_verifiers(verifier: WorkerPool, health: health_aio.HealthServicer, services: Sequence[str],
                          interval_s: float = 1.0, timeout_s: float = 1.0, failures: int = 3,
                          on_change: Callable[[bool], None] | None = None) -> None:
    """Set `services` (and the server's "") SERVING or NOT_SERVING as the verifiers answer,
    and tell `on_change` (the HTTP front end's /health reads it); runs until cancelled."""
    failed_rounds = 0
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        addresses = [state.address for state in verifier.router.snapshot() if state.ready]
        answers = await asyncio.gather(*(verifier.serving(address, timeout_s) for address in addresses))
        failed_rounds = 0 if any(answers) else failed_rounds + 1
        now_serving = failed_rounds < failures
        if now_serving == serving:
            continue
        serving = now_serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if serving:
            log.warning("a verifier answers again: the gateway is SERVING")
        else:
            log.error("no verifier answered a health check in %d rounds (%s): the gateway is NOT_SERVING",
                      failures, ", ".join(addresses) or "none listed")
        for name in ("", *services):
            await health.set(name, status)
        if on_change is not None:
            on_change(serving)

