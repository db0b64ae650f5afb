"""The speculative loop of one request: the committed sequence, its RNG, and each step.

One step (DESIGN.md §2): the draft proposes γ tokens, the verifier scores γ+1 positions
in one forward, and `specd.rejection` decides what is accepted; the accepted tokens
plus one recovered or bonus token are committed. No protobuf here: the links in
`gateway.workers` speak to the workers.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from gateway.policy import FixedPolicy
from gateway.workers import DraftLink, VerifierLink
from specd.rejection import rejection_sample, verify_greedy
from specd.sampling import Transform


class Finish(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


@dataclass(frozen=True)
class GenerationRequest:
    """A validated request, in token ids."""

    prompt_ids: list[int]
    transform: Transform
    seed: int
    max_new_tokens: int
    draft_model: str  # empty: no draft (plain decoding)


@dataclass(frozen=True)
class Limits:
    """What the models allow."""

    target_context: int
    draft_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass
class RequestStats:
    """What speculation did for one request (filled on the hot path, read at the end)."""

    draft_lengths: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.draft_lengths)

    @property
    def proposed_tokens(self) -> int:
        return sum(self.draft_lengths)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accepted_lengths)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


@dataclass(frozen=True)
class Emission:
    """Tokens committed by one step, and why generation ended if it did."""

    tokens: list[int]
    finish: Finish | None


def step_seed(generator: torch.Generator) -> int:
    """The seed for the draft's sampler this step, drawn from the request's RNG."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


async def speculate(request: GenerationRequest, policy: FixedPolicy, draft: DraftLink | None,
                    verifier: VerifierLink, limits: Limits, stats: RequestStats,
                    trace_carrier: dict[str, str] | None = None) -> AsyncIterator[Emission]:
    """Run speculative steps until max_new_tokens or EOS, yielding each step's tokens."""
    transform = request.transform
    generator = torch.Generator().manual_seed(request.seed)
    committed = list(request.prompt_ids)
    carrier = trace_carrier or {}
    while True:
        remaining = request.max_new_tokens - stats.generated_tokens
        # A step emits up to γ+1 tokens: never more than asked, never past the draft's
        # context (the draft feeds up to len(committed) + γ − 1 positions).
        gamma = 0 if draft is None else policy.next_draft_length()
        gamma = max(0, min(gamma, remaining - 1, limits.draft_context - len(committed)))
        draft_tokens: list[int] = []
        draft_probs = torch.zeros(0, limits.vocab_size)
        if gamma > 0:
            began = time.perf_counter()
            seed = 0 if transform.greedy else step_seed(generator)
            proposal = await draft.propose(committed, gamma, transform, seed, request.draft_model, carrier)
            stats.draft_ms += (time.perf_counter() - began) * 1e3
            draft_tokens = proposal.tokens
            if proposal.probs is not None:
                draft_probs = proposal.probs
        began = time.perf_counter()
        scores = await verifier.verify(committed, draft_tokens, transform, carrier)
        stats.verify_ms += (time.perf_counter() - began) * 1e3
        proposed = torch.tensor(draft_tokens, dtype=torch.long)
        if transform.greedy:
            outcome = verify_greedy(proposed, torch.tensor(scores.argmax, dtype=torch.long))
        else:
            outcome = rejection_sample(proposed, draft_probs, scores.probs, generator)

        emitted = draft_tokens[: outcome.accepted] + [outcome.token]
        kept_before = len(committed) + outcome.accepted
        committed.extend(emitted)
        for link in (draft, verifier):
            if link is not None:
                link.advance(kept_before)
        stats.draft_lengths.append(gamma)
        stats.accepted_lengths.append(outcome.accepted)
        policy.observe(gamma, outcome.accepted)

        finish = None
        eos_at = next((i for i, t in enumerate(emitted) if t in limits.eos_token_ids), None)
        if eos_at is not None:
            emitted, finish = emitted[: eos_at + 1], Finish.EOS
        stats.generated_tokens += len(emitted)
        if finish is None and stats.generated_tokens >= request.max_new_tokens:
            finish = Finish.LENGTH
        yield Emission(emitted, finish)
        if finish is not None:
            return
