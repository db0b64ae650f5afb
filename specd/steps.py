"""The plain types the gateway and the workers exchange, one step at a time.

A model's facts (`ModelInfo`), how to draft one step (`DraftRequest`), the next one
early (`PreDraftRequest`) and the token after a rejection (`Recovery`), how a step was
batched (`BatchStats`), and a step's two results: the draft's `DraftReply` and the
target's `Scores`. The workers build them (`draft_service.drafter` and its jobs,
`verifier_service.scorer` and its jobs), `specd.wire` turns them into worker messages and back, and the
gateway's engine reads them. Light on purpose: nothing that loads torch, transformers or
grpc, so the gateway's records and policies import them for free.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing the step types loads no torch
    import torch

    from specd.rejection import TargetVerdict
    from specd.sampling import Transform


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs to know about a hosted model."""

    name: str
    vocab_size: int
    max_context: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    weights_digest: str = ""  # specd.worker.identity.weights_digest of the model directory
    parameter_bytes: int = 0  # weights held, in bytes, packed copies included (the draft's memory next to the target's)
    card_json: str = ""  # the directory's card.json, verbatim, when it has one
    model_path: str = ""  # the directory the model was loaded from
    # (batch, width) → ms of one batched forward, timed at load (`ModelRunner.measure_forwards`)
    forward_costs: tuple[tuple[int, int, float], ...] = ()


def card_acceptance(card_json: str) -> dict[str, dict]:
    """A model card's acceptance against its target, by task (`acceptance_vs_target`: the
    rows `specd distill` measures on held-out prompts, each with its "alpha", "greedy_match"
    and the γ it was taken at); empty where the card has none or is not JSON."""
    if not card_json:
        return {}
    try:
        table = json.loads(card_json).get("acceptance_vs_target")
    except (ValueError, AttributeError):
        return {}
    return {task: row for task, row in table.items() if isinstance(row, dict)} if isinstance(table, dict) else {}


@dataclass(frozen=True)
class PreDraftRequest:
    """What to pre-draft: the next step's γ and the seed it will carry."""

    draft_length: int
    seed: int


@dataclass(frozen=True)
class DraftRequest:
    """How to draft one step: what travels together from the gateway's engine to the draft's
    sampler, and what a pre-drafted branch must match to answer a later step."""

    draft_length: int  # γ: propose up to this many tokens
    transform: Transform  # the request's sampling transform (q is built with it)
    seed: int = 0  # the step's sampler seed (`gateway.proposers.draft.draft_seed`; 0 when greedy)
    min_confidence: float = 0.0  # > 0: stop inside the step once the draft's top probability falls below
    vocab_limit: int = 0  # > 0: propose only ids below it (the target's vocabulary)
    grammar: str = ""  # a structured request's grammar: propose only what it allows (`draft_service.grammar`)

    def then(self, pre_draft: PreDraftRequest) -> DraftRequest:
        """The next step's request, as a pre-draft foresees it: its γ and seed, the rest the same."""
        return replace(self, draft_length=pre_draft.draft_length, seed=pre_draft.seed)


@dataclass(frozen=True)
class Recovery:
    """The last step rejected a draft model's token: the target's p at that position and the
    step's last uniform, for the draft, which holds q there, to sample the recovered token
    (`specd.rejection.recovered_token`) before it proposes from it."""

    target_row: torch.Tensor  # p at the rejected position [V]
    uniform: float


@dataclass(frozen=True)
class BatchStats:
    """How one step was batched: the largest forward it shared, and how long it waited."""

    size: int = 1  # sessions in that forward
    tokens: int = 0  # tokens in that forward
    queue_ms: float = 0.0  # from arrival to its first forward
    forwards: int = 0  # forwards the step took part in
    sessions: int = 0  # sessions the worker held when the step ran: the load it serves
    cached: int = 0  # prompt positions the step took from the prefix cache, not computed


@dataclass(frozen=True)
class DraftReply:
    """x₁..x_γ and, unless greedy, q₁..q_γ [γ, V] (on the draft's side only: its rows stay
    there, and the gateway gets q_i(x_i), `token_probs`)."""

    tokens: list[int]
    probs: torch.Tensor | None
    forward_ms: float
    # q_i(x_i): the draft's probability of each proposed token after the transform (the
    # acceptance tests need only these; untempered when greedy, for the trace spans).
    token_probs: tuple[float, ...] = ()
    batch: BatchStats = BatchStats()
    pre_drafted: bool = False  # taken from a branch drafted while the last step was verified
    # Draft side, overlap: done when the branches pre-drafted after this proposal settle.
    pre_draft: asyncio.Future | None = None
    # Asked with a `Recovery`: the token the draft sampled after the last step's rejection,
    # which this proposal follows.
    recovered: int | None = None


@dataclass(frozen=True)
class PositionLogprobs:
    """The target's own log-probabilities at one position a step decided (the log-softmax of
    its logits before penalties, grammar and temperature: vLLM's raw logprobs)."""

    top: tuple[tuple[int, float], ...]  # the likeliest (token id, logprob), likeliest first
    token: float | None  # the emitted token's; None at a sampled rejection (drawn elsewhere)
    row: torch.Tensor | None = None  # at a sampled rejection: every token's [V], for the one drawn

    def of(self, token: int) -> float:
        """The log-probability of the token emitted here."""
        if self.token is not None:
            return self.token
        assert self.row is not None  # a rejected position carries its row
        return float(self.row[token])


@dataclass(frozen=True)
class Scores:
    """The target's view of a proposal: argmax at the γ+1 positions when greedy, else its
    verdict under the gateway's draws (`specd.rejection.TargetVerdict`)."""

    argmax: list[int] | None
    verdict: TargetVerdict | None
    forward_ms: float
    batch: BatchStats = BatchStats()
    ran_ahead: bool = False  # scored before it was asked for (`verifier_service.runahead`)
    # Asked for: positions 1 to accepted + 1, the ones the step decided.
    logprobs: tuple[PositionLogprobs, ...] = ()

    def plain_token(self) -> int:
        """The token a plain step commits: the argmax, or the token its uniform drew from p."""
        if self.argmax is not None:
            return self.argmax[0]
        assert self.verdict is not None and self.verdict.bonus_token is not None  # a plain verdict's bonus
        return self.verdict.bonus_token
