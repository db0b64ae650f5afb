"""Graceful shutdown: health flips to NOT_SERVING, new work is refused, in-flight requests finish."""
from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import request, start_stack
from test_pipeline import reference_greedy


def test_gateway_drains_in_flight_requests(model_dirs, target_model, tokenizer):
    stack = start_stack(model_dirs)
    try:
        prompt = "def fibonacci(n):"
        stream = stack.stub.GenerateStream(request(prompt, max_new_tokens=60))
        got = list(next(stream).token_ids)
        stopping = asyncio.run_coroutine_threadsafe(stack.gateway.stop(10.0), stack.loop.loop)
        # Health says NOT_SERVING first (a readiness probe fails), then new calls are refused.
        health = health_pb2_grpc.HealthStub(stack.channel)
        deadline = time.monotonic() + 5
        refused = False
        while time.monotonic() < deadline and not refused:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                refused = status == health_pb2.HealthCheckResponse.NOT_SERVING
            except grpc.RpcError as err:
                refused = err.code() == grpc.StatusCode.UNAVAILABLE
        assert refused, "the gateway kept accepting work after stop() began"
        got += [t for c in stream for t in c.token_ids]  # the in-flight request completes
        assert got == reference_greedy(target_model, tokenizer, prompt, 60)
        stopping.result(15)
    finally:
        stack.close()
