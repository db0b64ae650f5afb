"""The speculative loop of one request: the committed sequence, its RNG, and each step.

One step (docs/design.md §2): a proposer proposes γ tokens, the verifier scores γ+1
positions in one forward, and `specd.rejection` decides what is accepted; the accepted
tokens plus one recovered or bonus token are committed. A step runs in three parts:
propose (a model-free match, or the draft model's hop), decide (the verifier hop and the
verdict) and commit. What depends on who proposed, the engine asks the proposal's
proposer (`gateway.proposers.base.Proposer`): the recovered token at a sampled rejection, drawn
where q lives, and what the commit means to the proposer's own state. Each step ends in
a `StepRecord` (`gateway.step.records`) that every observer reads: the γ policy, the
request's statistics, the server's counters, the tracer. The workers are behind two
small client Protocols, `gateway.proposers.draft.DraftClient` (which the draft model's
proposer wraps) and `VerifierClient` (the gRPC links of `gateway.workers.links` in
production, scripted fakes in tests/test_engine.py). No protobuf here.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from gateway.errors import DraftSkipped, InvalidRequest, WorkerError
from gateway.grammar import Grammar
from gateway.proposers.base import Proposal, StepContext
from gateway.proposers.draft import DraftClient, DraftModelProposer
from gateway.proposers.hybrid import HybridChoice
from gateway.request import Generation
from gateway.step.records import Bound, DraftLengthPolicy, Finish, NoTracer, StepObserver, StepRecord, StepTracer
from specd.grammars import GrammarError
from specd.rejection import Draws, verify_greedy
from specd.sampling import Transform
from specd.steps import Scores

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


class VerifierClient(Protocol):
    """What a step needs of the verifier: one session's scores (`gateway.workers.links.VerifierLink`)."""

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


@dataclass(frozen=True)
class _Verdict:
    """What the decide part of a step concluded, and what its verifier hop cost."""

    accepted: int
    bonus: bool
    token: int  # the recovered or bonus token
    scores: Scores
    ms: float
    bytes: int
    recovered_held: bool = False  # the proposer drew the recovered token, and its session holds it
    recovery_ms: float = 0.0  # wall time of the hop that drew it (0: drawn in the gateway)


