"""The speculative loop against scripted draft and verifier clients: every verdict, a draft
lost mid-request, EOS inside the accepted tokens, sampled steps. No models, no gRPC: the
engine's seam is the two client Protocols (`gateway.proposers.draft.DraftClient`,
`gateway.step.engine.VerifierClient`)."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from gateway.errors import WorkerError
from gateway.policy.gamma import FixedPolicy
from gateway.proposers.base import Proposal, StepContext
from gateway.proposers.hybrid import QUIET_STEPS, HybridChoice
from gateway.proposers.modelfree import GatewayProposer
from gateway.request import Generation, Stopping
from gateway.stats.costmodel import StepCosts
from gateway.step.engine import QUIET_RUN_STEPS, ModelBounds, speculate
from gateway.step.records import Bound, Finish, RequestStats, StepRecord
from specd.contract import SUFFIX
from specd.rejection import Draws, recovered_token, sample, target_verdict
from specd.sampling import Transform
from specd.steps import DraftReply, DraftRequest, Scores

VOCAB = 16
EOS = 15


def truth(prefix: list[int]) -> int:
    """The scripted target's greedy choice after a prefix: its length, mod 10."""
    return len(prefix) % 10


class ScriptedDraft:
    """Proposes the target's own tokens except at the positions (counted from the prompt's
    end) listed in `wrong`; raises `fail` at step `fail_at`."""

    def __init__(self, wrong: frozenset[int] | set[int] = frozenset(), fail_at: int | None = None,
                 fail: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, tokens: dict[int, int] | None = None) -> None:
        self.wrong, self.fail_at, self.fail = wrong, fail_at, fail
        self.tokens = tokens or {}  # position → token proposed there, whatever the target says
        self.steps = 0
        self.closed = False
        self.last_exchange_bytes = 0
        self.prompt_length: int | None = None

    async def draft(self, committed: list[int], request: DraftRequest, draft_model: str, carrier: dict[str, str],
                      pre_draft=None) -> DraftReply:
        self.min_confidence = request.min_confidence
        if self.steps == self.fail_at:
            raise WorkerError(self.fail, "scripted failure")
        self.steps += 1
        tokens, prefix = [], list(committed)
        for _ in range(request.draft_length):
            position = len(prefix)
            token = self.tokens.get(position, truth(prefix))
            if position - PROMPT_LENGTH in self.wrong:
                token = (token + 1) % 10
            tokens.append(token)
            prefix.append(token)
        return DraftReply(tokens, None, 0.0)

    def advance(self, position: int) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class ScriptedVerifier:
    """Scores every position with `truth`, or with `eos_at` (positions that are EOS)."""

    def __init__(self, eos_at: frozenset[int] | set[int] = frozenset()) -> None:
        self.eos_at = eos_at
        self.last_exchange_bytes = 0
        self.run_ahead: list[int] = []  # how many plain steps each step told the verifier follow

    async def verify(self, committed: list[int], draft_tokens: list[int], transform: Transform,
                     carrier: dict[str, str], draft_token_probs=(), draws=None, run_ahead=0,
                     ahead_uniforms=(), logprobs=None, allowed=None) -> Scores:
        self.run_ahead.append(run_ahead)
        argmax, prefix = [], list(committed)
        for token in [*draft_tokens, None]:
            argmax.append(EOS if len(prefix) in self.eos_at else truth(prefix))
            if token is not None:
                prefix.append(token)
        return Scores(argmax, None, 0.0)

    def advance(self, position: int) -> None:
        pass


PROMPT = [1, 2, 3]
PROMPT_LENGTH = len(PROMPT)
BOUNDS = ModelBounds(draft_context=256, vocab_size=VOCAB, eos_token_ids=frozenset({EOS}))


