"""The recovered token is drawn where q is: the draft service keeps a sampled proposal's q
rows, and after a rejection it is sent p's row (`specd.steps.Recovery`) with the next
proposal request. A real Drafter on the tiny draft made in the test, then the real
services on loopback: bad recoveries, and a draft lost while it held q."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from draft_service.drafter import Drafter
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
    drafter = Drafter(model_dirs["close"])
    p = _target_row(drafter.runner.info.vocab_size, 1)

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        assert first.probs is not None and len(first.tokens) == 4
        expected = recovered_token(p, first.probs[1], 0.37)
        after = await drafter.propose("a", len(PROMPT) + 1, [], DraftRequest(3, SAMPLED, seed=4), None,
                                      Recovery(p, 0.37))
        fresh = await drafter.propose("b", 0, [*PROMPT, first.tokens[0], expected], DraftRequest(3, SAMPLED, seed=4))
        await drafter.runner.close()
        return expected, after, fresh

    expected, after, fresh = asyncio.run(scenario())
    assert after.recovered == expected
    assert after.tokens == fresh.tokens and after.token_probs == pytest.approx(fresh.token_probs, rel=1e-5)


def test_a_rebuilt_session_draws_the_same_recovered_token(model_dirs):
    """The session was lost (evicted, or the draft restarted) between the proposal and its
    recovery: re-opened from the committed tokens, its forward finds the same q at the
    rejected position, so the recovered token and the next proposal are the same."""
    drafter = Drafter(model_dirs["close"])
    p = _target_row(drafter.runner.info.vocab_size, 2)

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        kept = await drafter.propose("a", len(PROMPT) + 2, [], DraftRequest(3, SAMPLED, seed=4), None,
                                     Recovery(p, 0.61))
        rebuilt = await drafter.propose("b", 0, [*PROMPT, *first.tokens[:2]], DraftRequest(3, SAMPLED, seed=4), None,
                                        Recovery(p, 0.61))
        await drafter.runner.close()
        return kept, rebuilt

    kept, rebuilt = asyncio.run(scenario())
    assert kept.recovered is not None and rebuilt.recovered == kept.recovered
    assert rebuilt.tokens == kept.tokens


@pytest.mark.parametrize("rebuilt", [False, True])
def test_a_recovery_alone_commits_the_token_for_the_next_step(model_dirs, rebuilt: bool):
    """γ = 0 (the request's last token, or the policy's plain step next): the draft draws
    the recovered token and holds it, so its next step starts after it."""
    drafter = Drafter(model_dirs["close"])
    p = _target_row(drafter.runner.info.vocab_size, 3)

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        if rebuilt:
            drafter.runner.end_session("a")
            alone = await drafter.propose("a", 0, [*PROMPT, first.tokens[0]], DraftRequest(0, SAMPLED), None,
                                          Recovery(p, 0.5))
        else:
            alone = await drafter.propose("a", len(PROMPT) + 1, [], DraftRequest(0, SAMPLED), None, Recovery(p, 0.5))
        assert alone.recovered is not None and alone.tokens == []
        # It holds the recovered token: the next step sends nothing new.
        then = await drafter.propose("a", len(PROMPT) + 2, [], DraftRequest(2, SAMPLED, seed=9))
        fresh = await drafter.propose("b", 0, [*PROMPT, first.tokens[0], alone.recovered],
                                      DraftRequest(2, SAMPLED, seed=9))
        await drafter.runner.close()
        return then, fresh

    then, fresh = asyncio.run(scenario())
    assert then.tokens == fresh.tokens


def test_a_pre_drafted_branch_answers_a_recovery_that_draws_its_guess(model_dirs):
    """Overlap: the draft pre-drafted the branch where x₁ is rejected and the target commits
    its other guess there. A recovery that draws that guess (p all on it) is answered from
    the branch, with the recovered token."""
    drafter = Drafter(model_dirs["close"], pre_draft_branches="all")

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(3, SAMPLED, seed=3), PreDraftRequest(3, 4))
        assert first.pre_draft is not None
        await first.pre_draft
        guess = drafter.pre_drafts._pending["a"].branches
        alternative = next(b.token for b in guess if b.start == len(PROMPT))
        p = torch.zeros(drafter.runner.info.vocab_size)
        p[alternative] = 1.0
        answered = await drafter.propose("a", len(PROMPT), [], DraftRequest(3, SAMPLED, seed=4), None,
                                         Recovery(p, 0.5))
        await drafter.runner.close()
        return alternative, answered

    alternative, answered = asyncio.run(scenario())
    assert answered.recovered == alternative and answered.pre_drafted


@pytest.mark.parametrize("rebuilt", [False, True])
def test_a_recovered_token_the_draft_cannot_feed_ends_its_proposal(model_dirs, rebuilt: bool):
    """The target's vocabulary is wider than the draft's embedding (Qwen2.5's 0.5B and 7B
    differ by 128 ids), and the residual drew an id beyond the draft's: the draft returns
    it with no proposal, and neither fails the step nor feeds the id to its embedding (which
    would fail every session in the batched forward)."""
    drafter = Drafter(model_dirs["close"])
    vocab = drafter.runner.info.vocab_size
    p = torch.zeros(vocab + 64)
    p[vocab + 30] = 1.0

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(3, SAMPLED, seed=3, vocab_limit=vocab + 64))
        request = DraftRequest(3, SAMPLED, seed=4, vocab_limit=vocab + 64)
        if rebuilt:
            answered = await drafter.propose("b", 0, [*PROMPT, first.tokens[0]], request, None, Recovery(p, 0.5))
        else:
            answered = await drafter.propose("a", len(PROMPT) + 1, [], request, None, Recovery(p, 0.5))
        later = await drafter.propose("c", 0, PROMPT, DraftRequest(2, SAMPLED, seed=5))  # it serves on
        await drafter.runner.close()
        return answered, later

    answered, later = asyncio.run(scenario())
    assert answered.recovered == vocab + 30 and answered.tokens == [] and len(later.tokens) == 2


def test_a_sparse_row_travels_sparse_and_draws_the_same_token():
    """Top-k/top-p: the verifier sends p's support only, and so does the gateway to the draft."""
    from specd.v1 import worker_pb2
    from specd.wire import recovery_from_pb, recovery_to_pb

    p = torch.zeros(131_072)
    p[[7, 4000, 99_999]] = torch.tensor([0.5, 0.3, 0.2])
    sparse, dense = recovery_to_pb(Recovery(p, 0.4), sparse=True), recovery_to_pb(Recovery(p, 0.4), sparse=False)
    assert sparse.ByteSize() < 100 < 500_000 < dense.ByteSize()
    back = recovery_from_pb(worker_pb2.ProposeRequest(recovery=sparse))
    assert back is not None and torch.equal(back.target_row, p)


