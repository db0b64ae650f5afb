"""Step budgets from measured step times, and the slow mark's probes (gateway.workers.budgets)."""
from __future__ import annotations

import pytest

from gateway.workers.budgets import MIN_SAMPLES, PREFILL_CHUNK, BudgetSettings, SlowMark, StepBudget


def test_the_floor_holds_until_steps_are_measured():
    budget = StepBudget(BudgetSettings(floor_s=0.5, factor=4.0))
    for _ in range(MIN_SAMPLES - 1):
        budget.observe(2.0)
    assert budget.seconds(1) == 0.5  # too few samples to trust
    budget.observe(2.0)
    assert budget.seconds(1) == pytest.approx(8.0)  # 4 × a p99 of 2 s


def test_the_budget_follows_the_p99_and_the_prefill():
    budget = StepBudget(BudgetSettings(floor_s=0.1, factor=4.0))
    for i in range(112):  # the p99 is re-taken every 16 steps
        budget.observe(0.010 if i else 0.200)  # one slow step in a hundred is past the p99
    assert budget.p99_s == pytest.approx(0.010)
    for _ in range(400):
        budget.observe(0.050)
    assert budget.p99_s == pytest.approx(0.050)
    assert budget.seconds(PREFILL_CHUNK - 1) == pytest.approx(0.2)
    assert budget.seconds(3 * PREFILL_CHUNK) == pytest.approx(0.8)  # a re-opened session's prefill


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_service_is_probed_by_one_step_with_backoff():
    clock = Clock()
    mark = SlowMark(first_probe_s=1.0, max_probe_s=4.0, clock=clock)
    a, b = object(), object()
    assert mark.ask(a) and mark.ask(b)
    mark.timed_out(a)
    mark.timed_out(b)  # a second step that was in flight does not push the probe back
    assert mark.slow and not mark.ask(a)
    clock.now = 1.0
    assert mark.ask(a) and not mark.ask(b)  # one probe at a time
    mark.timed_out(a)  # still slow: the next probe waits twice as long
    clock.now = 2.5
    assert not mark.ask(b)
    clock.now = 3.0
    assert mark.ask(b)
    mark.abandon(b)  # its request went away: the next step probes instead
    assert mark.ask(a)
    mark.timed_out(a)
    clock.now = 100.0
    assert mark.ask(a)
    mark.answered()
    assert not mark.slow and mark.ask(b)