def run(draft, verifier, gamma: int, max_new_tokens: int = 12) -> tuple[list[int], Finish | None, list[StepRecord]]:
    request = Generation(PROMPT, Transform(), seed=1, stopping=Stopping(max_new_tokens), draft_model="d")
    stats = RequestStats()
    tokens: list[int] = []
    finish = None

    async def drive() -> None:
        nonlocal finish
        async for committed in speculate(request, FixedPolicy(gamma), draft, verifier, BOUNDS, [stats]):
            tokens.extend(committed.tokens)
            finish = committed.finish or finish

    asyncio.run(drive())
    return tokens, finish, stats.records


def target_alone(max_new_tokens: int = 12) -> list[int]:
    prefix = list(PROMPT)
    for _ in range(max_new_tokens):
        prefix.append(truth(prefix))
    return prefix[PROMPT_LENGTH:]


def test_every_proposal_accepted_ends_each_step_with_the_bonus_token():
    tokens, finish, records = run(ScriptedDraft(), ScriptedVerifier(), gamma=3)
    assert tokens == target_alone() and finish is Finish.LENGTH
    assert [(r.accepted, r.bonus, len(r.emitted)) for r in records] == [(3, True, 4)] * 3


@pytest.mark.parametrize("wrong,verdicts", [
    # (accepted, bonus, tokens committed) per step, γ = 3, 12 new tokens; the last step's γ
    # shrinks so as not to pass 12.
    ({0}, [(0, False, 1), (3, True, 4), (3, True, 4), (2, True, 3)]),  # the first proposal rejected
    ({1}, [(1, False, 2), (3, True, 4), (3, True, 4), (1, True, 2)]),  # one in the middle
    ({2}, [(2, False, 3), (3, True, 4), (3, True, 4), (0, True, 1)]),  # the last one
    ({3}, [(3, True, 4)] * 3),  # the bonus position is the target's own: a draft error there is never proposed
])
def test_each_verdict_commits_the_target_token_at_the_first_rejection(wrong, verdicts):
    tokens, _, records = run(ScriptedDraft(wrong=wrong), ScriptedVerifier(), gamma=3)
    assert tokens == target_alone()
    got = [(r.accepted, r.bonus, len(r.emitted)) for r in records]
    assert got == verdicts


def test_the_requests_confidence_threshold_goes_to_the_draft():
    """A draft setting carried by the request, not by the γ policy."""
    draft = ScriptedDraft()
    request = Generation(PROMPT, Transform(), seed=1, stopping=Stopping(4), draft_model="d", min_confidence=0.7)

    async def drive() -> None:
        async for _ in speculate(request, FixedPolicy(3), draft, ScriptedVerifier(), BOUNDS):
            pass

    asyncio.run(drive())
    assert draft.min_confidence == 0.7


def test_a_plain_step_has_no_draft_hop():
    draft = ScriptedDraft()
    tokens, _, records = run(draft, ScriptedVerifier(), gamma=0)
    assert tokens == target_alone() and draft.steps == 0
    assert all(r.draft_length == 0 and len(r.emitted) == 1 for r in records)


def test_only_a_request_left_to_plain_steps_lets_the_verifier_run_ahead():
    """With no draft (OFF, or a draft lost) every plain step says how many plain steps
    follow, up to the request's last token; with a draft, as many as the γ policy foresees
    (all, for a fixed γ = 0); while a draft may still propose, none does."""
    verifier = ScriptedVerifier()
    tokens, _, _ = run(None, verifier, gamma=0, max_new_tokens=6)
    assert tokens == target_alone(6) and verifier.run_ahead == [5, 4, 3, 2, 1, 0]
    verifier = ScriptedVerifier()
    run(ScriptedDraft(), verifier, gamma=0, max_new_tokens=6)
    assert verifier.run_ahead == [5, 4, 3, 2, 1, 0]
    verifier = ScriptedVerifier()
    run(ScriptedDraft(), verifier, gamma=0, max_new_tokens=80)
    assert verifier.run_ahead[:2] == [64, 64]  # at most RUN_AHEAD_STEPS
    verifier = ScriptedVerifier()
    run(ScriptedDraft(), verifier, gamma=2, max_new_tokens=6)
    assert not any(verifier.run_ahead)
    verifier = ScriptedVerifier()
    run(ScriptedDraft(wrong={5}, fail_at=2), verifier, gamma=3)
    after_loss = verifier.run_ahead[2:]
    assert verifier.run_ahead[:2] == [0, 0] and all(after_loss[:-1]) and after_loss[-1] == 0


