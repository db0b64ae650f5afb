"""The recovered token is drawn where q is: the draft service keeps a sampled proposal's q
rows, and after a rejection it is sent p's row (`specd.steps.Recovery`) with the next
proposal request. A real ModelRunner on the tiny draft made in the test, then the real
services on loopback: bad recoveries, and a draft lost while it held q."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from specd.rejection import recovered_token
from specd.sampling import Transform
from specd.steps import DraftRequest, PreDraftRequest, Recovery
from specd.worker.runtime import ModelRunner

PROMPT = [5, 6, 7, 8, 9]
SAMPLED = Transform(temperature=1.0)


def _target_row(vocab: int, seed: int) -> torch.Tensor:
    """A p row unlike the draft's q: what a target might send after a rejection."""
    return torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3, 0)


def test_kept_rows_draw_the_recovered_token_and_the_next_proposal_follows_it(model_dirs):
    """The draft proposes γ = 4 with its q rows kept; the gateway reports x₁ accepted and x₂
    rejected: the recovered token is the residual's draw at x₂'s position from the kept q,
    and a fresh session fed the same committed tokens plus that token proposes the same."""
    runner = ModelRunner(model_dirs["close"])
    p = _target_row(runner.info.vocab_size, 1)

    async def scenario():
        first = await runner.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        assert first.probs is not None and len(first.tokens) == 4
        expected = recovered_token(p, first.probs[1], 0.37)
        after = await runner.propose("a", len(PROMPT) + 1, [], DraftRequest(3, SAMPLED, seed=4), None,
                                     Recovery(p, 0.37))
        fresh = await runner.propose("b", 0, [*PROMPT, first.tokens[0], expected], DraftRequest(3, SAMPLED, seed=4))
        await runner.close()
        return expected, after, fresh

    expected, after, fresh = asyncio.run(scenario())
    assert after.recovered == expected
    assert after.tokens == fresh.tokens and after.token_probs == pytest.approx(fresh.token_probs, rel=1e-5)


def test_a_rebuilt_session_draws_the_same_recovered_token(model_dirs):
    """The session was lost (evicted, or the draft restarted) between the proposal and its
    recovery: re-opened from the committed tokens, its forward finds the same q at the
    rejected position, so the recovered token and the next proposal are the same."""
    runner = ModelRunner(model_dirs["close"])
    p = _target_row(runner.info.vocab_size, 2)

    async def scenario():
        first = await runner.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        kept = await runner.propose("a", len(PROMPT) + 2, [], DraftRequest(3, SAMPLED, seed=4), None,
                                    Recovery(p, 0.61))
        rebuilt = await runner.propose("b", 0, [*PROMPT, *first.tokens[:2]], DraftRequest(3, SAMPLED, seed=4), None,
                                       Recovery(p, 0.61))
        await runner.close()
        return kept, rebuilt

    kept, rebuilt = asyncio.run(scenario())
    assert kept.recovered is not None and rebuilt.recovered == kept.recovered
    assert rebuilt.tokens == kept.tokens


@pytest.mark.parametrize("rebuilt", [False, True])
def test_a_recovery_alone_commits_the_token_for_the_next_step(model_dirs, rebuilt: bool):
    """γ = 0 (the request's last token, or the policy's plain step next): the draft draws
    the recovered token and holds it, so its next step starts after it."""
    runner = ModelRunner(model_dirs["close"])
    p = _target_row(runner.info.vocab_size, 3)

    async def scenario():
        first = await runner.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        if rebuilt:
            runner.end_session("a")
            alone = await runner.propose("a", 0, [*PROMPT, first.tokens[0]], DraftRequest(0, SAMPLED), None,
                                         Recovery(p, 0.5))
        else:
            alone = await runner.propose("a", len(PROMPT) + 1, [], DraftRequest(0, SAMPLED), None, Recovery(p, 0.5))
        assert alone.recovered is not None and alone.tokens == []
        # It holds the recovered token: the next step sends nothing new.
        then = await runner.propose("a", len(PROMPT) + 2, [], DraftRequest(2, SAMPLED, seed=9))
        fresh = await runner.propose("b", 0, [*PROMPT, first.tokens[0], alone.recovered],
                                     DraftRequest(2, SAMPLED, seed=9))
        await runner.close()
        return then, fresh

    then, fresh = asyncio.run(scenario())
    assert then.tokens == fresh.tokens