class _Speculation:
    """One request's state across steps: the committed sequence, the RNG, the verifier's link
    and the proposers (the draft model's, until it is lost, and the model-free ones of `hybrid`)."""

    def __init__(self, request: Generation, policy: DraftLengthPolicy, draft: DraftClient | None,
                 verifier: VerifierClient, bounds: ModelBounds, hybrid: HybridChoice | None = None,
                 grammar: Grammar | None = None) -> None:
        self.request = request
        self.grammar = grammar
        self.policy = policy
        self.draft = (None if draft is None
                      else DraftModelProposer(draft, request, bounds.draft_context, bounds.vocab_size))
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
        self.no_proposal = Proposal([])  # γ = 0, or the draft is lost: made once, a plain step builds nothing
        # Plain steps left of a run asked while the model-free matches were quiet: they
        # look for no match, which would stop the run (the forward in flight wasted).
        self.blind = 0
        # The most tokens this step's model-free proposal may carry: the request's bound on them,
        # within the load cap in force.
        self.max_model_free = 0
        self.bound: Bound | None = None  # the load cap in force this step, and its origin

    def draft_length(self) -> int:
        """The policy's γ, bounded: a step emits up to γ+1 tokens, never more than asked, never
        past the draft's context (the draft feeds up to len(committed) + γ − 1 positions)."""
        gamma = 0 if self.draft is None else self.policy.next_draft_length(self.bound)
        remaining = self.request.stopping.max_new_tokens - self.generated
        return max(0, min(gamma, remaining - 1, self.bounds.draft_context - len(self.committed)))

    def context(self, carrier: dict[str, str]) -> StepContext:
        """Where the request stands as this step begins, for its proposer."""
        return StepContext(self.steps, self.committed, self.request.stopping.max_new_tokens - self.generated, carrier)

    async def propose_match(self, gamma: int, max_tokens: int, carrier: dict[str, str]) -> Proposal | None:
        """A model-free proposal (up to max_tokens) when one beats the model draft at γ
        (`gateway.proposers.hybrid`)."""
        if self.hybrid is None or self.blind:
            return None
        room = self.bounds.target_context - len(self.committed) - 1
        remaining = self.request.stopping.max_new_tokens - self.generated - 1
        return await self.hybrid.choose(self.context(carrier), min(max_tokens, room, remaining), gamma)

    async def within_grammar(self, proposal: Proposal) -> tuple[Proposal, torch.Tensor | None]:
        """The proposal kept up to and with its first token the request's grammar forbids (a
        rejection for certain), and the allowed tokens at each position for the verifier
        (`Grammar.follow`, on a grammar thread); the proposal as it is and None with no
        grammar. A grammar that overruns its limits or budget ends the request."""
        if self.grammar is None:
            return proposal, None
        try:
            kept, allowed = await self.grammar.check(proposal.tokens)
        except GrammarError as exc:
            raise InvalidRequest(f"structured output: {exc}") from None
        return (proposal if kept == len(proposal.tokens) else proposal.prefix(kept)), allowed

    async def draft_proposal(self, gamma: int, carrier: dict[str, str]) -> Proposal:
        """The draft model's proposal. A draft that sits the step out (DraftSkipped: too slow)
        leaves this step to the verifier alone, a draft lost for good the whole request,
        which is enough for the same output; the client's deadline passing ends it."""
        if gamma == 0 or self.draft is None:
            return self.no_proposal
        try:
            return await self.draft.propose(self.context(carrier), gamma)
        except DraftSkipped as exc:
            log.info("%s", exc)
            return self.no_proposal
        except WorkerError as exc:
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise  # the client's deadline passed: the request is over, not just the draft
            log.warning("draft lost (%s); decoding the rest of the request plainly", exc)
            self.draft.close()
            self.draft = None
            return self.no_proposal

    async def decide(self, proposal: Proposal, carrier: dict[str, str], allowed: torch.Tensor | None) -> _Verdict:
        """The verifier hop, then the verdict on the proposal: greedy comparison, or
        rejection sampling with exactly the q each proposed token was drawn with. allowed:
        a grammar's bitmask words per position (`within_grammar`)."""
        began = time.perf_counter()
        run_ahead = self._run_ahead(proposal)
        if self.hybrid is not None:
            self._count_blind(proposal, run_ahead)
        logprobs = self.request.logprobs
        if self.request.transform.greedy:
            scores = await self.verifier.verify(self.committed, proposal.tokens, self.request.transform, carrier,
                                                run_ahead=run_ahead, logprobs=logprobs, allowed=allowed)
            ms = (time.perf_counter() - began) * 1e3
            assert scores.argmax is not None  # greedy scores carry the argmax
            outcome = verify_greedy(proposal.tokens, scores.argmax)
        else:
            # The gateway draws every uniform of the step; the verifier tests the proposal with
            # them and sends back the bonus token or p's row at the first rejection.
            draws = self._draws(len(proposal.tokens))
            # The uniforms of the plain steps the verifier may run ahead: drawn now rather than
            # at their steps, which take them in turn, so the order of the draws is the same.
            while len(self.drawn_ahead) < run_ahead:
                self.drawn_ahead.append(Draws.draw(0, self.generator).final)
            scores = await self.verifier.verify(self.committed, proposal.tokens, self.request.transform, carrier,
                                                proposal.token_probs, draws, run_ahead, self.drawn_ahead[:run_ahead],
                                                logprobs, allowed)
            ms = (time.perf_counter() - began) * 1e3
            verdict = scores.verdict
            assert verdict is not None  # sampled scores carry the verdict
            if verdict.rejected_row is None:  # every token accepted: the verifier drew the bonus token
                assert verdict.bonus_token is not None
                return _Verdict(verdict.accepted, True, verdict.bonus_token, scores, ms,
                                self.verifier.last_exchange_bytes)
            ended_at = next((t for t in proposal.tokens[:verdict.accepted] if t in self.bounds.ending), None)
            if ended_at is not None:
                # An accepted EOS ends the request before the rejected position: no token after
                # it is emitted, so none is drawn (the record names the EOS as the step's token).
                return _Verdict(verdict.accepted, False, ended_at, scores, ms, self.verifier.last_exchange_bytes)
            # The recovered token is drawn where q is, which the proposal's proposer knows.
            assert proposal.proposer is not None  # only a proposed token is rejected
            next_gamma = self.policy.recovery_draft_length(len(proposal.tokens), verdict.accepted)
            recovered = await proposal.proposer.recover(proposal, verdict, draws, self.context(carrier), next_gamma)
            return _Verdict(verdict.accepted, False, recovered.token, scores, ms, self.verifier.last_exchange_bytes,
                            recovered.held, recovered.hop_ms)
        return _Verdict(outcome.accepted, outcome.bonus, outcome.token, scores, ms, self.verifier.last_exchange_bytes)

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

    def _run_ahead(self, proposal: Proposal) -> int:
        """How many plain steps after this plain one the verifier may score unasked, short of
        the request's last token and the target's context: as many as surely come (all,
        with no draft left; else as many as the γ policy foresees, `plain_steps_ahead`), up
        to `RUN_AHEAD_STEPS`. With model-free proposers, none while their matches pay (a
        match would stop the run); once they are quiet, up to `QUIET_RUN_STEPS`, which look
        for no match; none while such a run is under way (its steps take its answers).
        None under a grammar: each position's allowed tokens follow the token before it."""
        if proposal.tokens or self.grammar is not None:
            return 0
        after = self.request.stopping.max_new_tokens - self.generated - 1  # tokens left after this step's
        if self.bounds.target_context:
            after = min(after, self.bounds.target_context - len(self.committed) - 1)
        limit = RUN_AHEAD_STEPS
        if self.hybrid is not None and self.max_model_free > 0:  # under a cap of 0 no match may be verified
            if self.blind or not self.hybrid.quiet:
                return 0
            limit = QUIET_RUN_STEPS
        plain = limit if self.draft is None else self.policy.plain_steps_ahead(limit)
        return max(0, min(plain, after))

    def _count_blind(self, proposal: Proposal, run_ahead: int) -> None:
        """Keep `blind`, the steps left of a quiet run, as this step starts: a proposal ends
        the run, a step that asks one starts it, a plain step within it takes one answer."""
        if proposal.tokens:
            self.blind = 0
        elif run_ahead:
            self.blind = run_ahead
        elif self.blind:
            self.blind -= 1

    def commit(self, proposal: Proposal, verdict: _Verdict) -> tuple[StepRecord, StepOutput]:
        """Commit the accepted tokens and the recovered or bonus one, cut at EOS; the step's record."""
        emitted = proposal.tokens[: verdict.accepted] + [verdict.token]
        kept_before = len(self.committed) + verdict.accepted
        position = len(self.committed)
        self.committed.extend(emitted)
        self.verifier.advance(kept_before)
        if proposal.proposer is not None:
            # Its own session (if any) keeps the accepted tokens, and the recovered one when it drew it.
            proposal.proposer.settle(proposal, kept_before + verdict.recovered_held)
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
        if finish is None and self.generated >= self.request.stopping.max_new_tokens:
            finish = Finish.LENGTH
        scores = verdict.scores
        now = time.perf_counter()
        interval_ms, self.last_commit = (now - self.last_commit) * 1e3, now
        proposer = proposal.proposer
        record = StepRecord(
            index=self.steps, position=position, generated=generated_before, draft_length=len(proposal.tokens),
            accepted=verdict.accepted, bonus=verdict.bonus, token=verdict.token, emitted=tuple(emitted),
            draft_ms=proposal.ms, verify_ms=verdict.ms, draft_forward_ms=proposal.forward_ms,
            verify_forward_ms=scores.forward_ms, draft_bytes=proposal.bytes, verify_bytes=verdict.bytes,
            draft_batch=proposal.batch, verify_batch=scores.batch, pre_draft_asked=self.pre_draft_asked,
            pre_drafted=proposal.pre_drafted, proposer=proposer.name if proposer is not None else "",
            # The draft model's own tokens: what its γ policy and the load cap learn from.
            draft_model_tokens=len(proposal.tokens) if proposer is not None and proposer is self.draft else 0,
            ran_ahead=scores.ran_ahead, interval_ms=interval_ms, proposal_in_hand=proposal.in_hand,
            recovery_ms=verdict.recovery_ms, load_cap=self.bound)
        if self.hybrid is not None:
            self.hybrid.observe(record.proposer, record.accepted, record.draft_length)
        self.steps += 1
        self.pre_draft_asked = proposal.pre_draft_asked
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
    promises more tokens per millisecond (`gateway.proposers.hybrid`).

    With `grammar`, every proposal is kept up to and with its first token the grammar
    forbids (a certain rejection) and the verifier restricts the target to the grammar,
    position by position (`gateway.grammar`).
    """
    tracer = tracer or NoTracer()
    everyone = (policy, *observers, tracer)
    speculation = _Speculation(request, policy, draft, verifier, bounds, hybrid, grammar)
    while True:
        bound = speculation.bound = policy.bound()  # the load cap: read once a step
        speculation.max_model_free = max_model_free if bound is None else min(max_model_free, bound.max_draft_length)
        gamma = speculation.draft_length()
        carrier = tracer.begin_step(speculation.steps)
        proposal = (await speculation.propose_match(gamma, speculation.max_model_free, carrier)
                    or await speculation.draft_proposal(gamma, carrier))
        proposal, allowed = await speculation.within_grammar(proposal)
        verdict = await speculation.decide(proposal, carrier, allowed)
        record, output = speculation.commit(proposal, verdict)
        for observer in everyone:
            observer.observe(record)
        yield output
        if output.finish is not None:
            return