class Echo(GatewayProposer):
    """A model-free proposer that offers the target's own next tokens after the commits
    listed in `at` (committed lengths), and nothing elsewhere; it counts its lookups."""

    name = SUFFIX

    def __init__(self, at: set[int]) -> None:
        self.at, self.lookups = at, 0

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        self.lookups += 1
        if len(context.committed) not in self.at:
            return self.proposal([])
        prefix = list(context.committed)
        for _ in range(min(3, max_tokens)):
            prefix.append(truth(prefix))
        return self.proposal(prefix[len(context.committed):], (1.0,) * (len(prefix) - len(context.committed)))

    def index(self, committed) -> None:
        pass


def run_hybrid(proposer: Echo, verifier: ScriptedVerifier, max_new_tokens: int) -> list[StepRecord]:
    request = Generation(PROMPT, Transform(), seed=1, stopping=Stopping(max_new_tokens), draft_model="d")
    hybrid = HybridChoice([proposer], StepCosts(), lambda name: StepCosts(), model_alpha=lambda: 0.0, timed=False)
    bounds = ModelBounds(draft_context=256, vocab_size=VOCAB, eos_token_ids=frozenset({EOS}), target_context=256)
    stats = RequestStats()

    async def drive() -> list[int]:
        tokens: list[int] = []
        async for committed in speculate(request, FixedPolicy(0), None, verifier, bounds, [stats],
                                         hybrid=hybrid, max_model_free=8):
            tokens.extend(committed.tokens)
        return tokens

    assert asyncio.run(drive()) == target_alone(max_new_tokens)
    return stats.records


def test_once_model_free_matches_stop_paying_the_verifier_runs_ahead_between_lookups():
    """Plain decoding beside model-free proposers: a lookup every step while matches may
    pay; after QUIET_STEPS steps without an accepted match, a run of QUIET_RUN_STEPS plain
    steps that look for nothing, then a lookup; an accepted match starts the count again."""
    never, verifier = Echo(set()), ScriptedVerifier()
    run_hybrid(never, verifier, max_new_tokens=30)
    assert QUIET_STEPS == 2 and QUIET_RUN_STEPS == 8
    assert verifier.run_ahead == [0, 0] + ([8] + [0] * 8) * 3 + [0]  # the last step: nothing follows
    assert never.lookups == 2 + 3  # and none at the last step, which leaves no room for a proposal
    # A match at the lookup after the first run is accepted: lookups every step again.
    matched, verifier = Echo({PROMPT_LENGTH + 11}), ScriptedVerifier()
    records = run_hybrid(matched, verifier, max_new_tokens=30)
    assert [r.proposer for r in records[10:13]] == ["", SUFFIX, ""]
    assert records[11].accepted == 3 and verifier.run_ahead[11:15] == [0, 0, 0, 8]


def test_a_sampled_request_sends_the_uniforms_of_the_steps_ahead_early_and_in_order():
    """Sampled and plain from the first step: each step also carries the uniforms of the
    plain steps the verifier may run ahead, which those steps then take in turn, so the
    request draws the same uniforms in the same order as without run-ahead, and a seed
    gives the same output."""
    sent: list[tuple[float, int, list[float]]] = []

    class PlainSampledVerifier(ScriptedVerifier):
        async def verify(self, committed, draft_tokens, transform, carrier, draft_token_probs=(),
                         draws=None, run_ahead=0, ahead_uniforms=(), logprobs=None, allowed=None) -> Scores:
            sent.append((draws.final, run_ahead, list(ahead_uniforms)))
            p = torch.full((1, VOCAB), 1.0 / VOCAB)
            return Scores(None, target_verdict([], [], p, draws), 0.0)

    request = Generation(PROMPT, Transform(temperature=1.0), seed=11, stopping=Stopping(6), draft_model="")

    async def drive() -> list[int]:
        return [t async for c in speculate(request, FixedPolicy(0), None, PlainSampledVerifier(), BOUNDS)
                for t in c.tokens]

    tokens = asyncio.run(drive())
    expected = torch.rand(6, generator=torch.Generator().manual_seed(11), dtype=torch.float64).tolist()
    assert len(tokens) == 6 and [final for final, _, _ in sent] == expected
    assert [(run, ahead) for _, run, ahead in sent] == [(5 - i, expected[i + 1:]) for i in range(6)]


