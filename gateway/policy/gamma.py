"""Draft-length (γ) policies: how many tokens the draft proposes at each step.

- `fixed`: the same γ every step.
- `ema`: a feedback controller — an EMA of the acceptance rate over ~50 steps
  nudges γ up when above a target rate and down when well below it.
- `cost`: the default for AUTO. Chooses the γ (0, i.e. no speculation, included) that
  maximises expected tokens per millisecond, from this request's acceptance estimate (an
  EMA seeded with the task's prior) and the measured step costs of the model pair; the
  measured per-position acceptance curve shapes E[tokens] once there is data. When
  speculation does not pay it decodes plainly and probes again (one draft token) after
  `probe_every` plain steps, twice as long after each probe the target rejected outright.
  The step costs are measured per load level (`gateway.stats.costmodel.StepCosts`), and a
  `LoadCap` (`gateway.policy.loadcap`) shared by the pair's requests caps γ at each load level by
  measured goodput, so γ follows the load of the target's batched forwards, down to 0 when
  the target is saturated. A `RequestFloor` (`gateway.policy.floor`) checks the outcome: where the
  request's speculative steps measure slower than plain decoding, it decodes plainly.
- `confidence`: proposes up to the maximum γ but the draft stops inside a step as soon
  as its own top probability falls below a threshold.

`build_policy` makes one request's policy from its `Mode` and policy name, through a
registry (name → builder) that `POLICIES`, the names a request may ask for, derives from.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gateway.policy.floor import RequestFloor
from gateway.policy.loadcap import LoadCap
from gateway.request import Mode, ParsedRequest
from gateway.stats.acceptance import AcceptanceStats, DecayedAcceptance
from gateway.stats.costmodel import StepCosts, best_draft_length
from gateway.step.records import Bound, DraftLengthPolicy, StepRecord
from gateway.tasks import TaskProfile

MAX_PROBE_INTERVAL = 256


class FixedPolicy:
    """Propose the same γ every step (γ = 0: plain decoding by the target)."""

    name = "fixed"

    def __init__(self, draft_length: int) -> None:
        self.draft_length = draft_length

    def bound(self) -> Bound | None:
        return None

    def next_draft_length(self, bound: Bound | None) -> int:
        return self.draft_length

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        return self.draft_length

    def plain_steps_ahead(self, limit: int) -> int:
        return limit if self.draft_length == 0 else 0

    def observe(self, record: StepRecord) -> None:
        """Fixed: what the target accepted does not change γ."""


class EmaPolicy:
    """Feedback control of γ: EMA of acceptance over ~`steps` steps against a target rate."""

    name = "ema"

    def __init__(self, start: int, min_draft_length: int, max_draft_length: int, target_rate: float = 0.85,
                 steps: int = 50) -> None:
        self.draft_length = min(max(start, min_draft_length), max_draft_length)
        self.min_draft_length, self.max_draft_length = min_draft_length, max_draft_length
        self.target_rate = target_rate
        self.weight = 1.0 / steps
        self.rate = target_rate  # start neutral: no change until evidence accumulates

    def bound(self) -> Bound | None:
        return None

    def next_draft_length(self, bound: Bound | None) -> int:
        return self.draft_length

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        return min(self.draft_length + 1, self.max_draft_length)  # one step moves γ by one at most

    def plain_steps_ahead(self, limit: int) -> int:
        return 0  # γ never falls below min_draft_length, which is at least 1

    def observe(self, record: StepRecord) -> None:
        if record.draft_model_tokens == 0:  # learned from the draft model's tokens only
            return
        self.rate += self.weight * (record.accepted / record.draft_model_tokens - self.rate)
        if self.rate > self.target_rate + 0.05:
            self.draft_length = min(self.draft_length + 1, self.max_draft_length)
        elif self.rate < self.target_rate - 0.10:
            self.draft_length = max(self.draft_length - 1, self.min_draft_length)


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

    def __init__(self, costs: StepCosts, profile: TaskProfile,
                 curve: Callable[[], list[float] | None] = lambda: None,
                 probe_every: int = 16, memory_steps: int = 20, prior_weight: float = 8.0,
                 overlap: bool = False, probes: ProbeSchedule | None = None,
                 load_cap: LoadCap | None = None, floor: RequestFloor | None = None) -> None:
        self.costs = costs
        self.load_cap = load_cap
        self.floor = floor
        self._max_draft_length = 0  # the load cap the last γ was chosen under
        self.overlap = overlap  # the draft pre-drafts while the target verifies: a hit's draft hop is cheap
        self.profile = profile
        self.curve = curve
        self.probes = probes or ProbeSchedule(probe_every, probe_every)
        self._probing = False
        # The task's prior is worth prior_weight draft tokens.
        self.acceptance = DecayedAcceptance.from_prior(profile.prior_alpha, prior_weight, memory_steps)
        self.plain_steps = 0

    @property
    def alpha(self) -> float:
        """This request's current estimate of per-token acceptance."""
        return self.acceptance.alpha

    def _shaped_curve(self, alpha: float) -> list[float] | None:
        """The measured per-position curve, rescaled to acceptance level α."""
        curve = self.curve()
        if not curve:
            return None
        level = sum(curve) / len(curve)
        scale = alpha / level if level > 0 else 1.0
        return [min(rate * scale, 0.999) for rate in curve] + [min(alpha, 0.999)] * 32

    def bound(self) -> Bound | None:
        """The shared load cap at the current load, and its origin."""
        return None if self.load_cap is None else Bound(self.load_cap.cap(), self.load_cap.origin())

    def next_draft_length(self, bound: Bound | None) -> int:
        gamma = self._bounded_draft_length(bound)
        return gamma if self.floor is None else self.floor.admit(gamma)

    def _bounded_draft_length(self, bound: Bound | None) -> int:
        if bound is None:
            return self._own_draft_length()
        self._max_draft_length = bound.max_draft_length
        # Under a cap of 0 no γ is wanted: the request's own choice is not worth computing.
        return min(self._own_draft_length(), self._max_draft_length) if self._max_draft_length else 0

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        """The γ the next step will choose, as this step's outcome moves the acceptance
        estimate (the load cap and probes aside): drafted longer, the unused tokens cost
        draft time; shorter, γ could not grow after a rejection. 0 where the next step
        decodes plainly: the hop then only draws the recovered token."""
        gamma = self._best_length(self.acceptance.after(accepted, rejected=True))
        return min(gamma, self._max_draft_length) if self.load_cap is not None else gamma

    def plain_steps_ahead(self, limit: int) -> int:
        """Settled on plain decoding: γ = 0 now, and the steps before the next probe (a cap of
        0 allows none). Wrong now and then, when the costs, the cap or the probe interval
        (shared with the pair's other requests) change their mind."""
        if self.load_cap is not None and self._max_draft_length == 0:
            return limit
        if self.floor is not None and (ahead := self.floor.plain_steps_ahead()) is not None:
            return min(limit, ahead)
        if self.plain_steps == 0 or self._probing:  # what _own_draft_length last chose
            return 0
        # The k-th step ahead counts plain_steps + k; the first whose count the interval
        # divides is the probe.
        return min(limit, -(self.plain_steps + 1) % self.probes.interval)

    def _own_draft_length(self) -> int:
        """The γ this request's own acceptance and the measured step costs call for."""
        self._probing = False
        best = self._best_length(self.alpha)
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

    def _best_length(self, alpha: float) -> int:
        """The γ (0 included) with the most expected tokens per ms at acceptance α."""
        span = range(self.profile.min_draft_length, self.profile.max_draft_length + 1)
        return best_draft_length(alpha, self.costs, [0, *span], self._shaped_curve(alpha), self.overlap)

    def observe(self, record: StepRecord) -> None:
        if self.load_cap is not None and record.load_cap is not None:
            # The cap in force when the step began (the engine reads it every step, a step
            # that drafts nothing included), not the one γ was last chosen under: after a
            # draft is lost no γ is chosen, and its plain steps belong to today's level.
            self.load_cap.observe(record.load_cap.max_draft_length, record)
        if self.floor is not None:
            self.floor.observe(record)
        if record.draft_model_tokens == 0:  # learned from the draft model's tokens only
            return
        if self._probing:
            self.probes.record(failed=record.accepted == 0)
            self._probing = False
        self.acceptance.observe(record.accepted, rejected=not record.bonus)


