"""Bad input gets INVALID_ARGUMENT with an actionable message, and the service keeps serving;
a draft with another tokenizer is refused at start-up."""
from __future__ import annotations

import grpc
import pytest

from conftest import LoopThread, request
from draft_service.server import create_server as create_draft
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from gateway.workers.backend import IncompatibleDraft
from specd.config import ServerSettings
from specd.contract import MAX_DRAFT_LENGTH
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.worker.settings import DraftSettings
from workerstream import WorkerSteps

GOOD = request("def fibonacci(n):", max_new_tokens=8)


def bad_requests():
    long_prompt = "def fibonacci(n): " * 200
    return {
        "temperature": (request("x", temperature=-0.5), "temperature must be >= 0"),
        "top_p": (request("x", temperature=1.0, top_p=1.5), "top_p must be in (0, 1]"),
        "top_k": (request("x", temperature=1.0, top_k=-3), "top_k must be >= 0"),
        "max_new_tokens": (request("x", max_new_tokens=10_000), "exceeds the target's context window of 256"),
        "prompt": (request(long_prompt, max_new_tokens=1), "shorten the prompt"),
        "empty prompt": (request("", max_new_tokens=1), "prompt is empty"),
        "draft_length": (request("x", draft_length=99), "exceeds this gateway's maximum of 16"),
        "draft_model": (request("x", draft_model="llama-70b-draft"), "unknown draft model 'llama-70b-draft'"),
        "max_new_tokens=0": (request("x", max_new_tokens=0), "leave it unset for this gateway's default"),
    }


@pytest.mark.parametrize("case", list(bad_requests()))
def test_bad_input_is_invalid_argument_and_service_keeps_serving(stack, case):
    bad, message = bad_requests()[case]
    for call in (stack.stub.Generate, lambda r: list(stack.stub.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.value.details()
    assert len(stack.stub.Generate(GOOD).token_ids) == 8


def test_unset_max_new_tokens_runs_to_the_end_of_the_context(stack, tokenizer):
    """As vLLM: no max_new_tokens is the rest of the context (within --max-new-tokens-cap),
    unless --max-new-tokens sets a default."""
    assert stack.gateway.servicer.core.settings.default_max_new_tokens == 0
    unset = request("def f():")
    unset.sampling.ClearField("max_new_tokens")
    room = stack.gateway.servicer.core.backend.target.max_context - len(tokenizer("def f():")["input_ids"])
    everything = request("def f():", max_new_tokens=room)
    assert stack.stub.Generate(unset).token_ids == stack.stub.Generate(everything).token_ids


def test_every_problem_is_named_at_once(stack):
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(request("x", temperature=-1.0, draft_length=40))
    assert "temperature" in err.value.details() and "draft_length" in err.value.details()


def test_worker_answers_not_found_for_unknown_session(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        steps = WorkerSteps(worker_pb2_grpc.DraftStub(channel))
        step = worker_pb2.ProposeRequest(
            delta=worker_pb2.SequenceDelta(session_id="never-opened", start=5, tokens=[1]), draft_length=2)
        with pytest.raises(grpc.RpcError) as err:
            steps.step(step)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert "never-opened" in err.value.details()
        steps.close()


def test_a_proposal_longer_than_the_wire_allows_is_refused_by_either_worker(stack):
    """Both workers bound a step's γ at MAX_DRAFT_LENGTH, so one message cannot hold a model
    thread for long; the verifier's refusal names the count and the bound."""
    too_long = MAX_DRAFT_LENGTH + 1
    delta = worker_pb2.SequenceDelta(session_id="too-long", start=0, tokens=[1, 2, 3])
    with grpc.insecure_channel(f"127.0.0.1:{stack.verifier.port}") as channel:
        steps = WorkerSteps(worker_pb2_grpc.VerifierStub(channel))
        with pytest.raises(grpc.RpcError) as err:
            steps.step(worker_pb2.VerifyRequest(delta=delta, draft_tokens=[5] * too_long))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"draft_tokens carries {too_long} tokens; at most {MAX_DRAFT_LENGTH}" in err.value.details()
        steps.close()
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        steps = WorkerSteps(worker_pb2_grpc.DraftStub(channel))
        with pytest.raises(grpc.RpcError) as err:
            steps.step(worker_pb2.ProposeRequest(delta=delta, draft_length=too_long))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        steps.close()
    assert stack.stub.Generate(GOOD).token_ids  # both keep serving


def test_a_gateway_allowing_a_longer_draft_than_the_wire_refuses_to_start(stack):
    """--max-draft-length above what the workers take would fail every long step at run time;
    it is refused at start-up instead, before any worker is dialled, as is a default γ above it."""
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0), verifier_address="127.0.0.1:1",
                               max_draft_length=MAX_DRAFT_LENGTH + 1)
    with pytest.raises(ValueError, match=f"--max-draft-length must be in \\[1, {MAX_DRAFT_LENGTH}\\]"):
        stack.loop.run(create_gateway(settings))
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0), verifier_address="127.0.0.1:1",
                               max_draft_length=8, default_draft_length=9)
    with pytest.raises(ValueError, match="--draft-length must be in \\[0, 8\\]"):
        stack.loop.run(create_gateway(settings))