def test_a_draft_lost_mid_request_leaves_the_rest_to_the_target():
    draft = ScriptedDraft(wrong={5}, fail_at=2)
    tokens, finish, records = run(draft, ScriptedVerifier(), gamma=3)
    assert tokens == target_alone() and finish is Finish.LENGTH
    assert draft.closed  # its session is dropped
    assert [r.draft_length for r in records[:2]] == [3, 3] and all(r.draft_length == 0 for r in records[2:])


def test_a_client_deadline_in_the_draft_hop_ends_the_request():
    draft = ScriptedDraft(fail_at=1, fail=grpc.StatusCode.DEADLINE_EXCEEDED)
    with pytest.raises(WorkerError) as raised:
        run(draft, ScriptedVerifier(), gamma=3)
    assert raised.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_eos_inside_the_accepted_tokens_ends_the_request_there():
    """The draft proposes the target's EOS and tokens after it; the step commits up to EOS."""
    eos_position = PROMPT_LENGTH + 5
    draft = ScriptedDraft(tokens={eos_position: EOS})
    tokens, finish, records = run(draft, ScriptedVerifier(eos_at={eos_position}), gamma=3)
    assert finish is Finish.EOS
    assert tokens == target_alone()[:5] + [EOS]
    assert records[-1].accepted == 3 and records[-1].emitted[-1] == EOS  # accepted past EOS, cut at it


def test_max_new_tokens_bounds_the_last_step():
    tokens, finish, records = run(ScriptedDraft(), ScriptedVerifier(), gamma=4, max_new_tokens=7)
    assert tokens == target_alone(7) and finish is Finish.LENGTH
    assert records[-1].draft_length == 1  # γ shrinks so a step never emits past the limit


def test_sampled_steps_use_the_draft_q_and_the_target_p():
    """Draft q = target p: every proposal is accepted whatever was drawn (rejection sampling
    accepts with probability min(1, p/q) = 1)."""

    class SampledDraft(ScriptedDraft):
        async def draft(self, committed, request, *args, **kwargs) -> DraftReply:
            proposal = await super().draft(committed, request, *args, **kwargs)
            return DraftReply(proposal.tokens, None, 0.0, token_probs=(1.0 / VOCAB,) * request.draft_length)

    class SampledVerifier(ScriptedVerifier):
        async def verify(self, committed, draft_tokens, transform, carrier, draft_token_probs=(),
                         draws=None, run_ahead=0, ahead_uniforms=(), logprobs=None, allowed=None) -> Scores:
            p = torch.full((len(draft_tokens) + 1, VOCAB), 1.0 / VOCAB)
            return Scores(None, target_verdict(draft_tokens, draft_token_probs, p, draws), 0.0)

    request = Generation(PROMPT, Transform(temperature=1.0), seed=7, stopping=Stopping(12), draft_model="d")
    stats = RequestStats()

    async def drive() -> list[int]:
        return [t async for c in speculate(request, FixedPolicy(3), SampledDraft(), SampledVerifier(), BOUNDS,
                                           [stats]) for t in c.tokens]

    tokens = asyncio.run(drive())
    assert len(tokens) == 12 and all(r.accepted == r.draft_length for r in stats.records)


