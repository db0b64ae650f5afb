"""Acceptance statistics: a plain object filled on the hot path, read by consumers apart.

Counters (summable across replicas) of drafts, draft tokens, accepted and emitted
tokens, keyed by labels — model pair, task type, user segment, prompt-length bucket —
with per-draft-position and per-generation-position breakdowns; kept for the lifetime
of the process and over a sliding window of the most recent steps; and overlapped
speculation's hits. What steps cost is kept apart (`gateway.stats.paircosts`). The Prometheus exporter and
the GetAcceptanceStats RPC read it; neither writes it. Per segment (model pair, task
type, user segment) it also keeps window and lifetime sums, updated per step, from which
`gateway.stats.drift` judges whether recent acceptance dropped. No gRPC here.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, astuple, dataclass, field

from gateway.stats.drift import Drift, DriftSettings, Sample, judge
from specd.errors import InvalidArgument

PROMPT_BUCKETS = (32, 128, 512, 2048)
GENERATION_BUCKETS = (32, 64, 128, 256, 512)
LABEL_NAMES = ("model_pair", "task_type", "user_segment", "prompt_bucket")


def bucket(value: int, edges: tuple[int, ...]) -> str:
    """The bucket label of a length: "0-31", "32-127", ..., "2048+"."""
    low = 0
    for edge in edges:
        if value < edge:
            return f"{low}-{edge - 1}"
        low = edge
    return f"{low}+"


@dataclass(frozen=True)
class Labels:
    """The segment a request's steps are counted under."""

    model_pair: str
    task_type: str
    user_segment: str
    prompt_bucket: str


