"""Faults under load: workers killed under `specd serve`, connections cut, with 8 requests in flight.

Greedy output must equal the run without faults (transformers' generate on the target)
or, when no worker is left to finish it, end in a clear UNAVAILABLE; afterwards the
workers hold no session and the service answers again.
"""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from conftest import request, start_stack
from specd.v1 import gateway_pb2_grpc
from specd_cli.supervisor import Backoff, Supervisor
from tcpproxy import proxy_front
from test_cli import free_port
from test_pipeline import reference_greedy

PROMPTS = ["def fibonacci(n):", "class Cache:", "The gateway accepts", "Speculative decoding",
           "The acceptance rate is", "    def __init__(self, size):", "a, b = b, a + b", "When it is high,"]
NEW_TOKENS = 100


@pytest.fixture(scope="module")
def expected(target_model, tokenizer) -> dict[str, list[int]]:
    return {p: reference_greedy(target_model, tokenizer, p, NEW_TOKENS) for p in PROMPTS}


def run_in_flight(stub: gateway_pb2_grpc.GatewayStub, fault) -> dict[str, list[int] | grpc.RpcError]:
    """Stream every prompt at once; call fault() once each has its first chunk; collect the outcomes."""
    started = threading.Barrier(len(PROMPTS) + 1, timeout=300)

    def one(prompt: str):
        stream = stub.GenerateStream(request(prompt, max_new_tokens=NEW_TOKENS), timeout=300)
        try:
            tokens = list(next(stream).token_ids)
        finally:
            started.wait()
        try:
            for chunk in stream:
                tokens += chunk.token_ids
        except grpc.RpcError as exc:
            return exc
        return tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {p: pool.submit(one, p) for p in PROMPTS}
        started.wait()
        fault()
        return {p: f.result() for p, f in futures.items()}


def assert_same_or_unavailable(outcomes, expected, allow_unavailable: bool) -> int:
    """Every request got the fault-free output (or UNAVAILABLE when allowed); how many completed."""
    completed = 0
    for prompt, outcome in outcomes.items():
        if isinstance(outcome, grpc.RpcError):
            assert allow_unavailable and outcome.code() == grpc.StatusCode.UNAVAILABLE, (prompt, outcome)
            assert outcome.details()
        else:
            assert outcome == expected[prompt], prompt
            completed += 1
    print(f"{completed}/{len(outcomes)} requests completed with the fault-free output, "
          f"{len(outcomes) - completed} UNAVAILABLE")
    return completed


# -- the supervisor -------------------------------------------------------------------------

def test_backoff_doubles_to_its_cap():
    assert [Backoff(0.5, 10.0).delay(n) for n in range(7)] == [0.5, 1, 2, 4, 8, 10, 10]


def test_supervisor_restarts_workers_and_stops_when_the_gateway_exits(tmp_path):
    lines: list[str] = []
    supervisor = Supervisor(backoff=Backoff(initial_s=0.05, max_s=0.2, stable_s=60), say=lines.append)
    flaky = supervisor.start("flaky", [sys.executable, "-c", "import sys; sys.exit(3)"])
    marker = tmp_path / "exit-now"
    gateway = supervisor.start("gateway", [sys.executable, "-c", f"import os, time\nwhile not os.path.exists("
                                           f"{str(marker)!r}): time.sleep(0.05)"], restart=False)
    try:
        while flaky.restarts < 3:
            assert supervisor.check()
            time.sleep(0.02)
        assert len(set(flaky.history)) == 4 and gateway.restarts == 0
        assert f"specd serve: flaky (pid {flaky.history[0]}) exited with code 3; restarting it in 0.05 s" in lines
        assert any("restarting it in 0.2 s" in line for line in lines)  # doubled, then capped
        marker.touch()
        gateway.proc.wait(60)
        assert supervisor.check() is False and "stopping" in lines[-1]
    finally:
        supervisor.stop(5)
    assert all(p.poll() is not None for p in supervisor.processes)


# -- specd serve with a worker killed -------------------------------------------------------

