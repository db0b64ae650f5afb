"""A 500-request soak: memory stays flat and no session is left behind.

Runs in CI (marked `soak` so it can be picked or skipped with -m); on 2 cores it takes
well under a minute. The three servers share this process, so its RSS is theirs.
"""
from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import request, start_stack
from specd.v1 import gateway_pb2

WARM_UP, SOAK = 60, 500
PROMPTS = ["def fibonacci(n):", "class Cache:", "The gateway accepts", "Speculative decoding"]


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def one(stack, n: int) -> str:
    """Request n of a mix: greedy and sampled, unary and streamed, some invalid, some cancelled."""
    kind = n % 5
    req = request(PROMPTS[n % len(PROMPTS)], max_new_tokens=8, temperature=0.0 if n % 2 else 0.8, seed=n,
                  top_k=0 if n % 3 else 20)
    if kind == 0:
        return f"{len(stack.stub.Generate(req).token_ids)}"
    if kind == 1:
        return f"{sum(len(c.token_ids) for c in stack.stub.GenerateStream(req))}"
    if kind == 2:  # a client that goes away after the first chunk
        stream = stack.stub.GenerateStream(req)
        next(stream)
        stream.cancel()
        return "cancelled"
    if kind == 3:  # bad input
        req.sampling.temperature = -1.0
        try:
            stack.stub.Generate(req)
        except grpc.RpcError as exc:
            return exc.code().name
    req.speculation.mode = gateway_pb2.SPECULATION_MODE_OFF  # plain decoding
    return f"{len(stack.stub.Generate(req).token_ids)}"


@pytest.mark.soak
def test_rss_is_flat_over_a_500_request_soak(model_dirs):
    stack = start_stack(model_dirs)
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: one(stack, n), range(WARM_UP)))
            gc.collect()
            before = rss_kib()
            outcomes = list(pool.map(lambda n: one(stack, n), range(WARM_UP, WARM_UP + SOAK)))
        gc.collect()
        after = rss_kib()
        growth = (after - before) / before
        print(f"\nsoak: {SOAK} requests after {WARM_UP} warm-up; RSS {before / 1024:.1f} MiB -> "
              f"{after / 1024:.1f} MiB ({growth:+.1%}); outcomes {sorted(set(outcomes))}")
        assert outcomes.count("INVALID_ARGUMENT") == SOAK // 5
        assert growth <= 0.10
        assert stack.wait_no_sessions() == 0
        assert stack.gateway.servicer.core._in_flight == 0
    finally:
        stack.close()
