"""The records of a request's steps, and the seams that read them.

A `StepRecord` is what one speculative step did; every observer reads it as the step ends:
the γ policy (`DraftLengthPolicy`), the request's statistics (`RequestStats`), the server's
counters, and the tracer (`StepTracer`). `Finish` says why a request ended. Plain records:
importing this loads neither grpc nor torch, so the policies and the tracer that read
them do not load the engine (`gateway.step.engine`) to borrow a type.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from gateway.stats.acceptance import Counts
from gateway.stats.costmodel import load_bucket
from specd.contract import MODEL_FREE
from specd.steps import BatchStats


class Finish(enum.Enum):
    """Why a request ended: its token budget, the model's EOS, or a stop string."""

    LENGTH = "length"
    EOS = "eos"
    STOP = "stop"


@dataclass(frozen=True)
class StepRecord:
    """What one speculative step did: the unit every consumer (stats, policy, traces) reads."""

    index: int  # 0-based step number within the request
    position: int  # committed tokens before the step (prompt included)
    generated: int  # tokens generated before the step (the prompt not included)
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
    proposer: str = ""  # who proposed: the draft model's name, a model-free proposer's, "" for none
    # Of the draft_length tokens, the draft model's: all of them when it proposed, else 0.
    # The draft's acceptance is learned from these only (a suffix match says nothing of it).
    draft_model_tokens: int = 0
    ran_ahead: bool = False  # the verifier scored this plain step before it was asked (verifier_service.runahead)
    # Sampled: this step's proposal came with the last step's recovery hop (the draft drew
    # that step's recovered token and drafted this proposal after it), so the draft hop's
    # figures are that hop's, and the step made none of its own.
    proposal_in_hand: bool = False
    recovery_ms: float = 0.0  # wall time of this step's recovery hop to the draft (0: none)
    # Wall time from the request's previous commit to this one (the first step: from the
    # start): what the step cost the request, its hops, the gateway's own work and the
    # streaming of the last chunk included. 0: not measured (a record made elsewhere).
    interval_ms: float = 0.0
    load_cap: Bound | None = None  # the load cap in force as the step began (the policy learns under it; traces)

    @property
    def load(self) -> int:
        """The load level its verify forward ran at: the sessions in it, bucketed (`load_bucket`)."""
        return load_bucket(max(self.verify_batch.sessions, 1))

    @property
    def rest_ms(self) -> float:
        """What the step cost the request beyond drafting its proposal: the interval between
        its commits less its own draft hop and any recovery hop, never less than the verify
        hop alone; the verify hop where the interval was not measured.

        Why the interval and not the verify hop: every step also takes the gateway's own
        work (the verdict, the grammar, the text, the stream), priced alike for γ = 0 since a
        plain step's interval holds its share of it. Why less the recovery hop: a sampled
        step that rejects takes a hop to the draft that draws the recovered token and drafts
        the next proposal, which then comes in hand (`proposal_in_hand`) with that hop's
        figures as its draft hop. Counted in both steps, each rejection would pay its
        drafting twice."""
        if self.interval_ms <= 0.0:
            return self.verify_ms
        own_draft_hop = 0.0 if self.proposal_in_hand else self.draft_ms
        return max(self.interval_ms - own_draft_hop - self.recovery_ms, self.verify_ms)

    @property
    def first_rejected(self) -> int | None:
        """1-based position in the draft of the first rejected token; None if none was."""
        return None if self.bonus or self.draft_length == 0 else self.accepted + 1


class StepObserver(Protocol):
    """Reads each step's record as the step ends."""

    def observe(self, record: StepRecord) -> None: ...


class Bound(NamedTuple):
    """A step's bound on γ: the most tokens any proposal may carry, and where it came from
    ("prior", "shared", "learned", "alone": `gateway.policy.loadcap.LoadCap.origin`)."""

    max_draft_length: int
    origin: str