class ConfidencePolicy:
    """Ask for the maximum γ; the draft stops early when its top probability is below the
    request's threshold (`Generation.min_confidence`, a draft setting)."""

    name = "confidence"

    def __init__(self, max_draft_length: int) -> None:
        self.max_draft_length = max_draft_length

    def bound(self) -> Bound | None:
        return None

    def next_draft_length(self, bound: Bound | None) -> int:
        return self.max_draft_length

    def recovery_draft_length(self, gamma: int, accepted: int) -> int:
        return self.max_draft_length

    def plain_steps_ahead(self, limit: int) -> int:
        return 0

    def observe(self, record: StepRecord) -> None:
        """Stateless across steps: the draft decides inside each step."""


# -- one request's policy -------------------------------------------------------------------

@dataclass(frozen=True)
class SharedState:
    """What a request's cost policy shares with other requests: the probe schedule (the
    pair and task's requests), the load cap (the pair's) and its floor (`gateway.policy.floor`,
    over plain decoding's rates on the target and the schedule of the pair, task and
    sampling kind). None: a request that learns alone (the doctor's)."""

    probes: ProbeSchedule | None = None
    load_cap: LoadCap | None = None
    floor: RequestFloor | None = None


# A builder: (the request, the gateway's acceptance statistics, the pair's measured step
# costs, the model pair, the state shared with other requests) → the policy.
PolicyBuilder = Callable[["ParsedRequest", AcceptanceStats, StepCosts, str, SharedState], DraftLengthPolicy]


