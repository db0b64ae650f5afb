"""The speculative loop of one request: the committed sequence, its RNG, and each step.

One step (docs/design.md §2): the draft proposes γ tokens, the verifier scores γ+1 positions
in one forward, and `specd.rejection` decides what is accepted; the accepted tokens
plus one recovered or bonus token are committed. A sampled step that rejects a draft
model's token asks the draft for the recovered token, since only the draft holds its q;
the same hop brings the next step's proposal, which follows that token. A step runs in
three parts: propose (the draft hop), decide (the verifier hop and the verdict) and
commit. Each step ends in a `StepRecord` (`gateway.records`) that every observer reads:
the γ policy, the request's statistics, the server's counters, the tracer. The engine
talks to the workers through two small client Protocols, `DraftClient` and
`VerifierClient` (the gRPC links of `gateway.workers` in production, scripted fakes in
tests/test_engine.py). No protobuf here.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
import torch

from gateway.errors import DraftSkipped, WorkerError
from gateway.grammar import Grammar
from gateway.hybrid import HybridChoice
from gateway.records import DraftLengthPolicy, Finish, NoTracer, StepObserver, StepRecord, StepTracer
from gateway.request import Generation
from specd.rejection import Draws, finish_verdict, verify_greedy
from specd.sampling import Transform
from specd.steps import BatchStats, DraftRequest, PreDraftRequest, Proposal, Recovery, Scores

log = logging.getLogger(__name__)
# The most plain steps a plain step lets the verifier score unasked, with no draft left
# or a γ policy settled on plain decoding (a run stops at the next step the gateway sends).
RUN_AHEAD_STEPS = 64
# The plain steps a run takes while the request's model-free matches are quiet; the next
# step looks for a match again (docs/proposers.md).
QUIET_RUN_STEPS = 8


@dataclass(frozen=True)
class ModelBounds:
    """What the model pair allows a step: the draft's context, the vocabulary, the EOS ids."""

    draft_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    target_context: int = 0  # a model-free proposal may run up to the target's context
    # The request's stop token ids, and whether EOS ends it (not with ignore_eos).
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def ending(self) -> frozenset[int]:
        """The tokens that end the request (finish STOP for a stop token id, else EOS)."""
        return (frozenset() if self.ignore_eos else self.eos_token_ids) | self.stop_token_ids


class DraftClient(Protocol):
    """What a step needs of the draft service: one session's proposals (`gateway.workers.DraftLink`)."""

    last_exchange_bytes: int  # request + response bytes of the last hop

    async def propose(self, committed: list[int], request: DraftRequest, draft_model: str, carrier: dict[str, str],
                      pre_draft: PreDraftRequest | None = None, recovery: Recovery | None = None) -> Proposal:
        """Up to γ draft tokens after `committed`, with qᵢ(xᵢ) unless greedy; DraftSkipped when
        the draft cannot answer this step in time. With `recovery`, the recovered token at
        the end of `committed` first (`Proposal.recovered`), which the tokens follow."""
        ...

    def advance(self, position: int) -> None:
        """The committed sequence is settled up to `position`: the rest of the session's cache is stale."""

    def close(self) -> None:
        """End the session (a step of it still running is dropped)."""


class VerifierClient(Protocol):
    """What a step needs of the verifier: one session's scores (`gateway.workers.VerifierLink`)."""

    last_exchange_bytes: int

    async def verify(self, committed: list[int], draft_tokens: list[int], transform: Transform,
                     carrier: dict[str, str], draft_token_probs: Sequence[float] = (),
                     draws: Draws | None = None, run_ahead: int = 0, ahead_uniforms: Sequence[float] = (),
                     logprobs: int | None = None, allowed: torch.Tensor | None = None) -> Scores:
        """The target's view of the γ+1 positions after `committed`: argmax when greedy, else
        its verdict on the proposal (qᵢ(xᵢ) = draft_token_probs) under the gateway's draws.
        run_ahead: up to that many plain steps follow (sampled: each with its uniform in
        `ahead_uniforms`), so the verifier may score them at once (`verifier_service.runahead`).
        logprobs: the decided positions' raw log-probabilities too, with that many
        alternatives; allowed: a grammar's bitmask words per position (`gateway.grammar`)."""
        ...

    def advance(self, position: int) -> None:
        """As `DraftClient.advance`."""


