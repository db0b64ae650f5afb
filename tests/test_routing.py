"""Pod-aware routing with several real worker processes behind a static address list:
sessions stick to the worker holding their cache, and when a worker is killed its
sessions finish on another one, exactly as the target alone would decode them."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import LoopThread, request
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from specd.config import ServerSettings
from specd.v1 import gateway_pb2_grpc
from test_cli import free_port
from test_pipeline import reference_greedy

PROMPTS = ["def fibonacci(n):", "The acceptance rate is", "class Cache:", "Speculative decoding lets"]


def start_worker(kind: str, model_args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specd_cli", kind, "--port", str(port), *model_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"127.0.0.1:{port}"


def wait_serving(address: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                time.sleep(0.3)
    raise TimeoutError(address)


@pytest.fixture(scope="module")
def workers(model_dirs):
    """Two verifier and two draft processes (shared by the tests of this module, in order:
    the killed-worker tests each leave one worker of their kind dead)."""
    procs = {
        "verifier": [start_worker("verifier", ["--target", str(model_dirs["target"])]) for _ in range(2)],
        "draft": [start_worker("draft", ["--draft", f"close={model_dirs['close']}"]) for _ in range(2)],
    }
    try:
        for _, address in procs["verifier"] + procs["draft"]:
            wait_serving(address)
        yield procs
    finally:
        for proc, _ in procs["verifier"] + procs["draft"]:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gateway(workers):
    loop = LoopThread()
    settings = GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=0.5),
        verifier_address=",".join(a for _, a in workers["verifier"]),
        draft_address=",".join(a for _, a in workers["draft"]), worker_timeout_s=30.0)
    server = loop.run(create_gateway(settings))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    loop.run(server.stop(0))
    loop.close()


def test_sessions_stick_to_their_worker(gateway, target_model, tokenizer):
    # Two requests in flight at once land on different workers (least loaded); every
    # later step of each must reach the worker holding its cache, or that worker would
    # answer NOT_FOUND and the session would be re-opened.
    streams = [gateway.GenerateStream(request(p, max_new_tokens=40)) for p in PROMPTS[:2]]
    firsts = [list(next(s).token_ids) for s in streams]
    for prompt, first, stream in zip(PROMPTS, firsts, streams):
        chunks = list(stream)
        assert first + [t for c in chunks for t in c.token_ids] == reference_greedy(target_model, tokenizer,
                                                                                 prompt, 40)
        assert chunks[-1].stats.steps > 3 and chunks[-1].stats.session_reopens == 0


def test_a_repeated_prefix_goes_where_it_is_cached(gateway, target_model, tokenizer):
    """Two verifiers: placed by load alone, a prompt sent again would go to the other one
    (ties rotate) and miss its cache; placed by prefix, every repeat hits, and the output is
    the same."""
    prompt = "".join(PROMPTS) * 2
    first = gateway.Generate(request(prompt, max_new_tokens=8))
    for question in ("# and then?", "# once more", "# why?"):
        again = gateway.Generate(request(prompt + question, max_new_tokens=8))
        assert again.stats.cached_tokens >= 48, question
    assert list(gateway.Generate(request(prompt, max_new_tokens=8)).token_ids) == list(first.token_ids)


@pytest.mark.parametrize("kind", ["verifier", "draft"])
def test_killed_worker_sessions_finish_elsewhere(gateway, workers, target_model, tokenizer, kind):
    streams = [gateway.GenerateStream(request(p, max_new_tokens=40)) for p in PROMPTS]
    firsts = [list(next(s).token_ids) for s in streams]  # all four sessions open, spread over both
    victim, _ = workers[kind][0]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    reopens = 0
    for prompt, first, stream in zip(PROMPTS, firsts, streams):
        chunks = list(stream)
        assert first + [t for c in chunks for t in c.token_ids] == reference_greedy(target_model, tokenizer,
                                                                                 prompt, 40)
        reopens += chunks[-1].stats.session_reopens
    assert reopens >= 1  # the killed worker's sessions were re-opened on the survivor
    # New requests avoid the dead worker and still decode exactly.
    response = gateway.Generate(request(PROMPTS[0], max_new_tokens=20))
    assert list(response.token_ids) == reference_greedy(target_model, tokenizer, PROMPTS[0], 20)