def _fixed(parsed: ParsedRequest, stats: AcceptanceStats, costs: StepCosts, model_pair: str,
           shared: SharedState) -> DraftLengthPolicy:
    return FixedPolicy(parsed.draft_length)


def _ema(parsed: ParsedRequest, stats: AcceptanceStats, costs: StepCosts, model_pair: str,
         shared: SharedState) -> DraftLengthPolicy:
    profile = parsed.profile
    return EmaPolicy(parsed.draft_length, profile.min_draft_length, profile.max_draft_length)


def _cost(parsed: ParsedRequest, stats: AcceptanceStats, costs: StepCosts, model_pair: str,
          shared: SharedState) -> DraftLengthPolicy:
    profile = parsed.profile
    # The request's acceptance estimate starts from what this pair has measured on this
    # task, when it has, rather than from the table's prior.
    measured = stats.measured_alpha(model_pair, parsed.task_type)
    if measured is not None:
        profile = replace(profile, prior_alpha=measured)
    return CostPolicy(costs, profile,
                      curve=lambda: stats.position_curve(model_pair, parsed.task_type),
                      overlap=parsed.generation.overlap, probes=shared.probes, load_cap=shared.load_cap,
                      floor=shared.floor)


def _confidence(parsed: ParsedRequest, stats: AcceptanceStats, costs: StepCosts, model_pair: str,
                shared: SharedState) -> DraftLengthPolicy:
    return ConfidencePolicy(parsed.profile.max_draft_length)


REGISTRY: dict[str, PolicyBuilder] = {"fixed": _fixed, "ema": _ema, "cost": _cost, "confidence": _confidence}
POLICIES = tuple(REGISTRY)  # the policy names a request (or --policy) may give


def build_policy(parsed: ParsedRequest, stats: AcceptanceStats, costs: StepCosts, model_pair: str,
                 shared: SharedState = SharedState()) -> DraftLengthPolicy:
    """The γ policy object of one request; `costs`: its model pair's measured step costs;
    `shared`: what it shares with other requests.

    Mode OFF, or no draft: plain decoding (γ = 0). Otherwise the registry's builder of the
    request's policy name (`parse_request` admits only registered names; "fixed" else).
    """
    if parsed.mode is Mode.OFF or not parsed.generation.draft_model:
        return FixedPolicy(0)
    return REGISTRY.get(parsed.policy, _fixed)(parsed, stats, costs, model_pair, shared)