def test_draft_with_another_tokenizer_is_refused(stack, model_dirs):
    loop = LoopThread()
    server = ServerSettings("127.0.0.1", 0, grace_s=0.5)
    alien = loop.run(create_draft(DraftSettings(server, {"alien": model_dirs["alien"]})))
    try:
        settings = GatewaySettings(server, verifier_address=f"127.0.0.1:{stack.verifier.port}",
                                   draft_address=f"127.0.0.1:{alien.port}")
        with pytest.raises(IncompatibleDraft, match="does not share the target 'target'.s tokenizer"):
            loop.run(create_gateway(settings))
    finally:
        loop.run(alien.stop(0))
        loop.close()


def test_fixed_mode_refuses_an_adaptive_policy(stack):
    req = request("x")
    req.speculation.policy = "cost"
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "mode AUTO" in err.value.details()


def test_overload_is_resource_exhausted(model_dirs):
    from conftest import start_stack

    small = start_stack(model_dirs, max_concurrent_requests=1)
    try:
        held = small.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=60))
        next(held)  # one request in flight: the gateway is full
        with pytest.raises(grpc.RpcError) as err:
            small.stub.Generate(request("x", max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry" in err.value.details()
        list(held)
        assert len(small.stub.Generate(request("x", max_new_tokens=2)).token_ids) == 2
    finally:
        small.close()


class _OlderVerifier(worker_pb2_grpc.VerifierServicer):
    """Stands in for a verifier of an older release (whose code is not here): it answers
    GetModelInfo as that release did, with its protocol (0: the field did not exist yet)."""

    def __init__(self, models, protocol: int) -> None:
        self.models = models
        self.protocol = protocol

    async def GetModelInfo(self, request, context):
        return worker_pb2.ModelInfoResponse(models=self.models, protocol=self.protocol)


@pytest.mark.parametrize("protocol", [0, 3])
def test_a_worker_of_another_protocol_is_refused_at_start_up(stack, protocol: int):
    import grpc.aio

    from specd.wire import WORKER_PROTOCOL

    loop = LoopThread()
    with grpc.insecure_channel(f"127.0.0.1:{stack.verifier.port}") as channel:
        models = worker_pb2_grpc.VerifierStub(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=30).models

    async def start_old() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_VerifierServicer_to_server(_OlderVerifier(models, protocol), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    old, port = loop.run(start_old())
    try:
        settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5), verifier_address=f"127.0.0.1:{port}",
                                   draft_address=f"127.0.0.1:{stack.draft.port}")
        spoken = protocol or "before 3"
        with pytest.raises(ConnectionError, match=f"speaks worker protocol {spoken}, this gateway {WORKER_PROTOCOL}"):
            loop.run(create_gateway(settings))
    finally:
        loop.run(old.stop(0))
        loop.close()