class Serve:
    """`specd serve` on free ports with the tiny models; its output lines in a queue."""

    def __init__(self, model_dirs, *flags: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specd_cli", "serve", "--target", str(model_dirs["target"]),
             "--draft", f"close={model_dirs['close']}", "--port", str(self.port), "--threads", "1", *flags],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.wait_for(r"specd serve: ready")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def _pump(self) -> None:
        """Queue serve's output, line by line (a thread of its own)."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float = 180) -> re.Match:
        """The first output line (from the start) matching pattern."""
        deadline = time.monotonic() + timeout_s
        while True:
            for line in self.seen:
                if match := re.search(pattern, line):
                    return match
            try:
                self.seen.append(self.lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.seen)}") from None

    def pid(self, worker: str) -> int:
        return int(self.wait_for(rf"specd serve: {worker} running as pid (\d+)").group(1))

    def close(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


@pytest.fixture()
def serve(model_dirs):
    running = Serve(model_dirs)
    yield running
    running.close()


def test_draft_killed_under_serve(serve, expected):
    draft_pid = serve.pid("draft")
    outcomes = run_in_flight(serve.stub, lambda: os.kill(draft_pid, signal.SIGKILL))
    assert assert_same_or_unavailable(outcomes, expected, allow_unavailable=False) == len(PROMPTS)
    serve.wait_for(rf"draft \(pid {draft_pid}\) exited with signal SIGKILL; restarting it in 0.5 s")
    restarted = int(serve.wait_for(r"draft running as pid (\d+) \(restart 1\)").group(1))
    assert restarted != draft_pid and serve.proc.poll() is None
    # The restarted draft is found again: a new request speculates.
    deadline = time.monotonic() + 120
    while serve.stub.Generate(request(PROMPTS[0], max_new_tokens=8)).stats.proposed_tokens == 0:
        assert time.monotonic() < deadline, "the gateway never used the restarted draft"
        time.sleep(0.5)


def test_verifier_killed_under_serve(serve, expected):
    verifier_pid = serve.pid("verifier")
    outcomes = run_in_flight(serve.stub, lambda: os.kill(verifier_pid, signal.SIGKILL))
    # No second verifier: a request finishes on the restarted one, or ends UNAVAILABLE.
    assert_same_or_unavailable(outcomes, expected, allow_unavailable=True)
    serve.wait_for(rf"verifier \(pid {verifier_pid}\) exited with signal SIGKILL; restarting")
    serve.wait_for(r"verifier running as pid \d+ \(restart 1\)")
    deadline = time.monotonic() + 120
    while True:  # the gateway stayed up; once the verifier is back it answers again
        try:
            response = serve.stub.Generate(request(PROMPTS[1], max_new_tokens=NEW_TOKENS))
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
            time.sleep(0.5)
    assert list(response.token_ids) == expected[PROMPTS[1]]


# -- specd serve with a worker frozen (SIGSTOP): it fails nothing, it just stops answering ----

def test_draft_frozen_under_serve(serve, expected):
    """Requests in flight finish by plain decoding within a second or so, unchanged; new ones
    are served; once the draft answers again a probe finds it and speculation resumes."""
    draft_pid = serve.pid("draft")
    frozen = {}

    def freeze():
        os.kill(draft_pid, signal.SIGSTOP)
        frozen["at"] = time.monotonic()

    try:
        outcomes = run_in_flight(serve.stub, freeze)
        finished_s = time.monotonic() - frozen["at"]
        assert assert_same_or_unavailable(outcomes, expected, allow_unavailable=False) == len(PROMPTS)
        assert finished_s < 8, f"the requests in flight took {finished_s:.1f} s after the freeze"
        served = serve.stub.Generate(request(PROMPTS[2], max_new_tokens=NEW_TOKENS, mode="AUTO"), timeout=5)
        assert list(served.token_ids) == expected[PROMPTS[2]]
    finally:
        os.kill(draft_pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while serve.stub.Generate(request(PROMPTS[0], max_new_tokens=8)).stats.proposed_tokens == 0:
        assert time.monotonic() < deadline, "the gateway never went back to the thawed draft"
        time.sleep(0.5)


@pytest.fixture()
def serve_2s_verifier_floor(model_dirs):
    running = Serve(model_dirs, "--verifier-step-floor", "2")  # serve hands it to its gateway
    yield running
    running.close()


def test_verifier_frozen_under_serve(serve_2s_verifier_floor, expected):
    """With no other verifier, a request without a deadline ends UNAVAILABLE within the
    verifier's step budget, and the gateway's health says NOT_SERVING; after SIGCONT both
    recover."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serve = serve_2s_verifier_floor
    health = health_pb2_grpc.HealthStub(serve.channel)
    verifier_pid = serve.pid("verifier")
    os.kill(verifier_pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as err:
            serve.stub.Generate(request(PROMPTS[0], max_new_tokens=NEW_TOKENS))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "within 2.00 s" in err.value.details()
        assert time.monotonic() - frozen_at < 4.5  # the 2 s floor, not the default 5 s
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() - frozen_at < 15, "the gateway's health still says SERVING"
            time.sleep(0.2)
    finally:
        os.kill(verifier_pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    while True:
        try:
            response = serve.stub.Generate(request(PROMPTS[1], max_new_tokens=NEW_TOKENS), timeout=10)
            break
        except grpc.RpcError as exc:
            assert time.monotonic() - thawed_at < 10, exc
            time.sleep(0.2)
    assert list(response.token_ids) == expected[PROMPTS[1]]
    assert time.monotonic() - thawed_at < 10
    while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() - thawed_at < 10, "the gateway's health never came back"
        time.sleep(0.2)


# -- connections cut between the gateway and a worker ---------------------------------------

@pytest.mark.parametrize("worker", ["draft", "verifier"])
def test_connections_cut_mid_run(model_dirs, expected, worker):
    front, proxies = proxy_front(worker)

    stack = start_stack(model_dirs, front=front)
    proxy = proxies[worker]
    try:
        outcomes = run_in_flight(stack.stub, proxy.cut)
        assert assert_same_or_unavailable(outcomes, expected, allow_unavailable=True) >= 1
        assert proxy.connections >= 2  # the gateway reconnected through the proxy
        assert stack.wait_no_sessions() == 0
        assert list(stack.stub.Generate(request(PROMPTS[0], max_new_tokens=NEW_TOKENS)).token_ids) \
            == expected[PROMPTS[0]]
    finally:
        stack.loop.run(proxy.close())
        stack.close()
