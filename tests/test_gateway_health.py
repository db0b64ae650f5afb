"""The gateway's health as Kubernetes probes read it: liveness stays SERVING through an
outage of the verifiers, and a gateway started before its workers waits for them, found
by address or through EndpointSlices (from `k8s_standin`, a stand-in API server: no real
one runs here)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import config as kubernetes_config

from conftest import LoopThread, request
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from k8s_standin import StandinApiServer
from specd.config import ServerSettings
from specd.grpcserver import LIVENESS
from specd.v1 import gateway_pb2_grpc
from tcpproxy import TcpProxy
from test_cli import free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def status(port: int, name: str) -> int | None:
    """What the plaintext health port says of `name` (None: no answer)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name),
                                                             timeout=2).status
        except grpc.RpcError:
            return None


def until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_liveness_stays_serving_while_the_verifier_is_frozen(stack):
    """The verifier frozen (a paused proxy) for longer than the gateway's three failed
    rounds: "" turns NOT_SERVING (readiness), the liveness name never leaves SERVING."""
    loop = LoopThread()
    proxy = loop.run(TcpProxy(stack.verifier.port).start())
    health_port = free_port()
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=0.5, health_port=health_port),
        verifier_address=f"127.0.0.1:{proxy.port}", draft_address="")))
    try:
        assert status(health_port, LIVENESS) == SERVING and status(health_port, "") == SERVING
        loop.loop.call_soon_threadsafe(proxy.pause)
        seen = []
        assert until(lambda: seen.append(status(health_port, LIVENESS)) or status(health_port, "") == NOT_SERVING,
                     15), "the gateway never noticed the frozen verifier"
        frozen_until = time.monotonic() + 3
        while time.monotonic() < frozen_until:
            seen.append(status(health_port, LIVENESS))
            time.sleep(0.2)
        assert set(seen) == {SERVING}, seen
        loop.loop.call_soon_threadsafe(proxy.resume)
        assert until(lambda: status(health_port, "") == SERVING, 15)
    finally:
        loop.run(gateway.stop(0))
        loop.run(proxy.close())
        loop.close()


def start_in_background(loop: LoopThread, settings: GatewaySettings) -> concurrent.futures.Future:
    return asyncio.run_coroutine_threadsafe(create_gateway(settings), loop.loop)


@pytest.mark.parametrize("found_by", ["address", "endpointslices"])
def test_a_gateway_started_before_its_workers_waits_for_them(stack, monkeypatch, found_by):
    """With --worker-timeout 0, a gateway whose verifier is not there yet (no ready
    endpoint in its Service's EndpointSlices, or nothing listening at its address) keeps
    waiting, alive on its liveness name and not ready on "", and serves once it is."""
    loop = LoopThread()
    health_port = free_port()
    with StandinApiServer(namespace="specd") as api:
        if found_by == "endpointslices":
            # The stand-in in place of the in-cluster configuration the watcher loads.
            monkeypatch.setattr(kubernetes_config, "load_incluster_config",
                                lambda client_configuration: setattr(client_configuration, "host", api.url))
            api.put_slice("verifier-a", "specd-verifier", [("127.0.0.1", False)], port=stack.verifier.port)
            where = {"verifier_service": "specd-verifier", "namespace": "specd"}
            proxy = None
        else:
            proxy = TcpProxy(stack.verifier.port)
            proxy.target_port = free_port()  # nothing listens there yet
            loop.run(proxy.start())
            where = {"verifier_address": f"127.0.0.1:{proxy.port}"}
        starting = start_in_background(loop, GatewaySettings(
            ServerSettings("127.0.0.1", 0, grace_s=0.5, health_port=health_port), draft_address="",
            worker_timeout_s=0, **where))
        try:
            assert until(lambda: status(health_port, LIVENESS) == SERVING, 20), "no liveness while waiting"
            time.sleep(3)  # longer than a gateway that gives up at once would last
            assert not starting.done(), starting.exception() if starting.done() else None
            assert status(health_port, LIVENESS) == SERVING and status(health_port, "") == NOT_SERVING
            if proxy is not None:
                proxy.target_port = stack.verifier.port  # the verifier comes up
            else:
                api.put_slice("verifier-a", "specd-verifier", [("127.0.0.1", True)], port=stack.verifier.port)
            gateway = starting.result(60)
            assert status(health_port, "") == SERVING
            with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                reply = stub.Generate(request("def f(n):", max_new_tokens=4, mode="OFF"), timeout=60)
            assert len(reply.token_ids) == 4
            loop.run(gateway.stop(0))
        finally:
            if not starting.done():
                starting.cancel()
            if proxy is not None:
                loop.run(proxy.close())
            loop.close()


