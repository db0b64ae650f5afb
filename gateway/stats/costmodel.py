"""The speedup model of speculative decoding, and the measured costs it needs.

    E[tokens per step] = (1 − α^(γ+1)) / (1 − α)        (i.i.d. acceptance α)
                       = 1 + Σ_{i≤γ} Π_{j≤i} r_j        (measured per-position rates r_j)
    speedup(γ)         ≈ E / (γ·c + v(γ))

c is the draft's cost per token and v(γ) the verify cost, both relative to one plain
target step (docs/design.md §5). `StepCosts` measures them from real steps, as wall time
seen by the gateway (network hops included: they are part of what a step costs).

Workers batch the steps of every session (docs/design.md §4), so what a step costs depends
on the load: with eight sessions in the target's forward, each extra draft token makes
everyone's forward longer. `StepCosts` therefore keeps one cost table per load level
(the number of sessions in the verifier's forward, bucketed) and answers for the load
seen last, so γ follows the load: as the target fills up, verifying more positions
costs more, and the best γ shrinks — to 0 (plain decoding) once speculation no longer
pays, as in vLLM's K*(bs) = argmax_K (1 + Σ_{i<K} a_i) / ITL(bs, K).
Pure Python; no gRPC.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace


def expected_tokens(alpha: float, gamma: int) -> float:
    """Expected tokens emitted by one step of γ draft tokens at i.i.d. acceptance α."""
    if gamma <= 0:
        return 1.0
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_tokens_from_curve(rates: list[float], gamma: int) -> float:
    """Expected tokens per step from conditional acceptance rates r_1..r_γ by position."""
    total, survive = 1.0, 1.0
    for rate in rates[:gamma]:
        survive *= rate
        total += survive
    return total


class _Ema:
    """Exponential moving average that starts at its first sample."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None
        self.updated = 0  # the owner's step count at the last sample

    def add(self, sample: float, step: int = 0) -> None:
        self.value = sample if self.value is None else self.value + self.weight * (sample - self.value)
        self.updated = step


# A γ not measured in this many of a cost table's steps no longer counts as measured.
STALE_AFTER_STEPS = 200


@dataclass(frozen=True)
class CostEstimate:
    """Milliseconds of one step at γ: draft hop plus verify hop."""

    target_step_ms: float
    draft_ms: float
    verify_ms: float

    @property
    def step_ms(self) -> float:
        return self.draft_ms + self.verify_ms


