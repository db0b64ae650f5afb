"""Which proposal a step takes: a model-free match, the model draft, or none.

Each step, the request's model-free proposers (`gateway.proposers.modelfree`) look for a match
first: they cost microseconds. A match is then priced like any draft, in expected
tokens per millisecond of step (`gateway.stats.costmodel`):

    match of k tokens:  E = 1 + Σ_{i≤k} Π_{j≤i} r_j   over   the step at k (its draft part
                        measured on the proposer's own steps: near zero)
    model draft at γ:   E = (1 − α^(γ+1)) / (1 − α)  over   draft hop + verify hop at γ
    no draft:           1 token                      over   a plain target step

where r_j is the proposer's confidence in its j-th token (a suffix match's share of
agreeing occurrences), capped by the acceptance the proposer actually achieved in this
request, and α is the γ policy's estimate for the model draft. The match is cut to the
length k with the best rate, and taken when that rate beats the model draft's at the γ
the policy chose (0 included): a confident match wins the step, a weak one proposes
nothing, and otherwise the model drafts, or nothing does, as without these proposers.
Before any step is measured, costs are taken relative to a plain step (a verified token
adds 5%, a draft token 20%). The match taken becomes the step's proposal
(`gateway.proposers.base.Proposal`), carrying the proposer that made it: the engine asks that
proposer for the recovered token at a sampled rejection and tells it of the commit.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from gateway.proposers.base import Proposal, Proposer, StepContext
from gateway.stats.acceptance import DecayedAcceptance
from gateway.stats.costmodel import CostEstimate, StepCosts, expected_tokens
from specd.contract import CORPUS, PROMPT_LOOKUP

# Each proposer's acceptance in a request starts from a prior worth PRIOR_WEIGHT tokens.
# The corpus table's shares run high (docs/proposers.md, "The corpus": on SmolLM2's held-out
# chat questions a first token's share overstates how often it is the target's).
PRIORS = {PROMPT_LOOKUP: 0.5, CORPUS: 0.4}
DEFAULT_PRIOR = 0.8
PRIOR_WEIGHT = 2.0
MEMORY_STEPS = 20
# Steps without a model-free token accepted after which the request's matches are "quiet":
# the engine then lets the verifier run plain steps ahead and looks for a match only
# between runs (`gateway.step.engine`).
QUIET_STEPS = 2
# Relative step costs before anything is measured (a plain target step = 1).
VERIFY_PER_TOKEN, DRAFT_PER_TOKEN = 0.05, 0.2


class ModelFreeProposer(Proposer, Protocol):
    """A proposer in the gateway (`gateway.proposers.modelfree`): what the choice asks of it,
    beside what the engine asks of every proposer."""

    def index(self, committed: Sequence[int]) -> None:
        """Take in the tokens of `committed` not seen yet, proposing nothing."""
        ...


class HybridChoice:
    """One request's model-free proposers and the choice between their matches and the model draft.

    costs: the step costs of the request's model pair (the model draft's, or the target's
    alone), whose verify line every step feeds; proposer_costs(name): the steps `name`
    proposed, whose draft part says what its proposals cost; model_alpha(): the γ
    policy's acceptance estimate of the model draft; fixed: mode FIXED's γ, when a
    model-free proposer is forced (its match is cut to γ and always taken); timed: price
    steps by the measured costs. Untimed, the relative priors price them, so the choice
    depends only on the request's own tokens and steps (and the suffix cache): what a
    policy that replays a seed needs.
    """

    def __init__(self, proposers: Sequence[ModelFreeProposer], costs: StepCosts,
                 proposer_costs: Callable[[str], StepCosts], model_alpha: Callable[[], float],
                 fixed: int | None = None, timed: bool = True) -> None:
        self.proposers = list(proposers)
        self.costs = costs if timed else StepCosts()  # never observed: the priors price every step
        self.proposer_costs = proposer_costs
        self.model_alpha = model_alpha
        self.fixed = fixed
        self._acceptance = {
            p.name: DecayedAcceptance.from_prior(PRIORS.get(p.name, DEFAULT_PRIOR), PRIOR_WEIGHT, MEMORY_STEPS)
            for p in self.proposers}
        self.timed = timed
        self._since_paid = 0  # steps since a model-free proposal last had a token accepted

    def index(self, committed: Sequence[int]) -> None:
        """Let every proposer take in `committed` (the prompt) before the first step."""
        for proposer in self.proposers:
            proposer.index(committed)

    def observe(self, proposer: str, accepted: int, proposed: int) -> None:
        """A step ended with `accepted` of `proposed` tokens kept; `proposer` names who made
        them (`StepRecord.proposer`): a model-free proposer learns from its own steps only."""
        acceptance = self._acceptance.get(proposer)
        self._since_paid = 0 if acceptance is not None and accepted > 0 else self._since_paid + 1
        if acceptance is not None and proposed:
            acceptance.observe(accepted, rejected=accepted < proposed)

    @property
    def quiet(self) -> bool:
        """No model-free token was accepted in the last `QUIET_STEPS` steps (counted from
        the request's first step: its first steps are not quiet)."""
        return self._since_paid >= QUIET_STEPS

    async def choose(self, context: StepContext, max_tokens: int, model_gamma: int) -> Proposal | None:
        """The match this step should verify, as the step's proposal (with the time all the
        lookups took), or None: the model draft (at model_gamma) or a plain step does better."""
        if max_tokens <= 0:
            return None
        began = time.perf_counter()
        # Every length's step cost at once: one fit of the measured lines per step, not one
        # per length priced ([] before any measurement: the priors price them).
        estimates = self.costs.estimates(range(max(max_tokens, model_gamma) + 1))
        best: tuple[float, Proposal] | None = None
        for proposer in self.proposers:
            match = await proposer.propose(context, max_tokens)
            if not match.tokens:
                continue
            if self.fixed is not None:
                return _timed(match.prefix(self.fixed), began)
            rate, length = self._best_cut(proposer.name, match, estimates)
            if best is None or rate > best[0]:
                best = (rate, match.prefix(length))
        if best is None or best[0] <= self._model_rate(model_gamma, estimates):
            return None
        return _timed(best[1], began)

    def _rates(self, proposer: str, match: Proposal) -> list[float]:
        learned = self._acceptance[proposer].alpha
        if match.confidence is None:
            return [learned] * len(match.tokens)
        return [min(share, learned) for share in match.confidence]

    def _best_cut(self, proposer: str, match: Proposal, estimates: list[CostEstimate]) -> tuple[float, int]:
        """The best expected tokens per ms over the match's prefixes, and that prefix's length."""
        draft_ms = self.proposer_costs(proposer).draft_ms_per_token() if self.timed else 0.0
        best_rate, best_length = 0.0, 0
        tokens, survive = 1.0, 1.0  # E[tokens] of the prefix so far, and P(all of it accepted)
        for length, rate in enumerate(self._rates(proposer, match), start=1):
            survive *= rate
            tokens += survive
            step = (estimates[length].verify_ms + draft_ms * length if estimates
                    else 1.0 + VERIFY_PER_TOKEN * length)
            if tokens / step > best_rate:
                best_rate, best_length = tokens / step, length
        return best_rate, best_length

    def _model_rate(self, gamma: int, estimates: list[CostEstimate]) -> float:
        """Expected tokens per ms of the model draft at γ (γ = 0: of a plain step)."""
        tokens = expected_tokens(self.model_alpha(), gamma) if gamma > 0 else 1.0
        if not estimates:
            return tokens / (1.0 + (VERIFY_PER_TOKEN + DRAFT_PER_TOKEN) * gamma)
        return tokens / estimates[gamma].step_ms


def _timed(match: Proposal, began: float) -> Proposal:
    """The match with what it cost: the time since `began` (every proposer's lookup)."""
    return replace(match, ms=(time.perf_counter() - began) * 1e3)