class DraftLengthPolicy(StepObserver, Protocol):
    """Chooses γ before each step and learns from each step's record."""

    name: str

    def bound(self) -> Bound | None:
        """This step's bound, read once as the step begins: the load cap in force
        (`gateway.policy.loadcap.LoadCap`), the most tokens any proposal may carry, a
        model-free one's too (a verified token costs the other sessions' forward alike,
        whoever proposed it); None when the policy shares no cap."""
        ...

    def next_draft_length(self, bound: Bound | None) -> int:
        """γ for the step: the draft model's proposal length, within `bound` (what `bound`
        read for this step)."""
        ...

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        """How many tokens a sampled rejection's recovery hop drafts for the next step, after
        a step that proposed `gamma` and had `accepted` of them kept (the next step takes a
        prefix): the γ the policy will choose next. Why not `gamma`: the next step could
        then never propose more than this one, and at T = 1, where most steps end in a
        rejection, γ would only shrink."""
        ...

    def plain_steps_ahead(self, limit: int) -> int:
        """How many of the (at most `limit`) steps after the one just chosen will surely
        propose nothing, whatever they commit: the verifier may score them ahead
        (`verifier_service.runahead`). A wrong count costs time, never output: the step that
        proposes after all waits for the forward run ahead, and is scored as asked."""
        ...


class StepTracer(StepObserver, Protocol):
    """Opens a span per step (its carrier travels inside the step's worker messages) and
    ends it when it observes the step's record."""

    def begin_step(self, index: int) -> dict[str, str]: ...


class NoTracer:
    """Tracing off: nothing to carry, nothing to record."""

    def begin_step(self, index: int) -> dict[str, str]:
        return {}

    def observe(self, record: StepRecord) -> None:
        pass


@dataclass
class RequestStats:
    """What speculation did for one request: its step records, summed on demand. The one
    place a request's totals are computed (the response's GenerationStats and the request
    span both read them here)."""

    records: list[StepRecord] = field(default_factory=list)

    def observe(self, record: StepRecord) -> None:
        self.records.append(record)

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
        return sum(r.pre_draft_asked and r.draft_model_tokens > 0 for r in self.records)

    @property
    def mean_verify_batch_size(self) -> float:
        return sum(r.verify_batch.size for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def mean_verify_batch_tokens(self) -> float:
        return sum(r.verify_batch.tokens for r in self.records) / len(self.records) if self.records else 0.0

    @property
    def verify_queue_ms(self) -> float:
        return sum(r.verify_batch.queue_ms for r in self.records)

    def counts(self, model_drafts_only: bool = False) -> Counts:
        """This request's steps as acceptance counters (the same ones the gateway keeps);
        model_drafts_only: leave out the steps a model-free proposer proposed for."""
        counts = Counts()
        for r in self.records:
            if model_drafts_only and r.proposer in MODEL_FREE:
                continue
            counts.add(r.draft_length, r.accepted, len(r.emitted), r.generated)
        return counts

    def per_position(self) -> tuple[list[int], list[int]]:
        """Draft tokens proposed and accepted at each position 1..γ, over every step."""
        counts = self.counts()
        return counts.proposed_per_position, counts.accepted_per_position

    def goodput(self, model_drafts_only: bool = False) -> tuple[int, float]:
        """Tokens committed and milliseconds spent by the steps after the first, which also
        prefills the prompt and so says nothing about a step's speed; model_drafts_only:
        leave out the steps a model-free proposer proposed for."""
        later = [r for r in self.records[1:] if not (model_drafts_only and r.proposer in MODEL_FREE)]
        return sum(len(r.emitted) for r in later), sum(r.draft_ms + r.verify_ms for r in later)

    def tokens_per_step(self, generated_tokens: int) -> float:
        """Mean tokens a step committed (generated_tokens: as delivered, after any stop string)."""
        return generated_tokens / self.steps if self.steps else 0.0