def test_the_liveness_name_is_serving_as_soon_as_the_health_port_is_up():
    from specd.grpcserver import start_health

    port = free_port()
    loop = LoopThread()
    health = loop.run(start_health(ServerSettings("127.0.0.1", 0, health_port=port)))
    assert health.server is not None
    try:
        assert status(port, LIVENESS) == SERVING and status(port, "") == NOT_SERVING
        # The health-only port takes health checks, not the workers' 256 MiB messages.
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="x" * 100_000),
                                                          timeout=5)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        loop.run(health.server.stop(0))
        loop.close()


def test_clients_are_asked_to_reconnect_after_the_connection_age(stack):
    """--max-connection-age: the gateway sends GOAWAY to a connection older than it, so a
    client's channel goes idle and reconnects (to whichever gateway the Service picks)."""
    from specd.v1 import gateway_pb2

    loop = LoopThread()
    gateway = loop.run(create_gateway(GatewaySettings(
        ServerSettings("127.0.0.1", 0, grace_s=0.5), verifier_address=f"127.0.0.1:{stack.verifier.port}",
        draft_address="", max_connection_age_s=1.0)))
    states: list[grpc.ChannelConnectivity] = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
            channel.subscribe(states.append, try_to_connect=False)
            gateway_pb2_grpc.GatewayStub(channel).GetGatewayInfo(gateway_pb2.GatewayInfoRequest(), timeout=10)
            ready, idle = grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE
            assert until(lambda: ready in states and idle in states[states.index(ready):], 10), states
            # and it serves again on a new connection
            gateway_pb2_grpc.GatewayStub(channel).GetGatewayInfo(gateway_pb2.GatewayInfoRequest(), timeout=10)
    finally:
        loop.run(gateway.stop(0))
        loop.close()


def test_a_worker_whose_forwards_keep_failing_reports_not_serving(model_dirs):
    """Every forward of the verifier raising (a device in a bad state): after
    FAILING_FORWARDS of them in a row its health says NOT_SERVING, so that its readiness
    probe takes it out and its liveness probe restarts it; one forward that works again
    makes it SERVING."""
    from conftest import start_stack
    from specd.worker.service import FAILING_FORWARDS

    stack = start_stack(model_dirs, drafts=("close",))
    try:
        runner = stack.verifier.servicer.scorer.runner
        scheduler = runner.scheduler
        forward = scheduler._forward

        def broken(rows):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{stack.verifier.port}"))
        check = lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status  # noqa: E731
        assert check() == SERVING
        scheduler._forward = broken
        for _ in range(FAILING_FORWARDS + 1):
            with pytest.raises(grpc.RpcError):
                stack.stub.Generate(request("def f(n):", max_new_tokens=2, mode="OFF"), timeout=30)
        assert until(lambda: check() == NOT_SERVING, 5)
        scheduler._forward = forward
        assert until(lambda: stack.stub.Generate(request("def f(n):", max_new_tokens=2, mode="OFF"), timeout=30)
                     .token_ids and check() == SERVING, 15)
    finally:
        stack.close()