class CostTable:
    """Measured step costs of one model pair at one load level.

    Keeps an EMA of the draft hop's and the verify hop's wall time for each γ seen and
    fits a line through them (cost = a + b·γ), so an unseen γ — including γ = 0, the
    plain target step — gets an estimate too. Before any measurement it assumes a
    draft token costs `prior_draft_ratio` of a target step.
    """

    def __init__(self, weight: float = 0.1, prior_draft_ratio: float = 0.2) -> None:
        self.prior_draft_ratio = prior_draft_ratio
        self._draft: dict[int, _Ema] = defaultdict(lambda: _Ema(weight))
        self._verify: dict[int, _Ema] = defaultdict(lambda: _Ema(weight))
        self._weight = weight
        self._steps = 0

    def observe(self, draft_length: int, draft_ms: float | None, verify_ms: float) -> None:
        """One step's hop times at γ; draft_ms None: the verify hop alone says something."""
        self._steps += 1
        if draft_length > 0 and draft_ms is not None:
            self._draft[draft_length].add(draft_ms, self._steps)
        self._verify[draft_length].add(verify_ms, self._steps)

    def _fresh(self, points: dict[int, _Ema]) -> dict[int, float]:
        """γ → ms, for the γs measured in the last STALE_AFTER_STEPS steps.

        A γ the policy stopped choosing keeps the figure it had then, maybe from a slow
        first forward at that shape or a busy moment. Kept for ever, one bad figure rules
        that γ out for good, and it tilts the fitted line against every longer γ. Dropped,
        the line through the fresh γs stands in for it, and the policy tries it again.
        """
        recent = self._steps - STALE_AFTER_STEPS
        return {g: e.value for g, e in points.items() if e.value is not None and e.updated > recent}

    @staticmethod
    def _fit(seen: dict[int, float], through_origin: bool) -> tuple[float, float] | None:
        """Least-squares line (intercept, slope ≥ 0) through the (γ, ms) seen.

        From a single point the shape is assumed: a draft hop proportional to γ
        (through_origin), a verify hop that grows 5% of a plain step per extra token.
        """
        if not seen:
            return None
        if len(seen) == 1:
            ((x0, y0),) = seen.items()
            if through_origin:
                return 0.0, y0 / x0
            intercept = y0 / (1.0 + 0.05 * x0)
            return intercept, 0.05 * intercept
        mean_x, mean_y = sum(seen) / len(seen), sum(seen.values()) / len(seen)
        var = sum((x - mean_x) ** 2 for x in seen)
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in seen.items()) / var)
        return mean_y - slope * mean_x, slope

    @staticmethod
    def _at(seen: dict[int, float], fit: tuple[float, float], gamma: int) -> float:
        """Measured value at γ when seen, else the fitted line's."""
        if gamma in seen:
            return seen[gamma]
        return max(fit[0] + fit[1] * gamma, 0.0)

    def _verify_line(self) -> tuple[dict[int, float], tuple[float, float]] | None:
        """The fresh verify figures and the line through them; None before any measurement."""
        verify = self._fresh(self._verify)
        fit = self._fit(verify, through_origin=False)
        return None if fit is None else (verify, fit)

    @classmethod
    def _plain_step(cls, verify: dict[int, float], fit: tuple[float, float]) -> float:
        """A plain target step: measured at γ = 0, else the verify line's intercept."""
        # Noisy points can put the fitted intercept near or below zero; a plain step
        # cannot cost much less than the cheapest verify step seen.
        return max(cls._at(verify, fit, 0), 0.5 * min(verify.values()))

    def target_step_ms(self) -> float | None:
        """A plain target step: measured at γ = 0, else the verify line's intercept."""
        line = self._verify_line()
        return None if line is None else self._plain_step(*line)

    def estimate(self, gamma: int) -> CostEstimate | None:
        """Predicted milliseconds of a step at γ, from the fitted lines; None before any measurement.

        The lines, not each γ's own average: under load one step's hop time varies by more
        than a few draft tokens change it, and comparing γs by their own noisy averages
        lets a lucky sample win. The lines pool every γ seen and keep a longer draft at
        least as costly as a shorter one.
        """
        estimates = self.estimates([gamma])
        return estimates[0] if estimates else None

    def estimates(self, gammas: Sequence[int]) -> list[CostEstimate]:
        """`estimate` at each of `gammas`, the lines fitted once; [] before any measurement."""
        line = self._verify_line()
        if line is None:
            return []
        verify, (intercept, slope) = line
        target = self._plain_step(verify, (intercept, slope))
        plain = max(intercept, min(verify.values()) * 0.5)
        draft_fit = self._fit(self._fresh(self._draft), through_origin=True) or (0.0, self.prior_draft_ratio * target)
        return [CostEstimate(target, 0.0, plain) if gamma == 0 else
                CostEstimate(target, max(draft_fit[0] + draft_fit[1] * gamma, 0.0), plain + slope * gamma)
                for gamma in gammas]

    def ratios(self) -> tuple[float, dict[int, float]]:
        """(c, {γ: v(γ)}) for the γ values seen, relative to one plain target step."""
        target = self.target_step_ms()
        if not target:
            return 0.0, {}
        seen = sorted((g, e.value) for g, e in self._draft.items() if e.value is not None)
        c = (sum(value / g for g, value in seen) / len(seen) / target) if seen else 0.0
        v = {g: e.value / target for g, e in sorted(self._verify.items()) if e.value is not None}
        return c, v

    def draft_ms_per_token(self) -> float:
        seen = [(g, e.value) for g, e in self._draft.items() if e.value is not None]
        return sum(value / g for g, value in seen) / len(seen) if seen else 0.0


LOAD_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # upper bounds of sessions sharing the target's forward


def load_bucket(batch_size: int) -> int:
    """The load level of a forward shared by `batch_size` sessions (the bucket's upper bound)."""
    return next((edge for edge in LOAD_BUCKETS if batch_size <= edge), LOAD_BUCKETS[-1] * 2)


