"""Draft-length (γ) policies: how many tokens the draft proposes at each step.

- `fixed`: the same γ every step.
- `ema`: the seed essay's controller — an EMA of the acceptance rate over ~50 steps
  nudges γ up when above a target rate and down when well below it.
- `cost`: the default for AUTO. Chooses the γ (0, i.e. no speculation, included) that
  maximises expected tokens per millisecond, from this request's acceptance estimate (an
  EMA seeded with the task's prior) and the measured step costs of the model pair; the
  measured per-position acceptance curve shapes E[tokens] once there is data. When
  speculation does not pay it decodes plainly and probes again (one draft token) after
  `probe_every` plain steps, twice as long after each probe the target rejected outright.
  The step costs are measured per load level (`specd.costmodel.StepCosts`), so γ follows
  the load of the target's batched forwards, down to 0 when the target is saturated.
- `confidence`: proposes up to the maximum γ but the draft stops inside a step as soon
  as its own top probability falls below a threshold.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from gateway.engine import StepRecord
from specd.costmodel import StepCosts, best_draft_length
from specd.tasks import TaskProfile

POLICIES = ("fixed", "ema", "cost", "confidence")
MAX_PROBE_INTERVAL = 256


class Mode(enum.Enum):
    """Speculation mode of a request (mirrors specd.v1.SpeculationMode)."""

    AUTO = "auto"
    FIXED = "fixed"
    OFF = "off"


class FixedPolicy:
    """Propose the same γ every step (γ = 0: plain decoding by the target)."""

    name = "fixed"
    min_confidence = 0.0

    def __init__(self, draft_length: int) -> None:
        self.draft_length = draft_length

    def next_draft_length(self) -> int:
        return self.draft_length

    def observe(self, record: StepRecord) -> None:
        """Fixed: what the target accepted does not change γ."""


class EmaPolicy:
    """The seed's controller: EMA of acceptance over ~`steps` steps against a target rate."""

    name = "ema"
    min_confidence = 0.0

    def __init__(self, start: int, lowest: int, highest: int, target_rate: float = 0.85,
                 steps: int = 50) -> None:
        self.draft_length = min(max(start, lowest), highest)
        self.lowest, self.highest = lowest, highest
        self.target_rate = target_rate
        self.weight = 1.0 / steps
        self.rate = target_rate  # start neutral: no change until evidence accumulates

    def next_draft_length(self) -> int:
        return self.draft_length

    def observe(self, record: StepRecord) -> None:
        if record.draft_length == 0:
            return
        self.rate += self.weight * (record.accepted / record.draft_length - self.rate)
        if self.rate > self.target_rate + 0.05:
            self.draft_length = min(self.draft_length + 1, self.highest)
        elif self.rate < self.target_rate - 0.10:
            self.draft_length = max(self.draft_length - 1, self.lowest)


@dataclass
class ProbeSchedule:
    """How many plain steps pass between probes; shared by the requests of one model pair and
    task, so a draft that keeps failing is asked less and less often across requests too."""

    every: int = 16
    interval: int = 16  # doubles after each probe the target rejected outright, up to MAX_PROBE_INTERVAL

    def record(self, failed: bool) -> None:
        """A probe's outcome. One lucky acceptance only halves the spacing: a draft that is
        right 1% of the time still gets a token accepted now and then."""
        self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL) if failed else max(self.interval // 2, self.every)


class CostPolicy:
    """Maximise expected tokens per unit time; fall back to γ = 0 when speculation does not pay."""

    name = "cost"
    min_confidence = 0.0

    def __init__(self, costs: StepCosts, profile: TaskProfile,
                 curve: Callable[[], list[float] | None] = lambda: None,
                 probe_every: int = 16, memory_steps: int = 20, prior_weight: float = 8.0,
                 overlap: bool = False, probes: ProbeSchedule | None = None) -> None:
        self.costs = costs
        self.overlap = overlap  # the draft pre-drafts while the target verifies: a hit's draft hop is cheap
        self.profile = profile
        self.curve = curve
        self.probes = probes or ProbeSchedule(probe_every, probe_every)
        self._probing = False
        self.decay = 1.0 - 1.0 / memory_steps
        # Acceptance as an EMA of pseudo-counts: the task's prior is worth prior_weight tokens.
        self.accepted = profile.prior_acceptance * prior_weight
        self.trials = prior_weight
        self.plain_steps = 0

    @property
    def alpha(self) -> float:
        """This request's current estimate of per-token acceptance."""
        return self.accepted / self.trials

    def _shaped_curve(self) -> list[float] | None:
        """The measured per-position curve, rescaled to this request's acceptance level."""
        curve = self.curve()
        if not curve:
            return None
        level = sum(curve) / len(curve)
        scale = self.alpha / level if level > 0 else 1.0
        return [min(rate * scale, 0.999) for rate in curve] + [min(self.alpha, 0.999)] * 32

    def next_draft_length(self) -> int:
        span = range(self.profile.min_draft_length, self.profile.max_draft_length + 1)
        best = best_draft_length(self.alpha, self.costs, [0, *span], self._shaped_curve(), self.overlap)
        if best > 0:
            self.plain_steps = 0
            return best
        self.plain_steps += 1
        # Speculation does not pay: decode plainly, but probe now and then, since the
        # acceptance estimate only moves when something is proposed. A probe proposes one
        # token: the cheapest question to ask the draft (a γ = 1 step costs little more
        # than a plain one), and a failed probe costs almost nothing.
        self._probing = self.plain_steps % self.probes.interval == 0
        return 1 if self._probing else 0

    def observe(self, record: StepRecord) -> None:
        if record.draft_length == 0:
            return
        if self._probing:
            self.probes.record(failed=record.accepted == 0)
            self._probing = False
        self.accepted = self.decay * self.accepted + record.accepted
        self.trials = self.decay * self.trials + record.accepted + (0 if record.bonus else 1)


class ConfidencePolicy:
    """Ask for the maximum γ; the draft stops early when its top probability is below a threshold."""

    name = "confidence"

    def __init__(self, highest: int, min_confidence: float) -> None:
        self.highest = highest
        self.min_confidence = min_confidence

    def next_draft_length(self) -> int:
        return self.highest

    def observe(self, record: StepRecord) -> None:
        """Stateless across steps: the draft decides inside each step."""
