"""The speculative loop of one request: the committed sequence, its RNG, and each step.

One step (DESIGN.md §2): the draft proposes γ tokens, the verifier scores γ+1 positions
in one forward, and `specd.rejection` decides what is accepted; the accepted tokens
plus one recovered or bonus token are committed. Each step ends in a `StepRecord` that
the request's statistics, the γ policy and the tracer read. No protobuf here: the links
in `gateway.workers` speak to the workers.
"""
from __future__ import annotations

import enum
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc
import torch

from gateway.workers import DraftLink, VerifierLink, WorkerError
from specd.batching import BatchStats
from specd.predraft import PreDraftRequest
from specd.rejection import rejection_sample, verify_greedy
from specd.sampling import Transform

log = logging.getLogger(__name__)


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
    overlap: bool = False  # pre-draft the next step while the target verifies (specd.predraft)


@dataclass(frozen=True)
class Limits:
    """What the models allow."""

    draft_context: int
    vocab_size: int
    eos_token_ids: frozenset[int]


@dataclass(frozen=True)
class StepRecord:
    """What one speculative step did: the unit every consumer (stats, policy, traces) reads."""

    index: int  # 0-based step number within the request
    position: int  # committed tokens before the step (prompt included)
    draft_length: int  # γ actually proposed (0: a plain target step)
    accepted: int  # draft tokens accepted
    bonus: bool  # every draft token accepted; the extra token came from p_{γ+1}
    token: int  # the recovered or bonus token
    emitted: tuple[int, ...]  # tokens committed (accepted + 1, cut at EOS)
    draft_ms: float  # gateway-side wall time of the draft hop
    verify_ms: float  # gateway-side wall time of the verifier hop
    draft_forward_ms: float  # time inside the draft model's forwards (worker-reported)
    verify_forward_ms: float  # time inside the target's forward (worker-reported)
    draft_bytes: int  # bytes of the draft hop's request + response messages
    verify_bytes: int
    draft_batch: BatchStats = BatchStats(size=0)  # how the draft batched it (size 0: no draft hop)
    verify_batch: BatchStats = BatchStats()  # how the verifier batched it (the load it ran at)
    pre_draft_asked: bool = False  # the previous step asked the draft to pre-draft this one
    pre_drafted: bool = False  # ...and this step's proposal came from a pre-drafted branch (a hit)

    @property
    def first_rejected(self) -> int | None:
        """1-based position in the draft of the first rejected token; None if none was."""
        return None if self.bonus or self.draft_length == 0 else self.accepted + 1


class DraftLengthPolicy(Protocol):
    """Chooses γ before each step and learns from each step's record."""

    name: str
    min_confidence: float  # > 0: the draft may stop early inside a step (confidence policy)

    def next_draft_length(self) -> int: ...

    def observe(self, record: StepRecord) -> None: ...


class StepTracer(Protocol):
    """Opens a span per step; its carrier travels inside the step's worker messages."""

    def begin_step(self, index: int) -> dict[str, str]: ...

    def end_step(self, record: StepRecord) -> None: ...


class NoTracer:
    """Tracing off: nothing to carry, nothing to record."""

    def begin_step(self, index: int) -> dict[str, str]:
        return {}

    def end_step(self, record: StepRecord) -> None:
        pass