@dataclass(frozen=True)
class TokenLogprob:
    """The target's raw log-probability of one output token and its likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class StepOutput:
    """Tokens committed by one step, and why generation ended if it did."""

    tokens: list[int]
    finish: Finish | None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when the request asks


def draft_seed(request_seed: int, step: int) -> int:
    """The seed of the draft's sampler at a step: a function of the request's seed and the
    step's index only, so overlapped speculation can hand it to the draft a step early and
    the output is the same with overlap on or off."""
    digest = hashlib.blake2b(f"{request_seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


@dataclass(frozen=True)
class _DraftHop:
    """What the propose part of a step brought back (nothing when γ = 0 or the draft is lost)."""

    tokens: list[int]
    token_probs: tuple[float, ...] = ()  # qᵢ(xᵢ) when sampled (1 for a model-free proposal's)
    ms: float = 0.0
    forward_ms: float = 0.0
    bytes: int = 0
    batch: BatchStats = BatchStats(size=0)
    pre_drafted: bool = False
    pre_draft_asked: bool = False  # this proposal asked the draft to pre-draft the next step
    proposer: str = ""
    model_free: bool = False
    in_hand: bool = False  # made by the last step's recovery hop

    def prefix(self, gamma: int) -> _DraftHop:
        """The first γ tokens (a proposal made for a longer γ than the step's)."""
        return replace(self, tokens=self.tokens[:gamma], token_probs=self.token_probs[:gamma])


@dataclass(frozen=True)
class _Verdict:
    """What the decide part of a step concluded, and what its verifier hop cost."""

    accepted: int
    bonus: bool
    token: int  # the recovered or bonus token
    scores: Scores
    ms: float
    bytes: int
    drafted_recovery: bool = False  # the draft drew the recovered token, and holds it
    recovery_ms: float = 0.0  # wall time of that hop


class _Speculation:
    """One request's state across steps: the committed sequence, the RNG and the links."""

    def __init__(self, request: Generation, policy: DraftLengthPolicy, draft: DraftClient | None,
                 verifier: VerifierClient, bounds: ModelBounds, hybrid: HybridChoice | None = None,
                 grammar: Grammar | None = None) -> None:
        self.request = request
        self.grammar = grammar
        self.policy = policy
        self.draft = draft
        self.verifier = verifier
        self.bounds = bounds
        self.hybrid = hybrid
        self.generator = torch.Generator().manual_seed(request.seed)
        self.committed = list(request.prompt_ids)
        self.generated = 0
        self.steps = 0
        self.last_commit = time.perf_counter()  # when the last step committed (at first: the start)
        self.pre_draft_asked = False  # the last proposal asked the draft to pre-draft this step
        self.drawn_ahead: list[float] = []  # uniforms drawn early for run-ahead, not yet taken by a step
        # The next step's proposal, brought by this step's recovery hop (sampled, a rejection).
        self.in_hand: _DraftHop | None = None
        self.no_proposal = _DraftHop([])  # γ = 0, or the draft is lost
        # Plain steps left of a run asked while the model-free matches were quiet: they
        # look for no match, which would stop the run (the forward in flight wasted).
        self.blind = 0
        self.longest = 0  # the most tokens this step's proposals may carry (the policy's load cap)
        self.cap: tuple[int, str] | None = None  # the load cap in force this step, and its origin

    def draft_length(self) -> int:
        """The policy's γ, bounded: a step emits up to γ+1 tokens, never more than asked, never
        past the draft's context (the draft feeds up to len(committed) + γ − 1 positions)."""
        gamma = 0 if self.draft is None else self.policy.next_draft_length()
        remaining = self.request.max_new_tokens - self.generated
        return max(0, min(gamma, remaining - 1, self.bounds.draft_context - len(self.committed)))

    def propose_model_free(self, gamma: int, max_tokens: int) -> _DraftHop | None:
        """A model-free proposal (up to max_tokens) when one beats the model draft at γ
        (`gateway.hybrid`); its q is one-hot, since the proposal is deterministic."""
        if self.hybrid is None or self.blind:
            return None
        room = self.bounds.target_context - len(self.committed) - 1
        remaining = self.request.max_new_tokens - self.generated - 1
        began = time.perf_counter()
        match = self.hybrid.choose(self.committed, min(max_tokens, room, remaining), gamma)
        if match is None:
            return None
        ms = (time.perf_counter() - began) * 1e3
        self.in_hand = None  # the match is verified instead; the draft's cache is cropped at its next step
        # q(x) = 1 for each token; a sampled step builds the one-hot row it needs at a rejection (decide).
        return _DraftHop(match.tokens, (1.0,) * len(match.tokens), ms, proposer=match.proposer, model_free=True)

    def within_grammar(self, hop: _DraftHop) -> _DraftHop:
        """The proposal cut before its first token the request's grammar forbids (the target
        would give it probability 0: `gateway.grammar` says why the cut is exact)."""
        if self.grammar is None or not hop.tokens:
            return hop
        allowed = self.grammar.allowed_prefix(hop.tokens)
        return hop if allowed == len(hop.tokens) else hop.prefix(allowed)

    def _one_hot(self, tokens: list[int]) -> Callable[[int], torch.Tensor]:
        """q's row at each position of a model-free proposal: all mass on the proposed token."""
        def row(i: int) -> torch.Tensor:
            q = torch.zeros(self.bounds.vocab_size)
            q[tokens[i]] = 1.0
            return q
        return row

    async def propose(self, gamma: int, carrier: dict[str, str]) -> _DraftHop:
        """The draft hop. A draft that sits the step out (DraftSkipped: too slow) leaves this
        step to the verifier alone, a draft lost for good the whole request, which is enough
        for the same output; the client's deadline passing ends it."""
        empty = self.no_proposal  # made once: a plain step should build nothing
        in_hand, self.in_hand = self.in_hand, None
        if gamma == 0 or self.draft is None:
            return empty
        if in_hand is not None:  # made by the last step's recovery hop, for at most its γ
            return in_hand.prefix(gamma)
        request, transform = self.request, self.request.transform
        began = time.perf_counter()
        seed = 0 if transform.greedy else draft_seed(request.seed, self.steps)
        pre_draft = None
        if request.overlap:
            # The next step most likely asks for the same γ (a shorter one takes a prefix).
            next_seed = 0 if transform.greedy else draft_seed(request.seed, self.steps + 1)
            pre_draft = PreDraftRequest(gamma, next_seed)
        try:
            draft_request = DraftRequest(gamma, transform, seed, request.min_confidence, self.bounds.vocab_size,
                                         request.grammar)
            proposal = await self.draft.propose(self.committed, draft_request, request.draft_model, carrier, pre_draft)
        except DraftSkipped as exc:
            log.info("%s", exc)
            return empty
        except WorkerError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise  # the client's deadline passed: the request is over, not just the draft
            log.warning("draft lost (%s); decoding the rest of the request plainly", exc)
            self.draft.close()
            self.draft = None
            return empty
        return _DraftHop(proposal.tokens, proposal.token_probs, (time.perf_counter() - began) * 1e3,
                         proposal.forward_ms, self.draft.last_exchange_bytes, proposal.batch, proposal.pre_drafted,
                         pre_draft is not None, request.draft_model)

    async def decide(self, hop: _DraftHop, carrier: dict[str, str]) -> _Verdict:
        """The verifier hop, then the verdict on the proposal: greedy comparison, or
        rejection sampling with exactly the q each proposed token was drawn with."""
        began = time.perf_counter()
        run_ahead = self._run_ahead(hop)
        if self.hybrid is not None:
            self._count_blind(hop, run_ahead)
        logprobs = self.request.logprobs
        allowed = None if self.grammar is None else self.grammar.masks(hop.tokens)
        if self.request.transform.greedy:
            scores = await self.verifier.verify(self.committed, hop.tokens, self.request.transform, carrier,
                                                run_ahead=run_ahead, logprobs=logprobs, allowed=allowed)
            ms = (time.perf_counter() - began) * 1e3
            assert scores.argmax is not None  # greedy scores carry the argmax
            outcome = verify_greedy(hop.tokens, scores.argmax)
        else:
            # The gateway draws every uniform of the step; the verifier tests the proposal with
            # them and sends back the bonus token or p's row at the first rejection.
            draws = self._draws(len(hop.tokens))
            # The uniforms of the plain steps the verifier may run ahead: drawn now rather than
            # at their steps, which take them in turn, so the order of the draws is the same.
            while len(self.drawn_ahead) < run_ahead:
                self.drawn_ahead.append(Draws.draw(0, self.generator).final)
            scores = await self.verifier.verify(self.committed, hop.tokens, self.request.transform, carrier,
                                                hop.token_probs, draws, run_ahead, self.drawn_ahead[:run_ahead],
                                                logprobs, allowed)
            ms = (time.perf_counter() - began) * 1e3
            verdict = scores.verdict
            assert verdict is not None  # sampled scores carry the verdict
            ended_at = next((t for t in hop.tokens[:verdict.accepted] if t in self.bounds.ending), None)
            if verdict.rejected_row is not None and ended_at is not None:
                # An accepted EOS ends the request before the rejected position: no token after
                # it is emitted, so none is drawn (the record names the EOS as the step's token).
                return _Verdict(verdict.accepted, False, ended_at, scores, ms, self.verifier.last_exchange_bytes)
            if verdict.rejected_row is not None and not hop.model_free:  # only the draft holds q there
                began = time.perf_counter()
                token = await self._recover(hop, verdict.accepted, Recovery(verdict.rejected_row, draws.final),
                                            carrier)
                return _Verdict(verdict.accepted, False, token, scores, ms, self.verifier.last_exchange_bytes, True,
                                (time.perf_counter() - began) * 1e3)
            outcome = finish_verdict(verdict, self._one_hot(hop.tokens), draws)
        return _Verdict(outcome.accepted, outcome.bonus, outcome.token, scores, ms, self.verifier.last_exchange_bytes)

    async def _recover(self, hop: _DraftHop, accepted: int, recovery: Recovery, carrier: dict[str, str]) -> int:
        """The recovered token after the draft's token at `accepted` was rejected, drawn by the
        draft (it holds q there). The same hop drafts the next step's proposal from it, for
        at most this step's γ (the policy has not seen this step yet; a smaller γ takes a
        prefix): one draft hop a step, as without a rejection. WorkerError (UNAVAILABLE)
        when no draft answers: nothing else can draw this token exactly."""
        assert self.draft is not None  # it made this step's proposal
        request, transform = self.request, self.request.transform
        kept = self.committed + hop.tokens[:accepted]
        remaining = request.max_new_tokens - self.generated - accepted - 1  # after this step
        gamma = max(0, min(len(hop.tokens), remaining - 1, self.bounds.draft_context - len(kept) - 1))
        seed = draft_seed(request.seed, self.steps + 1)
        pre_draft = (PreDraftRequest(gamma, draft_seed(request.seed, self.steps + 2))
                     if request.overlap and gamma else None)
        self.draft.advance(len(kept))  # it holds the accepted tokens; the rest of its proposal is stale
        began = time.perf_counter()
        draft_request = DraftRequest(gamma, transform, seed, request.min_confidence, self.bounds.vocab_size,
                                     request.grammar)
        proposal = await self.draft.propose(kept, draft_request, request.draft_model, carrier, pre_draft, recovery)
        assert proposal.recovered is not None  # the link checks that a recovery was answered
        if proposal.tokens:  # none when γ = 0, or the recovered token is one the draft cannot feed
            self.in_hand = _DraftHop(proposal.tokens, proposal.token_probs, (time.perf_counter() - began) * 1e3,
                                     proposal.forward_ms, self.draft.last_exchange_bytes, proposal.batch,
                                     proposal.pre_drafted, pre_draft is not None, request.draft_model, in_hand=True)
        return proposal.recovered

    def _draws(self, gamma: int) -> Draws:
        """This step's γ + 1 uniforms: first those drawn early for run-ahead (in the order they
        were drawn), then new ones. If this step proposes after all (the policy guessed
        wrong), it takes them all the same: a fixed order of independent uniforms, so the
        law is the same and a seed gives the same output."""
        taken, self.drawn_ahead = self.drawn_ahead[:gamma + 1], self.drawn_ahead[gamma + 1:]
        if len(taken) < gamma + 1:
            fresh = Draws.draw(gamma - len(taken), self.generator)
            taken += [*fresh.accept, fresh.final]
        return Draws(tuple(taken[:-1]), taken[-1])

    def _run_ahead(self, hop: _DraftHop) -> int:
        """How many plain steps after this plain one the verifier may score unasked, short of
        the request's last token and the target's context: as many as surely come (all,
        with no draft left; else as many as the γ policy foresees, `plain_steps_ahead`), up
        to `RUN_AHEAD_STEPS`. With model-free proposers, none while their matches pay (a
        match would stop the run); once they are quiet, up to `QUIET_RUN_STEPS`, which look
        for no match; none while such a run is under way (its steps take its answers).
        None under a grammar: each position's allowed tokens follow the token before it."""
        if hop.tokens or self.grammar is not None:
            return 0
        after = self.request.max_new_tokens - self.generated - 1  # tokens left after this step's
        if self.bounds.target_context:
            after = min(after, self.bounds.target_context - len(self.committed) - 1)
        limit = RUN_AHEAD_STEPS
        if self.hybrid is not None and self.longest > 0:  # under a cap of 0 no match may be verified
            if self.blind or not self.hybrid.quiet:
                return 0
            limit = QUIET_RUN_STEPS
        plain = limit if self.draft is None else self.policy.plain_steps_ahead(limit)
        return max(0, min(plain, after))

    def _count_blind(self, hop: _DraftHop, run_ahead: int) -> None:
        """Keep `blind`, the steps left of a quiet run, as this step starts: a proposal ends
        the run, a step that asks one starts it, a plain step within it takes one answer."""
        if hop.tokens:
            self.blind = 0
        elif run_ahead:
            self.blind = run_ahead
        elif self.blind:
            self.blind -= 1

    def commit(self, hop: _DraftHop, verdict: _Verdict) -> tuple[StepRecord, StepOutput]:
        """Commit the accepted tokens and the recovered or bonus one, cut at EOS; the step's record."""
        emitted = hop.tokens[: verdict.accepted] + [verdict.token]
        kept_before = len(self.committed) + verdict.accepted
        position = len(self.committed)
        self.committed.extend(emitted)
        self.verifier.advance(kept_before)
        if self.hybrid is not None:
            self.hybrid.observe(hop.proposer if hop.model_free else None, verdict.accepted, len(hop.tokens))
        # A draft that sat this step out (or a model-free match made it) still holds only what it
        # held; one that drew the recovered token holds that too.
        if hop.tokens and not hop.model_free and self.draft is not None:
            self.draft.advance(kept_before + verdict.drafted_recovery)
        finish = None
        end_at = next((i for i, t in enumerate(emitted) if t in self.bounds.ending), None)
        if end_at is not None:
            finish = Finish.STOP if emitted[end_at] in self.bounds.stop_token_ids else Finish.EOS
            emitted = emitted[: end_at + 1]
        if self.grammar is not None:
            self.grammar.commit(emitted)
        logprobs: tuple[TokenLogprob, ...] = ()
        if self.request.logprobs is not None:
            logprobs = tuple(TokenLogprob(token, position.of(token), position.top)
                             for token, position in zip(emitted, verdict.scores.logprobs))
        generated_before = self.generated
        self.generated += len(emitted)
        if finish is None and self.generated >= self.request.max_new_tokens:
            finish = Finish.LENGTH
        scores = verdict.scores
        now = time.perf_counter()
        interval_ms, self.last_commit = (now - self.last_commit) * 1e3, now
        record = StepRecord(
            index=self.steps, position=position, generated=generated_before, draft_length=len(hop.tokens),
            accepted=verdict.accepted, bonus=verdict.bonus, token=verdict.token, emitted=tuple(emitted),
            draft_ms=hop.ms, verify_ms=verdict.ms, draft_forward_ms=hop.forward_ms,
            verify_forward_ms=scores.forward_ms, draft_bytes=hop.bytes, verify_bytes=verdict.bytes,
            draft_batch=hop.batch, verify_batch=scores.batch, pre_draft_asked=self.pre_draft_asked,
            pre_drafted=hop.pre_drafted, proposer=hop.proposer, model_free=hop.model_free, ran_ahead=scores.ran_ahead,
            interval_ms=interval_ms, proposal_in_hand=hop.in_hand, recovery_ms=verdict.recovery_ms, load_cap=self.cap)
        self.steps += 1
        self.pre_draft_asked = hop.pre_draft_asked
        return record, StepOutput(emitted, finish, logprobs)


async def speculate(request: Generation, policy: DraftLengthPolicy, draft: DraftClient | None,
                    verifier: VerifierClient, bounds: ModelBounds, observers: Sequence[StepObserver] = (),
                    tracer: StepTracer | None = None, hybrid: HybridChoice | None = None,
                    max_model_free: int = 0, grammar: Grammar | None = None) -> AsyncGenerator[StepOutput, None]:
    """Run speculative steps until max_new_tokens or EOS, yielding each step's tokens.

    After each step its record goes to the policy, then to `observers` in order, then to
    the tracer, which ends the step's span: what an observer notices (drift) can still be
    an event on it. With request.overlap, every proposal also asks the draft to pre-draft
    the next step while the target verifies this one (`draft_service.predraft`); the draft seeds
    depend only on the step index, so the output is the same either way.

    With `hybrid`, each step first asks the request's model-free proposers for up to
    `max_model_free` tokens, and verifies their match instead of drafting when the match
    promises more tokens per millisecond (`gateway.hybrid`).

    With `grammar`, every proposal is cut to what the grammar allows and the verifier
    restricts the target to it, position by position (`gateway.grammar`).
    """
    tracer = tracer or NoTracer()
    everyone = (policy, *observers, tracer)
    speculation = _Speculation(request, policy, draft, verifier, bounds, hybrid, grammar)
    while True:
        gamma = speculation.draft_length()
        carrier = tracer.begin_step(speculation.steps)
        speculation.cap = policy.cap_in_force()
        speculation.longest = max_model_free if speculation.cap is None else min(max_model_free, speculation.cap[0])
        hop = (speculation.propose_model_free(gamma, speculation.longest)
               or await speculation.propose(gamma, carrier))
        hop = speculation.within_grammar(hop)
        verdict = await speculation.decide(hop, carrier)
        record, output = speculation.commit(hop, verdict)
        for observer in everyone:
            observer.observe(record)
        yield output
        if output.finish is not None:
            return