def _law(prefix: list[int], shift: int) -> torch.Tensor:
    """A scripted model's distribution after `prefix` (its length and last token move it)."""
    logits = torch.arange(VOCAB, dtype=torch.float64) * 0.3 * ((len(prefix) + shift) % 3 - 1) + prefix[-1] % 4
    logits[(len(prefix) * 7 + shift) % VOCAB] += 2.0
    logits[EOS] = -torch.inf  # the request runs to its length
    return torch.softmax(logits, 0).float()


class KeepingDraft(ScriptedDraft):
    """A sampled draft that keeps its q rows, as the draft service does, and draws the
    recovered token where it is asked to, from them. Logs every proposal with its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: tuple[int, torch.Tensor] | None = None  # (position of x₁, q rows)
        self.proposals: list[tuple[int, list[int], torch.Tensor]] = []  # (position of x₁, tokens, q rows)
        self.recoveries: list[tuple[int, float]] = []  # (position, uniform)

    async def draft(self, committed, request, draft_model, carrier, pre_draft=None, recovery=None) -> DraftReply:
        self.steps += 1
        prefix, recovered = list(committed), None
        if recovery is not None:
            assert self.kept is not None  # a recovery follows a sampled proposal
            kept_start, kept_rows = self.kept
            recovered = recovered_token(recovery.target_row, kept_rows[len(prefix) - kept_start], recovery.uniform)
            self.recoveries.append((len(prefix), recovery.uniform))
            prefix.append(recovered)
        generator = torch.Generator().manual_seed(request.seed)
        start, tokens, rows = len(prefix), [], []
        for _ in range(request.draft_length):
            q = _law(prefix, 0)
            token = sample(q, float(torch.rand((), generator=generator, dtype=torch.float64)))
            tokens.append(token)
            rows.append(q)
            prefix.append(token)
        q_rows = torch.stack(rows) if rows else torch.zeros(0, VOCAB)
        self.kept = (start, q_rows)
        self.proposals.append((start, tokens, q_rows))
        return DraftReply(tokens, None, 0.0, token_probs=tuple(float(q[t]) for q, t in zip(rows, tokens)),
                        recovered=recovered)


class LawVerifier(ScriptedVerifier):
    """A sampled target whose p is `_law(prefix, 1)`; logs each step's p rows and draws."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, list[int], torch.Tensor, Draws]] = []

    async def verify(self, committed, draft_tokens, transform, carrier, draft_token_probs=(), draws=None,
                     run_ahead=0, ahead_uniforms=(), logprobs=None, allowed=None) -> Scores:
        prefix, rows = list(committed), []
        for token in [*draft_tokens, None]:
            rows.append(_law(prefix, 1))
            if token is not None:
                prefix.append(token)
        p = torch.stack(rows)
        self.steps.append((len(committed), list(draft_tokens), p, draws))
        return Scores(None, target_verdict(draft_tokens, draft_token_probs, p, draws), 0.0)