@dataclass
class RequestStats:
    """What speculation did for one request: the list of its step records, summed on demand."""

    records: list[StepRecord] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.records)

    @property
    def draft_lengths(self) -> list[int]:
        return [r.draft_length for r in self.records]

    @property
    def accepted_lengths(self) -> list[int]:
        return [r.accepted for r in self.records]

    @property
    def proposed_tokens(self) -> int:
        return sum(r.draft_length for r in self.records)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.accepted for r in self.records)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def draft_ms(self) -> float:
        return sum(r.draft_ms for r in self.records)

    @property
    def verify_ms(self) -> float:
        return sum(r.verify_ms for r in self.records)

    @property
    def pre_draft_hits(self) -> int:
        return sum(r.pre_drafted for r in self.records)

    @property
    def pre_draft_steps(self) -> int:
        return sum(r.pre_draft_asked and r.draft_length > 0 for r in self.records)

    @property
    def mean_verify_batch_size(self) -> float:
        return sum(r.verify_batch.size for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def mean_verify_batch_tokens(self) -> float:
        return sum(r.verify_batch.tokens for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def verify_queue_ms(self) -> float:
        return sum(r.verify_batch.queue_ms for r in self.records)


@dataclass(frozen=True)
class Emission:
    """Tokens committed by one step, and why generation ended if it did."""

    tokens: list[int]
    finish: Finish | None


def _widen(probs: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad distributions [n, V] to `width` columns.

    A draft and a target sharing a tokenizer may still have different embedding sizes
    (vocabularies padded to a multiple of 64, say); ids beyond a model's size have
    probability 0 under it, which is exactly what the padding says.
    """
    return probs if probs.shape[1] == width else torch.nn.functional.pad(probs, (0, width - probs.shape[1]))


def draft_seed(request_seed: int, step: int) -> int:
    """The seed of the draft's sampler at a step: a function of the request's seed and the
    step's index only, so overlapped speculation can hand it to the draft a step early and
    the output is the same with overlap on or off."""
    digest = hashlib.blake2b(f"{request_seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


async def speculate(request: GenerationRequest, policy: DraftLengthPolicy, draft: DraftLink | None,
                    verifier: VerifierLink, limits: Limits, stats: RequestStats,
                    tracer: StepTracer | None = None,
                    on_step: Callable[[StepRecord, int], None] | None = None) -> AsyncGenerator[Emission, None]:
    """Run speculative steps until max_new_tokens or EOS, yielding each step's tokens.

    on_step(record, generated_before) is called after every step (acceptance statistics).
    If the draft service is lost for good, the request goes on decoding plainly: the
    verifier alone is enough for the same output. With request.overlap, every proposal
    also asks the draft to pre-draft the next step while the target verifies this one
    (`specd.predraft`); the draft seeds depend only on the step index, so the output is
    the same either way.
    """
    transform = request.transform
    tracer = tracer or NoTracer()
    generator = torch.Generator().manual_seed(request.seed)
    committed = list(request.prompt_ids)
    generated = 0
    pre_draft_asked = False  # the last proposal asked the draft to pre-draft this step
    while True:
        remaining = request.max_new_tokens - generated
        # A step emits up to γ+1 tokens: never more than asked, never past the draft's
        # context (the draft feeds up to len(committed) + γ − 1 positions).
        gamma = 0 if draft is None else policy.next_draft_length()
        gamma = max(0, min(gamma, remaining - 1, limits.draft_context - len(committed)))
        carrier = tracer.begin_step(stats.steps)
        draft_tokens: list[int] = []
        draft_probs = torch.zeros(0, limits.vocab_size)
        draft_ms = draft_forward_ms = 0.0
        draft_bytes = 0
        draft_batch = BatchStats(size=0)
        asked, pre_draft_asked, pre_drafted = pre_draft_asked, False, False
        if gamma > 0:
            assert draft is not None  # γ > 0 only with a draft
            began = time.perf_counter()
            seed = 0 if transform.greedy else draft_seed(request.seed, stats.steps)
            pre_draft = None
            if request.overlap:
                # The next step most likely asks for the same γ (a shorter one takes a prefix).
                next_seed = 0 if transform.greedy else draft_seed(request.seed, stats.steps + 1)
                pre_draft = PreDraftRequest(gamma, next_seed)
            try:
                proposal = await draft.propose(committed, gamma, transform, seed, request.draft_model,
                                               policy.min_confidence, limits.vocab_size, carrier, pre_draft)
            except WorkerError as exc:
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise  # the client's deadline passed: the request is over, not just the draft
                log.warning("draft lost (%s); decoding the rest of the request plainly", exc)
                await draft.close(finished=False)
                draft = None
            else:
                draft_ms = (time.perf_counter() - began) * 1e3
                draft_forward_ms, draft_bytes = proposal.forward_ms, draft.last_exchange_bytes
                draft_tokens = proposal.tokens
                draft_batch = proposal.batch
                pre_drafted, pre_draft_asked = proposal.pre_drafted, pre_draft is not None
                if proposal.probs is not None:
                    draft_probs = proposal.probs
        began = time.perf_counter()
        scores = await verifier.verify(committed, draft_tokens, transform, carrier)
        verify_ms = (time.perf_counter() - began) * 1e3
        proposed = torch.tensor(draft_tokens, dtype=torch.long)
        if transform.greedy:
            outcome = verify_greedy(proposed, torch.tensor(scores.argmax, dtype=torch.long))
        else:
            assert scores.probs is not None  # sampled: the verifier always sends the target's distributions
            width = max(draft_probs.shape[1], scores.probs.shape[1])
            outcome = rejection_sample(proposed, _widen(draft_probs, width), _widen(scores.probs, width), generator)

        emitted = draft_tokens[: outcome.accepted] + [outcome.token]
        kept_before = len(committed) + outcome.accepted
        position = len(committed)
        committed.extend(emitted)
        verifier.advance(kept_before)
        if draft_tokens:  # a draft that sat this step out still holds only what it held
            assert draft is not None  # it proposed them
            draft.advance(kept_before)

        finish = None
        eos_at = next((i for i, t in enumerate(emitted) if t in limits.eos_token_ids), None)
        if eos_at is not None:
            emitted, finish = emitted[: eos_at + 1], Finish.EOS
        generated_before, generated = generated, generated + len(emitted)
        if finish is None and generated >= request.max_new_tokens:
            finish = Finish.LENGTH
        record = StepRecord(
            index=stats.steps, position=position, draft_length=len(draft_tokens),
            accepted=outcome.accepted, bonus=outcome.bonus, token=outcome.token, emitted=tuple(emitted),
            draft_ms=draft_ms, verify_ms=verify_ms, draft_forward_ms=draft_forward_ms,
            verify_forward_ms=scores.forward_ms, draft_bytes=draft_bytes,
            verify_bytes=verifier.last_exchange_bytes, draft_batch=draft_batch, verify_batch=scores.batch,
            pre_draft_asked=asked, pre_drafted=pre_drafted)
        stats.records.append(record)
        policy.observe(record)
        if on_step is not None:
            # Before the step's span ends, so what on_step notices (drift) can be an event on it.
            on_step(record, generated_before)
        tracer.end_step(record)
        yield Emission(emitted, finish)
        if finish is not None:
            return
