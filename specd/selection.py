"""Which hosted draft serves a request that names none: the best measured goodput.

Goodput is tokens committed per millisecond of step time (draft + verify), the figure
speculation exists to raise: it folds a draft's acceptance and its cost into one number,
so a cheap draft that agrees less can beat a costly one that agrees more.

Per (task type, user segment) every draft is an arm of a bandit. Each arm keeps the
mean and spread of the goodput of the requests it served (recent ones weigh more, so a
change of load or traffic moves the choice). Choosing is Thompson sampling: draw each
arm's mean from a normal posterior (mean, sd/√n, sd pooled over the key's arms) and take
the largest draw. Arms with fewer than `min_trials` requests go first, the task map's
draft before the others, so selection starts where the configuration points and every
draft gets measured. Only the selector's own choices are observed (the gateway does not
feed it requests that name their draft).

Output stays exact whichever draft is chosen: rejection sampling keeps the target's
distribution for any draft (DESIGN.md §2). No gRPC here.
"""
from __future__ import annotations

import math
import random
import statistics
import threading
from dataclasses import dataclass


@dataclass
class Arm:
    """What one draft did for one (task type, user segment)."""

    pulls: int = 0  # requests sent to it (observed or still running)
    n: int = 0  # requests observed, capped at the selector's memory
    mean: float = 0.0  # goodput, tokens per ms
    m2: float = 0.0  # sum of squared deviations (Welford), over the same weight as n

    def observe(self, goodput: float, memory: int) -> None:
        """Add one request's goodput; past `memory` requests the oldest weigh out (EWMA)."""
        full = self.n >= memory
        self.n = min(self.n + 1, memory)
        delta = goodput - self.mean
        self.mean += delta / self.n
        if full:  # the oldest request's share leaves the sum as the new one's comes in
            self.m2 *= (self.n - 1) / self.n
        self.m2 += delta * (goodput - self.mean)

    def variance(self) -> float:
        return max(self.m2 / (self.n - 1), 0.0) if self.n > 1 else 0.0


def _pooled_sd(arms) -> float:
    """One request's goodput spread, pooled over the arms of a key.

    The spread comes mostly from the prompts and the machine, not from the draft, so
    pooling lets an arm measured once or twice borrow the others' estimate instead of
    trusting (or fearing) its own few samples. Before any arm has two samples: a quarter
    of the mean goodput, a wide prior that keeps exploring.
    """
    arms = list(arms)
    weight = sum(arm.n - 1 for arm in arms if arm.n > 1)
    if weight == 0:
        return max(0.25 * statistics.fmean(arm.mean for arm in arms), 1e-9)
    return max(math.sqrt(sum(arm.variance() * (arm.n - 1) for arm in arms if arm.n > 1) / weight), 1e-9)


class DraftSelector:
    """Thompson sampling over hosted drafts, per (task type, user segment); thread-safe."""

    def __init__(self, drafts: list[str], task_drafts: dict[str, str] | None = None, *,
                 min_trials: int = 1, memory: int = 200, rng: random.Random | None = None) -> None:
        """drafts: the usable drafts, the default first; task_drafts: task type → draft."""
        if not drafts:
            raise ValueError("draft selection needs at least one draft")
        self.drafts = list(drafts)
        self.task_drafts = dict(task_drafts or {})
        self.min_trials = min_trials
        self.memory = memory
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._arms: dict[tuple[str, str], dict[str, Arm]] = {}

    def start(self, task_type: str) -> str:
        """The task map's draft for a task type (the default draft when it names none)."""
        return self.task_drafts.get(task_type, self.drafts[0])

    def choose(self, task_type: str, user_segment: str) -> str:
        """The draft for the next request of this task type and segment."""
        with self._lock:
            arms = self._arms_of(task_type, user_segment)
            first = self.start(task_type)
            # Unmeasured drafts first, the task map's own before the rest, fewest pulls first.
            young = [name for name, arm in arms.items() if arm.n < self.min_trials]
            if young:
                name = min(young, key=lambda d: (arms[d].pulls, d != first, self.drafts.index(d)))
            else:
                sd = _pooled_sd(arms.values())
                name = max(arms, key=lambda d: self._rng.gauss(arms[d].mean, sd / math.sqrt(arms[d].n)))
            arms[name].pulls += 1
            return name

    def observe(self, task_type: str, user_segment: str, draft: str, tokens: int, ms: float) -> None:
        """What a request served by `draft` achieved: tokens committed over ms of step time."""
        if draft not in self.drafts or ms <= 0 or tokens <= 0:
            return
        with self._lock:
            self._arms_of(task_type, user_segment)[draft].observe(tokens / ms, self.memory)

    def snapshot(self) -> dict[tuple[str, str, str], Arm]:
        """(task type, user segment, draft) → a copy of its arm (metrics, tests)."""
        with self._lock:
            return {(task, segment, name): Arm(arm.pulls, arm.n, arm.mean, arm.m2)
                    for (task, segment), arms in self._arms.items() for name, arm in arms.items()}

    def _arms_of(self, task_type: str, user_segment: str) -> dict[str, Arm]:
        return self._arms.setdefault((task_type, user_segment), {name: Arm() for name in self.drafts})