BAD_RECOVERIES: dict[str, tuple[dict[str, float], str]] = {
    "greedy": (dict(transform=0.0), "belongs to a sampled step"),
    "uniform": (dict(uniform=1.5), "recovery.uniform must be in [0, 1)"),
    "row": (dict(positions=2), "must be one row of float32 probabilities"),
    "nan": (dict(fill=float("nan")), "finite, non-negative probabilities"),
    "negative": (dict(fill=-1.0), "finite, non-negative probabilities"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECOVERIES))
def test_a_bad_recovery_is_invalid_argument_and_the_draft_keeps_serving(stack, case: str):
    from specd.v1 import worker_pb2, worker_pb2_grpc
    from workerstream import WorkerSteps

    changes, message = BAD_RECOVERIES[case]
    vocab = 320
    row = torch.full((int(changes.get("positions", 1)), vocab), 1.0 / vocab)
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
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in str(err.value.details())
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


def test_a_full_draft_is_asked_again_for_a_recovery_and_no_answer_is_unavailable(monkeypatch):
    """The link's side: a recovery cannot be skipped like a proposal, so a draft that is full
    (RESOURCE_EXHAUSTED) is asked again after a pause, and one that never answers ends the
    request UNAVAILABLE. The pool and the exchange are stand-ins here (the exchange's own
    re-opens are tested with real services in tests/test_failover.py)."""
    from types import SimpleNamespace

    from gateway.errors import DraftSkipped, WorkerError
    from gateway.workers.budgets import SlowMark
    from gateway.workers.links import DraftLink, LinkSettings, StepOverBudget
    from specd.v1 import worker_pb2

    outcomes: list = []

    async def exchange(committed, build):
        build(worker_pb2.SequenceDelta())  # the message can be built
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    link = DraftLink("draft", SimpleNamespace(slow=SlowMark()), "/specd.v1.Draft/Propose", LinkSettings("s", 3))
    monkeypatch.setattr(link, "exchange", exchange)
    full = WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED, "the draft's queue is full")
    answer = worker_pb2.ProposeResponse(draft_tokens=[4], draft_token_probs=[0.5], recovered_token=9)
    recovery = Recovery(torch.full((8,), 0.125), 0.5)
    request = DraftRequest(1, SAMPLED, seed=1)

    outcomes[:] = [full, full, answer]
    proposal = asyncio.run(link.draft([1, 2], request, "", {}, None, recovery))
    assert proposal.recovered == 9 and proposal.tokens == [4] and not outcomes
    outcomes[:] = [StepOverBudget("hung")] * 4
    with pytest.raises(WorkerError) as failed:
        asyncio.run(link.draft([1, 2], request, "", {}, None, recovery))
    assert failed.value.code == grpc.StatusCode.UNAVAILABLE and "recovered token" in str(failed.value)
    link.pool.slow = SlowMark()  # the hung draft above is marked slow: start afresh
    outcomes[:] = [full]  # a proposal alone is not retried: the step goes on without it
    with pytest.raises(WorkerError):
        asyncio.run(link.draft([1, 2], request, "", {}))
    outcomes[:] = [StepOverBudget("hung")]
    with pytest.raises(DraftSkipped):
        asyncio.run(link.draft([1, 2], request, "", {}))


def test_kept_rows_stay_within_their_budget_and_an_evicted_sessions_recovery_is_the_same(model_dirs):
    """A budget that holds one session's rows: the second sampled proposal pushes out the
    first's, and the first session's recovery, rebuilt with one forward, draws the token
    its kept q would have given."""
    probe = ModelRunner(model_dirs["close"])
    one_session = 4 * probe.info.vocab_size * 4  # γ = 4 rows of float32
    asyncio.run(probe.close())
    drafter = Drafter(model_dirs["close"], kept_rows_bytes=one_session)
    p = _target_row(drafter.runner.info.vocab_size, 4)

    async def scenario():
        first = await drafter.propose("a", 0, PROMPT, DraftRequest(4, SAMPLED, seed=3))
        await drafter.propose("b", 0, PROMPT[::-1], DraftRequest(4, SAMPLED, seed=5))
        held = (len(drafter.kept_rows), drafter.kept_rows.nbytes)
        after = await drafter.propose("a", len(PROMPT) + 2, [], DraftRequest(3, SAMPLED, seed=4), None,
                                      Recovery(p, 0.61))
        await drafter.runner.close()
        return first, held, after

    first, held, after = asyncio.run(scenario())
    assert held == (1, one_session)
    assert first.probs is not None
    assert after.recovered == recovered_token(p, first.probs[2], 0.61)
