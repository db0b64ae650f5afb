"""Worker identity on every stream: a worker refuses a stream meant for another model, and
a worker swapped behind an address never gets a token to a client."""
from __future__ import annotations

import shutil
from dataclasses import replace

import grpc
import pytest

from conftest import request, start_stack
from draft_service.server import create_server as create_draft
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.worker.identity import weights_digest
from test_pipeline import reference_greedy
from verifier_service.server import create_server as create_verifier
from workerstream import WorkerSteps


def model_info(channel, stub_class) -> worker_pb2.ModelInfo:
    return stub_class(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=10).models[0]


def identity(info: worker_pb2.ModelInfo, **changes) -> worker_pb2.ModelIdentity:
    fields = dict(name=info.name, weights_digest=info.weights_digest,
                  tokenizer_fingerprint=info.tokenizer_fingerprint)
    return worker_pb2.ModelIdentity(**{**fields, **changes})


def test_weights_digest_tells_models_apart(model_dirs, tmp_path):
    copy = shutil.copytree(model_dirs["target"], tmp_path / "copy")
    assert weights_digest(copy) == weights_digest(model_dirs["target"])  # content, not place
    assert weights_digest(model_dirs["close"]) != weights_digest(model_dirs["target"])


@pytest.mark.parametrize("worker", ["verifier", "draft"])
@pytest.mark.parametrize("field", ["name", "weights_digest", "tokenizer_fingerprint"])
def test_worker_refuses_a_session_for_another_model(stack, worker, field):
    port = getattr(stack, worker).port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        if worker == "verifier":
            info = model_info(channel, worker_pb2_grpc.VerifierStub)
            stub = worker_pb2_grpc.VerifierStub(channel)
            make = lambda expected, session: worker_pb2.VerifyRequest(  # noqa: E731
                delta=worker_pb2.SequenceDelta(session_id=session, start=0, tokens=[5, 6]), expected_model=expected)
        else:
            info = model_info(channel, worker_pb2_grpc.DraftStub)
            stub = worker_pb2_grpc.DraftStub(channel)
            make = lambda expected, session: worker_pb2.ProposeRequest(  # noqa: E731
                delta=worker_pb2.SequenceDelta(session_id=session, start=0, tokens=[5, 6]), draft_length=2,
                draft_model=info.name, expected_model=expected)
        assert info.weights_digest  # reported at start-up, so the gateway can name it
        steps = WorkerSteps(stub, timeout=30)
        steps.step(make(identity(info), "mine"))  # its own model: served
        with pytest.raises(grpc.RpcError) as err:  # another model: that session is refused...
            steps.step(make(identity(info, **{field: "someone-else"}), "theirs"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.value.details()
        assert f"holds {info.name!r}" in details and "expects" in details
        steps.step(make(identity(info), "mine-too"))  # ...and the stream goes on serving
        steps.close()


def imposter(model_dirs, tmp_path, like: str, weights_from: str):
    """A model directory named like `like` (same name on the wire) with other weights."""
    path = tmp_path / "imposter" / like
    shutil.copytree(model_dirs[weights_from], path)
    return path


def test_verifier_swapped_behind_its_address_never_reaches_a_client(model_dirs, target_model, tokenizer,
                                                                     tmp_path):
    swapped = start_stack(model_dirs, worker_timeout_s=10.0)
    try:
        prompt = "def fibonacci(n):"
        expected = reference_greedy(target_model, tokenizer, prompt, 40)
        stream = swapped.stub.GenerateStream(request(prompt, max_new_tokens=40))
        got = list(next(stream).token_ids)
        # Same port, same model name, same tokenizer: only the weights differ.
        port = swapped.verifier.port
        swapped.loop.run(swapped.verifier.stop(0))
        wrong = replace(swapped.verifier_settings, target=imposter(model_dirs, tmp_path, "target", "unrelated"),
                        server=replace(swapped.verifier_settings.server, port=port))
        swapped.verifier = swapped.loop.run(create_verifier(wrong))
        try:  # the request in flight: the right tokens, or UNAVAILABLE; never the imposter's
            got += [t for chunk in stream for t in chunk.token_ids]
            assert got == expected
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert got == expected[:len(got)]
        for mode in ("FIXED", "OFF"):  # a new request: refused, not answered by the imposter
            with pytest.raises(grpc.RpcError) as refused:
                swapped.stub.Generate(request(prompt, max_new_tokens=8, mode=mode))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "holds 'target'" in refused.value.details()
        # The right model back on the address: served again, exactly.
        swapped.restart_verifier()
        assert list(swapped.stub.Generate(request(prompt, max_new_tokens=40)).token_ids) == expected
    finally:
        swapped.close()


def test_draft_swapped_behind_its_address_means_plain_decoding(model_dirs, target_model, tokenizer, tmp_path,
                                                                caplog):
    swapped = start_stack(model_dirs, worker_timeout_s=10.0)
    try:
        prompt = "The acceptance rate is"
        expected = reference_greedy(target_model, tokenizer, prompt, 30)
        port = swapped.draft.port
        swapped.loop.run(swapped.draft.stop(0))
        wrong = replace(swapped.draft_settings, drafts={"close": imposter(model_dirs, tmp_path, "close", "unrelated")},
                        server=replace(swapped.draft_settings.server, port=port))
        swapped.draft = swapped.loop.run(create_draft(wrong))
        response = swapped.stub.Generate(request(prompt, max_new_tokens=30, draft_model="close"))
        assert list(response.token_ids) == expected
        assert set(response.stats.draft_lengths) == {0}  # the imposter proposed nothing
        assert "refused a session, it holds another model" in caplog.text  # the mismatch is logged
    finally:
        swapped.close()