@dataclass
class Counts:
    """Summable counters of one segment."""

    steps: int = 0  # every step, plain ones included
    drafts: int = 0  # steps that proposed at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens committed by the drafts
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # generation bucket → [draft tokens, accepted tokens]
    by_generation_bucket: dict[str, list[int]] = field(default_factory=dict)

    def add(self, draft_length: int, accepted: int, emitted: int, generated_before: int) -> None:
        self.steps += 1
        if draft_length == 0:
            return
        self.drafts += 1
        self.draft_tokens += draft_length
        self.accepted_tokens += accepted
        self.emitted_tokens += emitted
        _grow(self.proposed_per_position, draft_length)
        _grow(self.accepted_per_position, draft_length)
        for i in range(draft_length):
            self.proposed_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        pair = self.by_generation_bucket.setdefault(bucket(generated_before, GENERATION_BUCKETS), [0, 0])
        pair[0] += draft_length
        pair[1] += accepted

    def merge(self, other: Counts) -> None:
        for name in ("steps", "drafts", "draft_tokens", "accepted_tokens", "emitted_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.proposed_per_position, other.proposed_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            _grow(mine, len(theirs))
            for i, value in enumerate(theirs):
                mine[i] += value
        for key, (proposed, accepted) in other.by_generation_bucket.items():
            pair = self.by_generation_bucket.setdefault(key, [0, 0])
            pair[0] += proposed
            pair[1] += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per speculative step (vLLM's definition)."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def reached(self) -> list[int]:
        """Drafts that reached each position with every earlier token accepted: the
        proposals there, at most the acceptances one position before."""
        return [proposed if i == 0 else min(proposed, self.accepted_per_position[i - 1])
                for i, proposed in enumerate(self.proposed_per_position)]

    @property
    def reached_tokens(self) -> int:
        """Draft positions reached, summed over positions: α's denominator."""
        return sum(self.reached())

    @property
    def alpha(self) -> float:
        """α: P(a draft token is accepted | the ones before it were): what the geometric
        model's α means, pooled over the draft positions reached. Unlike accepted /
        proposed it does not fall when drafts get longer at the same agreement."""
        reached = self.reached_tokens
        return sum(self.accepted_per_position) / reached if reached else 0.0

    def position_curve(self) -> list[float]:
        """Conditional acceptance at draft position i given positions < i were accepted."""
        curve = []
        for accepted, reached in zip(self.accepted_per_position, self.reached()):
            if reached == 0:
                break
            curve.append(accepted / reached)
        return curve


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * (length - len(values)))


def _segment(labels: Labels) -> tuple[str, str, str]:
    return labels.model_pair, labels.task_type, labels.user_segment


def _add_sums(sums: dict[tuple[str, str, str], list[int]], labels: Labels, draft_length: int, accepted: int,
              sign: int) -> None:
    """Add (sign=1) or remove (sign=-1) one step's draft counts to its segment's sums:
    [drafts, positions reached, accepted] (`gateway.stats.drift.Sample`)."""
    if draft_length == 0:
        return
    row = sums.setdefault(_segment(labels), [0, 0, 0])
    row[0] += sign
    row[1] += sign * (accepted + (accepted < draft_length))  # the first rejected position was reached too
    row[2] += sign * accepted


@dataclass
class DecayedAcceptance:
    """A draft's recent acceptance α: accepted draft tokens over accepted tokens and
    rejections (each step's first rejected position was reached too), both forgetting by
    `decay` a step, from pseudo-counts worth a prior. The one estimator a request's γ
    policy, its model-free proposers' choice and the load cap each keep their own of."""

    decay: float
    accepted: float = 0.0
    trials: float = 0.0

    @classmethod
    def from_prior(cls, alpha: float, weight: float, memory_steps: int) -> DecayedAcceptance:
        """Starting at `alpha` as if from `weight` draft tokens; a step weighs
        1/`memory_steps` less with every step after it."""
        return cls(1.0 - 1.0 / memory_steps, alpha * weight, weight)

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def observe(self, accepted: int, rejected: bool) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + rejected

    def after(self, accepted: int, rejected: bool) -> float:
        """α as it would be after observing a step, the estimate itself unmoved."""
        return (self.decay * self.accepted + accepted) / (self.decay * self.trials + accepted + rejected)


class AcceptanceStats:
    """Lifetime and windowed acceptance counters by label set, and drift sums by segment.

    Written from the gateway's event loop, read from the metrics thread: one lock.
    `max_user_segments` and `max_task_types` cap label cardinality: later segments, and
    a segment's later task types (free text a caller sends), are counted as "other". Task
    types are capped per segment, and with API keys a segment is a tenant: one tenant's
    junk task types never push another's into "other".
    """

    def __init__(self, window_steps: int = 2000, max_user_segments: int = 50, max_task_types: int = 50,
                 drift: DriftSettings = DriftSettings(), baseline: dict[tuple[str, str], float] | None = None) -> None:
        """baseline: pinned acceptance per (model pair, task type), replacing lifetime
        acceptance as the drift reference of the segments it covers."""
        self.window_steps = window_steps
        self.drift_settings = drift
        self.baseline = dict(baseline or {})
        self.max_user_segments = max_user_segments
        self.max_task_types = max_task_types
        self._lock = threading.Lock()
        self._lifetime: dict[Labels, Counts] = {}
        self._window: deque[tuple[Labels, int, int, int, int]] = deque(maxlen=window_steps)
        self._segments: set[str] = set()
        self._task_types: dict[str, set[str]] = {}  # segment (as counted) → its task types
        self._pre_drafts: dict[Labels, list[int]] = {}  # labels → [steps that could hit, hits]
        # (model pair, task type) → lifetime counts: the per-position curve the cost
        # policy reads every step, kept up to date here instead of re-summed per read.
        self._by_pair_task: dict[tuple[str, str], Counts] = {}
        # segment → [drafts, positions reached, accepted tokens], in the window and lifetime;
        # kept per step so drift is judged in O(1) on the hot path.
        self._window_sums: dict[tuple[str, str, str], list[int]] = {}
        self._lifetime_sums: dict[tuple[str, str, str], list[int]] = {}

    def segment(self, user_segment: str) -> str:
        """The user segment as counted: past `max_user_segments` distinct ones, "other"."""
        with self._lock:
            if user_segment not in self._segments and len(self._segments) >= self.max_user_segments:
                user_segment = "other"
            self._segments.add(user_segment)
        return user_segment

    def task_type(self, task_type: str, segment: str) -> str:
        """The task type as counted in a segment (as counted): past the segment's
        `max_task_types` distinct ones, "other"."""
        task_type = task_type or "general"
        with self._lock:
            # A client that sends a new task_type on every request must not grow the
            # counters (and the /metrics page) without bound.
            known = self._task_types.setdefault(segment, set())
            if task_type not in known and len(known) >= self.max_task_types:
                task_type = "other"
            known.add(task_type)
        return task_type

    def labels(self, model_pair: str, task_type: str, user_segment: str, prompt_tokens: int) -> Labels:
        """The labels of a request, with the user segment and its task type capped."""
        segment = self.segment(user_segment)
        return Labels(model_pair, self.task_type(task_type, segment), segment, bucket(prompt_tokens, PROMPT_BUCKETS))

    def record(self, labels: Labels, draft_length: int, accepted: int, emitted: int, generated_before: int) -> None:
        """Count one step (hot path)."""
        step = (draft_length, accepted, emitted, generated_before)
        with self._lock:
            self._lifetime.setdefault(labels, Counts()).add(*step)
            self._by_pair_task.setdefault((labels.model_pair, labels.task_type), Counts()).add(*step)
            if len(self._window) == self._window.maxlen:
                evicted, length, kept, *_ = self._window[0]
                _add_sums(self._window_sums, evicted, length, kept, -1)
            self._window.append((labels, *step))
            _add_sums(self._window_sums, labels, draft_length, accepted, 1)
            _add_sums(self._lifetime_sums, labels, draft_length, accepted, 1)

    def drift(self, labels: Labels) -> Drift | None:
        """The drift verdict of a request's segment now (None until it can be judged)."""
        with self._lock:
            return self._judge(_segment(labels))

    def drift_table(self) -> list[tuple[tuple[str, str, str], Drift]]:
        """Every judgeable segment's drift verdict, by (model pair, task type, user segment)."""
        with self._lock:
            verdicts = [(key, self._judge(key)) for key in sorted(self._window_sums)]
        return [(key, verdict) for key, verdict in verdicts if verdict is not None]

    def _judge(self, key: tuple[str, str, str]) -> Drift | None:
        """(called with the lock held)"""
        window = Sample(*self._window_sums.get(key, (0, 0, 0)))
        pinned = self.baseline.get(key[:2])
        if pinned is not None:
            return judge(window, pinned, self.drift_settings)
        lifetime = self._lifetime_sums.get(key, (0, 0, 0))
        # The window's own steps are left out of the reference: two independent samples.
        earlier = Sample(*(total - recent for total, recent in zip(lifetime, astuple(window))))
        return judge(window, earlier, self.drift_settings)

    def record_pre_draft(self, labels: Labels, hit: bool) -> None:
        """Count one step whose proposal was pre-drafted for (overlap), and whether it hit."""
        with self._lock:
            counts = self._pre_drafts.setdefault(labels, [0, 0])
            counts[0] += 1
            counts[1] += hit

    def pre_draft_snapshot(self) -> dict[Labels, tuple[int, int]]:
        """(steps, hits) of overlapped speculation by label set."""
        with self._lock:
            return {labels: (steps, hits) for labels, (steps, hits) in self._pre_drafts.items()}

    def snapshot(self, window: bool = False) -> dict[Labels, Counts]:
        """A copy of the counters by label set: lifetime, or just the sliding window."""
        with self._lock:
            if not window:
                out: dict[Labels, Counts] = {}
                for labels, counts in self._lifetime.items():
                    out[labels] = Counts()
                    out[labels].merge(counts)
                return out
            steps = list(self._window)
        out = {}
        for labels, *step in steps:
            out.setdefault(labels, Counts()).add(*step)
        return out

    def query(self, group_by: list[str], where: dict[str, str], window: bool = False) -> list[tuple[dict, Counts]]:
        """Counters filtered by label values and summed within groups of the given labels."""
        unknown = set(group_by) | set(where)
        unknown -= set(LABEL_NAMES)
        if unknown:
            raise InvalidArgument(f"unknown label(s) {sorted(unknown)}; use {list(LABEL_NAMES)}")
        groups: dict[tuple, Counts] = {}
        for labels, counts in self.snapshot(window).items():
            values = asdict(labels)
            if any(values[k] != v for k, v in where.items()):
                continue
            key = tuple(values[name] for name in group_by)
            groups.setdefault(key, Counts()).merge(counts)
        return [(dict(zip(group_by, key)), counts) for key, counts in sorted(groups.items())]

    def position_curve(self, model_pair: str, task_type: str, min_samples: int = 50) -> list[float] | None:
        """The measured per-position acceptance curve of a pair and task, once there is data."""
        with self._lock:
            counts = self._by_pair_task.get((model_pair, task_type))
            if counts is None or not counts.proposed_per_position or counts.proposed_per_position[0] < min_samples:
                return None
            return counts.position_curve()

    def measured_alpha(self, model_pair: str, task_type: str, min_samples: int = 32) -> float | None:
        """Conditional acceptance of a pair over its lifetime: on this task once it has
        `min_samples` draft tokens, else over all the pair's tasks once they have; None before.

        A new request starts from it rather than from the task table's prior. A few dozen
        tokens are enough to tell a draft the target never agrees with from a trained one,
        and every request started from a wrong prior spends its first steps proposing."""
        with self._lock:
            counts = self._by_pair_task.get((model_pair, task_type))
            if counts is None or counts.draft_tokens < min_samples:
                counts = Counts()
                for (pair, _), task_counts in self._by_pair_task.items():
                    if pair == model_pair:
                        counts.merge(task_counts)
            if counts.draft_tokens < min_samples:
                return None
            return counts.alpha
