"""A step's proposal, and the one interface every proposer offers the engine.

A *proposer* turns a session's committed tokens into a *proposal* (docs/design.md §6): the
request's draft model (`gateway.proposers.draft`, a hop to the draft service), or a
model-free proposer in the gateway (prompt lookup and suffix matching,
`gateway.proposers.modelfree`, chosen per step by `gateway.proposers.hybrid`). Making a
proposal differs by kind; once it is made, the engine verifies every proposal alike and asks the
proposal's own proposer (`Proposer`) for what depends on who made it:

- where q lives (`recover`): the draft model keeps its q rows, so a sampled rejection's
  recovered token is drawn by the draft, in a hop that also drafts the next step's
  proposal; a model-free proposal is deterministic, its q one-hot, and its recovered
  token is drawn in the gateway;
- what a commit means to it (`settle`): the draft is told how much of its proposal was
  kept, so its session cache past that is stale; a model-free proposer holds no session.

Who learns from a step reads its record (`gateway.step.records.StepRecord`): `proposer` names
who proposed (each model-free proposer's acceptance, the model pair statistics and costs
are counted under) and `draft_model_tokens` counts the draft model's tokens (what the γ
policy and the load cap learn the draft's acceptance from).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from specd.steps import BatchStats

# specd.rejection loads torch; the choice that builds proposals (`gateway.proposers.hybrid`) loads none
if TYPE_CHECKING:
    from specd.rejection import Draws, TargetVerdict


@dataclass(frozen=True)
class StepContext:
    """Where the request stands as a step begins: what a proposer may need to know of it."""

    index: int  # the step's index in the request (the draft's seeds follow it)
    committed: list[int]  # the committed tokens before the step, the prompt's included
    remaining: int  # tokens the request may still generate, the step's own included
    carrier: dict[str, str]  # the step span's trace context, for the hops' messages


@dataclass(frozen=True)
class Proposal:
    """The tokens a proposer offers one step, with qᵢ(xᵢ) for each, and what getting them
    cost (the step record's draft figures). No tokens: γ = 0, or no proposer answered."""

    tokens: list[int]
    token_probs: tuple[float, ...] = ()  # qᵢ(xᵢ) when sampled (1 for a model-free proposal's)
    ms: float = 0.0  # the gateway's wall time to get it: the draft hop, or the lookups
    forward_ms: float = 0.0  # inside the draft model's forwards
    bytes: int = 0  # the draft hop's request + response
    batch: BatchStats = BatchStats(size=0)  # how the draft batched it (size 0: no draft hop)
    pre_drafted: bool = False  # taken from a branch the draft pre-drafted
    pre_draft_asked: bool = False  # this proposal asked the draft to pre-draft the next step
    proposer: Proposer | None = None  # None: nobody proposed
    in_hand: bool = False  # made by the last step's recovery hop
    # A model-free proposer's estimate, for each token, that the target agrees (None: it has
    # no such figure, and the gateway learns one): what the hybrid choice prices a match by.
    confidence: tuple[float, ...] | None = None

    def prefix(self, gamma: int) -> Proposal:
        """The first γ tokens (a proposal made for a longer γ than the step's)."""
        confidence = None if self.confidence is None else self.confidence[:gamma]
        return replace(self, tokens=self.tokens[:gamma], token_probs=self.token_probs[:gamma], confidence=confidence)


@dataclass(frozen=True)
class Recovered:
    """The token a proposer drew at a sampled step's first rejection, from norm(max(0, p − q))."""

    token: int
    held: bool = False  # the proposer's own session holds it (the draft drew it there)
    hop_ms: float = 0.0  # wall time of the hop that drew it (0: drawn in the gateway)


class Proposer(Protocol):
    """Whatever makes proposals: the draft model, or a model-free proposer. The engine asks a
    proposer for a proposal, and the proposal's proposer for the two parts of a step that
    depend on who proposed."""

    name: str  # the draft model's name, or the model-free proposer's (`specd.contract.MODEL_FREE`)

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        """Up to `max_tokens` tokens to follow `context.committed` (none: nothing to propose)."""
        ...

    async def recover(self, proposal: Proposal, verdict: TargetVerdict, draws: Draws,
                      context: StepContext, next_gamma: int) -> Recovered:
        """The recovered token after the target rejected the proposal's token at
        `verdict.accepted`: drawn from norm(max(0, p − q)), p = `verdict.rejected_row`, with
        the step's last uniform (`draws.final`), where q is. next_gamma: the longest γ the
        next step may ask (`DraftLengthPolicy.recovery_draft_length`), for a proposer that
        drafts it in the same hop."""
        ...

    def settle(self, proposal: Proposal, position: int) -> None:
        """The step committed: the committed sequence is settled up to `position` for this
        proposer (the accepted tokens, and the recovered one when it drew it)."""
        ...
