"""Which hosted draft serves a request that names none: the best expected goodput.

Goodput is tokens committed per millisecond of step time, the figure speculation exists
to raise. It is acceptance and cost together, and the two are measured apart here
because they are measured with very different noise:

- a draft's acceptance on a (task type, user segment) varies from prompt to prompt, but
  every request measures it over dozens of draft tokens;
- its costs (draft hop per token, verify hop per γ, at the present load) are the pair's
  `StepCosts`, learned from every step the gateway runs.

A request's own goodput mixes in how hard its prompt is and how busy the machine was.
Measured per request on the demo code prompts (AUTO, 64 tokens), the distilled draft's
goodput was 0.135 ± 0.036 tokens/ms and an unrelated draft's 0.102: 0.9 sd apart, so a
bandit over raw goodput kept trying the unrelated draft (19% of requests; 93% of the best
fixed assignment over 128 requests). Their α was 0.72 ± 0.15 against 0.003: 4.9 sd
apart, so one request rules the unrelated draft out.

Per (task type, user segment) every draft is an arm. An arm keeps the mean and spread of
the conditional acceptance α of the requests it served (recent ones weigh more, so a
change of traffic moves the choice). Choosing is Thompson sampling: draw each arm's α
from a normal posterior (sd pooled over the key's arms), turn the draw into the speedup
the cost model predicts for that draft at its best γ (`predicted_speedup`; γ = 0, plain
decoding, is one of the choices, so a useless draft is worth 1), and take the largest.
The posterior's mean starts from what the same draft did on the other keys, worth
PRIOR_REQUESTS of this key's requests: a draft that agrees well on one task or segment
tends to on the others, so a new segment does not pay again to learn that a draft is
useless, and its own requests soon outweigh the prior. A new key's first request goes to
the task map's draft; drafts measured nowhere yet are tried next. Only the selector's own
choices are observed (the gateway does not feed it requests that name their draft).

Output stays exact whichever draft is chosen: rejection sampling keeps the target's
distribution for any draft (docs/design.md §3). No gRPC here.
"""
from __future__ import annotations

import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

from gateway.stats.costmodel import StepCosts, predicted_speedup

# A draft measured nowhere yet is drawn from this prior; its sd is also one request's α
# spread before any arm has two requests.
PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE_SD = 0.5, 0.2
# What a draft did on the other (task type, user segment) keys counts as this many of this
# key's requests: a draft that agrees well on one task tends to on the others, so a new key
# starts from that, and its own requests outweigh it after a few.
PRIOR_REQUESTS = 2


@dataclass
class Arm:
    """What one draft did for one (task type, user segment)."""

    pulls: int = 0  # requests sent to it (observed or still running)
    n: int = 0  # requests observed, capped at the selector's memory
    alpha: float = 0.0  # mean α (accepted ÷ positions reached) of a request
    m2: float = 0.0  # sum of squared deviations of α (Welford), over the same weight as n
    goodput: float = 0.0  # mean tokens per ms of a request (reported, not chosen by)

    def observe(self, alpha: float, goodput: float, memory: int) -> None:
        """Add one request; past `memory` requests the oldest weigh out (EWMA)."""
        full = self.n >= memory
        self.n = min(self.n + 1, memory)
        delta = alpha - self.alpha
        self.alpha += delta / self.n
        if full:  # the oldest request's share leaves the sum as the new one's comes in
            self.m2 *= (self.n - 1) / self.n
        self.m2 += delta * (alpha - self.alpha)
        self.goodput += (goodput - self.goodput) / self.n

    def variance(self) -> float:
        return max(self.m2 / (self.n - 1), 0.0) if self.n > 1 else 0.0


def _pooled_sd(arms) -> float:
    """One request's α spread, pooled over the arms of a key.

    The spread comes mostly from the prompts, not from the draft, so pooling lets an arm
    measured once or twice borrow the others' estimate instead of trusting (or fearing)
    its own few samples. Before any arm has two samples: PRIOR_ACCEPTANCE_SD, wide enough
    to keep exploring.
    """
    arms = list(arms)
    weight = sum(arm.n - 1 for arm in arms if arm.n > 1)
    if weight == 0:
        return PRIOR_ACCEPTANCE_SD
    return max(math.sqrt(sum(arm.variance() * (arm.n - 1) for arm in arms if arm.n > 1) / weight), 1e-3)