class StepCosts:
    """Measured step costs of one model pair, learned from every step the gateway runs.

    One `CostTable` per load level (`load_bucket` of the verifier's batch size reported
    with each step); `estimate` answers for the load seen last, from that level's table
    or, before it has any, the nearest level's. `ratios` and the other summaries
    describe the pair running alone when that was measured (the pair's own speed).
    """

    def __init__(self, weight: float = 0.1, prior_draft_ratio: float = 0.2) -> None:
        self._weight = weight
        self.prior_draft_ratio = prior_draft_ratio
        self._tables: dict[int, CostTable] = {}
        self.load = 1  # the load bucket of the last step observed
        # Overlapped speculation: how often a pre-drafted step hits, and what its draft hop
        # costs then (the wait for a branch still drafting, plus the hop).
        self.hit_rate = _Ema(weight)
        self.hit_draft_ms = _Ema(weight)

    def observe(self, draft_length: int, draft_ms: float, verify_ms: float, batch_size: int = 1,
                pre_draft_asked: bool = False, pre_drafted: bool = False, verify_only: bool = False) -> None:
        """One step's hop times, at the load its verify forward reported.

        A step answered from a pre-drafted branch says what a hit costs, not what drafting
        γ tokens costs; it goes to the hit figures instead of the draft table. verify_only:
        another proposer drafted; the verify hop alone is this pair's figure."""
        self.load = load_bucket(batch_size)
        table = self._tables.get(self.load)
        if table is None:
            table = self._tables[self.load] = CostTable(self._weight, self.prior_draft_ratio)
        if pre_draft_asked and draft_length:
            self.hit_rate.add(1.0 if pre_drafted else 0.0)
        if pre_drafted:
            self.hit_draft_ms.add(draft_ms)
        table.observe(draft_length, None if pre_drafted or verify_only else draft_ms, verify_ms)

    def table(self, load: int | None = None) -> CostTable | None:
        """The table of a load bucket (default: the current load), else the nearest measured one."""
        if not self._tables:
            return None
        load = self.load if load is None else load
        return self._tables[min(self._tables, key=lambda bucket: (abs(bucket - load), bucket))]

    def estimate(self, gamma: int, overlap: bool = False) -> CostEstimate | None:
        """Predicted milliseconds of a step at γ under the current load; None before any measurement.

        With overlap, the draft hop is a hit's cost with the measured hit rate h and a full
        proposal otherwise: h·hit + (1 − h)·draft(γ) — about max(draft, verify) on a hit
        and their sum on a miss, as measured.
        """
        table = self.table()
        if table is None:
            return None
        estimate = table.estimate(gamma)
        h, hit_ms = self.hit_rate.value, self.hit_draft_ms.value
        if estimate is None or not overlap or gamma == 0 or h is None or hit_ms is None:
            return estimate
        return replace(estimate, draft_ms=h * hit_ms + (1.0 - h) * estimate.draft_ms)

    def estimates(self, gammas: Sequence[int]) -> list[CostEstimate]:
        """`estimate` (without overlap) at each of `gammas`, the lines fitted once; [] before
        any measurement. What a caller pricing many lengths in one step wants."""
        table = self.table()
        return table.estimates(gammas) if table is not None else []

    def _summary_table(self) -> CostTable | None:
        return self.table(1)

    def target_step_ms(self) -> float | None:
        table = self._summary_table()
        return table.target_step_ms() if table else None

    def ratios(self) -> tuple[float, dict[int, float]]:
        table = self._summary_table()
        return table.ratios() if table else (0.0, {})

    def draft_ms_per_token(self) -> float:
        table = self._summary_table()
        return table.draft_ms_per_token() if table else 0.0


def best_draft_length(alpha: float, costs: StepCosts, candidates: Sequence[int],
                      curve: list[float] | None = None, overlap: bool = False) -> int:
    """The γ among candidates that maximises expected tokens per millisecond.

    Before any cost is measured, the middle candidate: a first step to measure from.
    """
    if costs.estimate(candidates[-1]) is None:
        return candidates[len(candidates) // 2]
    best, best_rate = candidates[0], -1.0
    for gamma in candidates:
        tokens = expected_tokens_from_curve(curve, gamma) if curve else expected_tokens(alpha, gamma)
        estimate = costs.estimate(gamma, overlap)
        assert estimate is not None  # costs are measured (above)
        rate = tokens / estimate.step_ms
        if rate > best_rate:
            best, best_rate = gamma, rate
    return best


def predicted_speedup(alpha: float, costs: StepCosts, max_draft_length: int) -> float:
    """Expected tokens per millisecond at the best γ ≤ max_draft_length (0 included), over a plain
    target step's: what a draft of acceptance α is worth to this pair at the present load.

    Before any cost is measured, a draft token is taken to cost `prior_draft_ratio` of a
    target step and verifying γ tokens as much as one plain step.
    """
    plain = costs.estimate(0)
    best = 1.0  # γ = 0: plain decoding
    for gamma in range(1, max_draft_length + 1):
        estimate = costs.estimate(gamma)
        if plain is None or estimate is None:
            relative_cost = 1.0 + costs.prior_draft_ratio * gamma
        else:
            relative_cost = estimate.step_ms / plain.step_ms
        best = max(best, expected_tokens(alpha, gamma) / relative_cost)
    return best