class WrongGuesses(FixedPolicy):
    """γ from a script, always saying every step ahead is plain: the guess AUTO makes once
    it settles on plain decoding, here wrong before every proposing step."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(0)
        self.script = script
        self.steps = 0

    def next_draft_length(self, bound: Bound | None) -> int:
        gamma = self.script[self.steps % len(self.script)]
        self.steps += 1
        return gamma

    def plain_steps_ahead(self, limit: int) -> int:
        return limit  # the verifier scores ahead as far as it may, and many uniforms are drawn early

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        return gamma


@pytest.mark.parametrize("gamma", [1, 3])
def test_a_recovered_token_drawn_by_the_draft_is_the_papers_draw_for_draw(gamma: int):
    """Sampled, q ≠ p: every rejected step asks the draft (which keeps q) for its recovered
    token, with p's row and the step's last uniform, and that hop brings the next step's
    proposal, so a step still costs one draft hop. Step by step, what is committed is what
    Leviathan et al.'s loop decides with the same proposal, p, q and draws."""
    from test_rejection import reference_rejection_sample

    draft, verifier = KeepingDraft(), LawVerifier()
    request = Generation(PROMPT, Transform(temperature=1.0), seed=5, stopping=Stopping(40), draft_model="d")
    stats = RequestStats()
    # γ = 0 between proposing steps, each plain step guessing (wrongly, before a proposing
    # one) that the next is plain too: the uniform it drew early opens the next step's draws.
    policy = FixedPolicy(gamma) if gamma == 3 else WrongGuesses([0, 0, gamma])

    async def drive() -> list[int]:
        return [t async for c in speculate(request, policy, draft, verifier, BOUNDS, [stats])
                for t in c.tokens]

    tokens = asyncio.run(drive())
    records = stats.records
    assert len(tokens) == 40 and len(verifier.steps) == len(records)
    rejected = [r for r in records if not r.bonus]
    assert rejected and len(draft.recoveries) == len(rejected)  # q ≠ p: some steps reject
    proposals = {start: (proposed, rows) for start, proposed, rows in draft.proposals}
    for record, (position, proposed, p, draws) in zip(records, verifier.steps):
        made, q = proposals[position] if proposed else ([], torch.zeros(0, VOCAB))  # a plain last step
        assert proposed == made[:len(proposed)]  # the step verified (a prefix of) a proposal the draft made
        reference = reference_rejection_sample(torch.tensor(proposed), q[:len(proposed)], p, draws)
        assert (record.accepted, record.token, record.bonus) == (reference.accepted, reference.token, reference.bonus)
    draws_of = {record.index: draws for record, (*_, draws) in zip(records, verifier.steps)}
    for record, (position, uniform) in zip(rejected, draft.recoveries):  # where, and with the step's last uniform
        assert position == record.position + record.accepted and uniform == draws_of[record.index].final
    # One draft hop a step: the recovery hop brought the next proposal (the last may ask γ = 0).
    assert draft.steps <= len(records) + 1
    # The seed gives the same output again, the uniforms drawn early included.
    draft, verifier, stats = KeepingDraft(), LawVerifier(), RequestStats()
    policy = FixedPolicy(gamma) if gamma == 3 else WrongGuesses([0, 0, gamma])
    assert asyncio.run(drive()) == tokens


def test_no_recovered_token_is_asked_for_after_an_accepted_eos():
    """The draft proposes EOS then another token; the target accepts EOS and rejects the next:
    the request ends at EOS, so no token after it is drawn and the draft is not asked."""
    asked: list = []

    class EosDraft(ScriptedDraft):
        async def draft(self, committed, request, draft_model, carrier, pre_draft=None, recovery=None):
            asked.append(recovery)
            return DraftReply([EOS, 3], None, 0.0, token_probs=(1.0, 1.0))

    class EosVerifier(ScriptedVerifier):
        async def verify(self, committed, draft_tokens, transform, carrier, draft_token_probs=(), draws=None,
                         run_ahead=0, ahead_uniforms=(), logprobs=None, allowed=None) -> Scores:
            p = torch.zeros(len(draft_tokens) + 1, VOCAB)
            p[0, EOS], p[1:, 5] = 1.0, 1.0  # EOS surely accepted, 3 surely rejected
            return Scores(None, target_verdict(draft_tokens, draft_token_probs, p, draws), 0.0)

    request = Generation(PROMPT, Transform(temperature=1.0), seed=3, stopping=Stopping(12), draft_model="d")
    stats = RequestStats()

    async def drive() -> list:
        return [c async for c in speculate(request, FixedPolicy(2), EosDraft(), EosVerifier(), BOUNDS, [stats])]

    (output,) = asyncio.run(drive())
    assert output.tokens == [EOS] and output.finish is Finish.EOS and asked == [None]
    assert stats.records[0].accepted == 1 and not stats.records[0].bonus


def test_a_deadline_too_far_for_the_wire_is_sent_as_the_longest_it_can_say():
    from gateway.workers.links import _expires_in_ms

    assert _expires_in_ms(None) == 0
    assert _expires_in_ms(0.0001) == 1  # a deadline just ahead is never "none"
    assert _expires_in_ms(2.5) == 2500
    assert _expires_in_ms(60 * 86400.0) == 2 ** 32 - 1  # 60 days