def test_a_pre_drafted_branch_answers_a_recovery_that_draws_its_guess(model_dirs):
    """Overlap: the draft pre-drafted the branch where x₁ is rejected and the target commits
    its other guess there. A recovery that draws that guess (p all on it) is answered from
    the branch, with the recovered token."""
    runner = ModelRunner(model_dirs["close"], pre_draft_branches="all")

    async def scenario():
        first = await runner.propose("a", 0, PROMPT, DraftRequest(3, SAMPLED, seed=3), PreDraftRequest(3, 4))
        assert first.pre_draft is not None
        await first.pre_draft
        guess = runner.pre_drafts._pending["a"].branches
        alternative = next(b.token for b in guess if b.start == len(PROMPT))
        p = torch.zeros(runner.info.vocab_size)
        p[alternative] = 1.0
        answered = await runner.propose("a", len(PROMPT), [], DraftRequest(3, SAMPLED, seed=4), None,
                                        Recovery(p, 0.5))
        await runner.close()
        return alternative, answered

    alternative, answered = asyncio.run(scenario())
    assert answered.recovered == alternative and answered.pre_drafted


BAD_RECOVERIES = {
    "greedy": (dict(transform=0.0), "belongs to a sampled step"),
    "uniform": (dict(uniform=1.5), "recovery.uniform must be in [0, 1)"),
    "row": (dict(positions=2), "one dense row"),
    "nan": (dict(fill=float("nan")), "finite, non-negative probabilities"),
    "negative": (dict(fill=-1.0), "finite, non-negative probabilities"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECOVERIES))
def test_a_bad_recovery_is_invalid_argument_and_the_draft_keeps_serving(stack, case: str):
    from specd.v1 import worker_pb2, worker_pb2_grpc
    from workerstream import WorkerSteps

    changes, message = BAD_RECOVERIES[case]
    vocab = 320
    row = torch.full((changes.get("positions", 1), vocab), 1.0 / vocab)
    row[0, 0] = changes.get("fill", row[0, 0])
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        steps = WorkerSteps(worker_pb2_grpc.DraftStub(channel))
        opened = steps.step(worker_pb2.ProposeRequest(
            delta=worker_pb2.SequenceDelta(session_id="s", start=0, tokens=PROMPT), draft_length=2,
            transform=worker_pb2.Transform(temperature=1.0), seed=1))
        bad = worker_pb2.ProposeRequest(
            delta=worker_pb2.SequenceDelta(session_id="s", start=len(PROMPT)), draft_length=2,
            transform=worker_pb2.Transform(temperature=changes.get("transform", 1.0)), seed=2,
            recovery=worker_pb2.Recovery(
                target_row=worker_pb2.Distributions(positions=row.shape[0], vocab_size=vocab,
                                                    probs=row.numpy().tobytes()),
                uniform=changes.get("uniform", 0.5)))
        with pytest.raises(grpc.RpcError) as err:
            steps.step(bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
        good = worker_pb2.ProposeRequest()
        good.CopyFrom(bad)
        good.transform.temperature = 1.0
        good.recovery.uniform = 0.5
        good.recovery.target_row.CopyFrom(worker_pb2.Distributions(
            positions=1, vocab_size=vocab, probs=torch.full((vocab,), 1.0 / vocab).numpy().tobytes()))
        answered = steps.step(good)  # the session and the service are as they were
        steps.close()
    assert len(opened.draft_token_probs) == 2 and answered.HasField("recovered_token")
    assert len(answered.draft_tokens) == 2


def test_a_draft_lost_while_it_holds_q_fails_the_request_and_the_gateway_serves_on(model_dirs):
    """A sampled request whose next step needs a recovered token from a draft that is gone
    for good: nothing else holds that q, so the request ends UNAVAILABLE (exactness over
    availability, docs/reliability.md) rather than drawing a token from another law. The
    gateway keeps serving: the next request decodes plainly."""
    from conftest import request, start_stack

    lone = start_stack(model_dirs, drafts=("unrelated",), worker_timeout_s=5.0)
    try:
        stream = lone.stub.GenerateStream(request("def fibonacci(n):", temperature=1.0, seed=7, max_new_tokens=60,
                                                  draft_length=4))
        next(stream)
        lone.loop.run(lone.draft.stop(0))  # gone for good: nothing comes back on its port
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "recovered token" in err.value.details()
        after = lone.stub.Generate(request("def fibonacci(n):", max_new_tokens=8))
        assert len(after.token_ids) == 8
    finally:
        lone.close()