class DraftSelector:
    """Thompson sampling over hosted drafts, per (task type, user segment); thread-safe."""

    def __init__(self, drafts: list[str], task_drafts: dict[str, str] | None = None, *,
                 speedup: Callable[[str, float], float] | None = None,
                 min_trials: int = 1, memory: int = 200, rng: random.Random | None = None) -> None:
        """drafts: the usable drafts, the default first; task_drafts: task type → draft;
        speedup(draft, α): what the cost model predicts the draft is worth at acceptance α
        (`gateway.stats.paircosts.PairCosts.predicted_speedup`, which reads the pair's costs under
        its lock; None: every draft costs the prior, γ ≤ 8)."""
        if not drafts:
            raise ValueError("draft selection needs at least one draft")
        self.drafts = list(drafts)
        self.task_drafts = dict(task_drafts or {})
        self.min_trials = min_trials
        self.memory = memory
        self._speedup = speedup or (lambda _draft, alpha: predicted_speedup(alpha, StepCosts(), 8))
        self._rng = rng or random.Random()
        self._lock = threading.Lock()
        self._arms: dict[tuple[str, str], dict[str, Arm]] = {}

    def start(self, task_type: str) -> str:
        """The task map's draft for a task type (the default draft when it names none)."""
        return self.task_drafts.get(task_type, self.drafts[0])

    def choose(self, task_type: str, user_segment: str) -> str:
        """The draft for the next request of this task type and segment."""
        with self._lock:
            key = (task_type, user_segment)
            arms = self._arms_of(*key)
            priors = {draft: self._prior(draft, key) for draft in self.drafts}
            first = self.start(task_type)
            # A new key starts with the task map's draft. Drafts measured nowhere are tried
            # next; by requests sent, not observed: with several in flight the others keep
            # a measured draft busy.
            young = [name for name, arm in arms.items()
                     if arm.pulls < self.min_trials and (name == first or priors[name][1] == 0)]
            if young:
                name = min(young, key=lambda d: (d != first, self.drafts.index(d)))
            else:
                sd = _pooled_sd(arms.values())
                name = max(arms, key=lambda d: self._draw(d, arms[d], priors[d], sd))
            arms[name].pulls += 1
            return name

    def _prior(self, draft: str, key: tuple[str, str]) -> tuple[float, float]:
        """(mean α, weight in requests) of a draft on the other keys; weight 0: none measured."""
        others = [arms[draft] for other, arms in self._arms.items() if other != key and arms[draft].n]
        seen = sum(arm.n for arm in others)
        if not seen:
            return PRIOR_ACCEPTANCE, 0
        return sum(arm.alpha * arm.n for arm in others) / seen, min(PRIOR_REQUESTS, seen)

    def _draw(self, draft: str, arm: Arm, prior: tuple[float, float], sd: float) -> float:
        """One posterior draw of what this draft is worth: the speedup its pair's costs
        predict at an α drawn around its measured acceptance, shrunk toward its prior."""
        prior_alpha, prior_weight = prior
        weight = arm.n + prior_weight
        if weight == 0:  # measured nowhere yet (sent but not back, or its request failed)
            alpha = self._rng.gauss(PRIOR_ACCEPTANCE, PRIOR_ACCEPTANCE_SD)
        else:
            mean = (arm.alpha * arm.n + prior_alpha * prior_weight) / weight
            alpha = self._rng.gauss(mean, sd / math.sqrt(weight))
        return self._speedup(draft, min(max(alpha, 0.0), 0.999))

    def observe(self, task_type: str, user_segment: str, draft: str, alpha: float, tokens: int,
                ms: float) -> None:
        """What a request served by `draft` achieved: its conditional acceptance α (0 when
        it proposed nothing: its policy found speculating with this draft not worth a step),
        and tokens committed over ms of step time."""
        if draft not in self.drafts:
            return
        with self._lock:
            goodput = tokens / ms if ms > 0 else 0.0
            self._arms_of(task_type, user_segment)[draft].observe(alpha, goodput, self.memory)

    def snapshot(self) -> dict[tuple[str, str, str], Arm]:
        """(task type, user segment, draft) → a copy of its arm (metrics, tests)."""
        with self._lock:
            return {(task, segment, name): Arm(arm.pulls, arm.n, arm.alpha, arm.m2, arm.goodput)
                    for (task, segment), arms in self._arms.items() for name, arm in arms.items()}

    def _arms_of(self, task_type: str, user_segment: str) -> dict[str, Arm]:
        return self._arms.setdefault((task_type, user_segment), {name: Arm() for name in self.drafts})
