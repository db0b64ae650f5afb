"""How long a worker step may take, from what steps have taken, and what a slow worker costs.

A worker that hangs (a stopped process, a wedged GPU, a partition that drops nothing)
fails nothing: its streams stay open and its health port may still answer. So the
gateway gives every step a budget from measurement, as Envoy's per-try timeouts and
outlier detection do:

    budget = max(floor, factor × p99 of the service's recent step times) × forwards

where forwards = 1 + the prefill chunks a step feeds (a re-opened session re-sends its
whole sequence, which the worker runs in chunks of `PREFILL_CHUNK` tokens). p99 is of
the gateway's own wall time of a step (queueing at the worker included), over the last
`WINDOW` steps of that service; until `MIN_SAMPLES` steps were measured the floor alone
applies. The floors are flags (`--draft-step-floor`, `--verifier-step-floor`), the
factor too (`--step-budget-factor`).

What a step over budget means differs by service (gateway.workers.links):
- the draft: the step goes on without a proposal, and the draft service is marked slow
  (`SlowMark`): no request asks it until a probe, one step of one request, finds it
  answering again. The probes back off from 1 s to 30 s while it stays slow.
- the verifier: the session fails over to another verifier, or the request ends with
  UNAVAILABLE when there is none.
"""
from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

WINDOW = 512  # recent steps the p99 is taken over
MIN_SAMPLES = 32  # fewer measured steps: the floor alone
PREFILL_CHUNK = 128  # tokens a worker feeds per forward (specd.worker.settings.BatchSettings.prefill_chunk)


@dataclass(frozen=True)
class BudgetSettings:
    """The knobs of one service's step budget."""

    floor_s: float  # no step budget is shorter than this (× forwards)
    factor: float = 4.0  # how far past its measured p99 a step may run


class StepBudget:
    """The step budget of one worker service, learned from its steps (see the module doc)."""

    def __init__(self, settings: BudgetSettings) -> None:
        self.settings = settings
        self._seconds: deque[float] = deque(maxlen=WINDOW)
        self._p99 = 0.0
        self._since_sorted = 0

    def observe(self, seconds: float) -> None:
        """A step answered after `seconds`."""
        self._seconds.append(seconds)
        self._since_sorted += 1
        if self._since_sorted >= 16 or len(self._seconds) == MIN_SAMPLES:  # sorting 512 floats: not every step
            ordered = sorted(self._seconds)
            self._p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
            self._since_sorted = 0

    @property
    def p99_s(self) -> float:
        """The measured p99 (0 until MIN_SAMPLES steps were measured)."""
        return self._p99 if len(self._seconds) >= MIN_SAMPLES else 0.0

    def describe(self) -> str:
        """The rule and the figures behind the budget, for messages."""
        p99 = f"{self.p99_s * 1e3:.1f} ms" if self.p99_s else f"not measured yet ({len(self._seconds)} steps)"
        return (f"max({self.settings.floor_s:g} s, {self.settings.factor:g} × p99 {p99}) "
                f"per {PREFILL_CHUNK} tokens fed")

    def seconds(self, fed_tokens: int) -> float:
        """The budget of a step that feeds `fed_tokens` tokens to the worker."""
        per_forward = max(self.settings.floor_s, self.settings.factor * self.p99_s)
        return per_forward * (1 + fed_tokens // PREFILL_CHUNK)


class SlowMark:
    """Whether a worker service is slow: after a step over budget, it is left alone until a
    probe (one step, of one link) finds it answering; probes back off while it stays slow."""

    def __init__(self, first_probe_s: float = 1.0, max_probe_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_probe_s = first_probe_s
        self.max_probe_s = max_probe_s
        self._clock = clock
        self._probe_at: float | None = None  # None: not slow
        self._wait_s = first_probe_s
        self._prober: object | None = None  # the link whose step is the probe in flight

    @property
    def slow(self) -> bool:
        return self._probe_at is not None

    def ask(self, asker: object) -> bool:
        """Whether `asker` may send a step now: yes unless the service is slow; when slow,
        yes for one step at a time (the probe) once the probe is due."""
        if self._probe_at is None:
            return True
        if self._prober is not None or self._clock() < self._probe_at:
            return False
        self._prober = asker
        return True

    def answered(self) -> None:
        """A step came back within its budget: the service is not slow (any more)."""
        self._probe_at, self._wait_s, self._prober = None, self.first_probe_s, None

    def timed_out(self, asker: object) -> None:
        """`asker`'s step ran past its budget: slow until the next probe, which waits
        longer each time the service stays slow."""
        if asker is self._prober or self._probe_at is None:
            self._probe_at = self._clock() + self._wait_s
            self._wait_s = min(self._wait_s * 2, self.max_probe_s)
        if asker is self._prober:
            self._prober = None

    def abandon(self, asker: object) -> None:
        """`asker`'s step ended with neither an answer nor a timeout (its request went away):
        if it was the probe, the next step due probes instead."""
        if asker is self._prober:
            self._prober = None
