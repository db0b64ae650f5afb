"""AUTO's floor: a request speculates only while speculating measures faster than plain decoding.

The cost policy (`gateway.policy.gamma.CostPolicy`) chooses γ from a model: acceptance, and step
costs fitted per γ. A model misses what it does not price — a machine whose speed differs
from the one its figures came from, a sampled step's recovery hop, the draft's catch-up
after plain steps, the gateway's own work — and then it speculates at a loss without
noticing. The floor checks the outcome instead of the model: the request's own goodput
over its speculative steps (tokens committed per millisecond between commits, everything
included) against plain decoding's goodput measured on the same target at the same load.
Where speculation loses, the request decodes plainly; a short burst of speculation now and
then measures it again, so a change of traffic or acceptance is found.

- `PlainRates` (one per gateway: the target's): plain decoding's measured milliseconds per
  token at each load level, from every plain step of every request, AUTO's and OFF's.
- `FloorSchedule` (shared by the requests of one model pair, task and sampling kind): how
  many plain steps pass between bursts (doubling while bursts lose, but bounded: users of
  adaptive schedules elsewhere report a K that collapsed to 0 and never came back), and
  every request's speculative steps pooled, which say whether a new request starts shut.
- `RequestFloor` (one per AUTO request): its speculative steps' goodput, and the verdict.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.step.records import StepRecord

log = logging.getLogger(__name__)

BURST_STEPS = 8  # speculative steps a verdict is taken over (a burst's length)
# A burst that measures below CLEAR_LOSS of plain decoding over its first EARLY_STEPS ends
# there: where speculation loses badly, most of what the floor costs is its bursts.
EARLY_STEPS = 4
CLEAR_LOSS = 0.75
# An open request's goodput forgets its speculative steps over about this many. Why so many:
# a step's tokens vary (1 to γ+1): at γ = 4 and acceptance 0.4 to 0.7 (independent draws), the
# mean of 8 steps has a standard deviation of about 20% of itself.
WINDOW_STEPS = 32
FIRST_INTERVAL = 16  # plain steps before the first burst after a loss
MAX_INTERVAL = 512  # ...and at most, after bursts kept losing
POOL_DECAY = 1.0 - 1.0 / 256  # the pool of every request's speculative steps forgets over ~256
POOL_MIN_STEPS = 32  # ...and says where a new request starts once it holds this many
PRIOR_STEPS = 8  # ...and counts for this many steps of a request's own
PLAIN_SAMPLE_STEPS = 4  # plain steps a request takes to measure plain decoding where no figure is fresh
PLAIN_FRESH_S = 30.0  # a plain figure older than this no longer counts: the machine's speed drifts


@dataclass
class _Rate:
    """Milliseconds per token of plain steps at one load level (an EMA), and when last measured."""

    ms_per_token: float
    updated: float


class PlainRates:
    """Plain decoding's goodput on one target, by load level, from every plain step taken."""

    def __init__(self, weight: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.weight = weight
        self.clock = clock
        self._rates: dict[int, _Rate] = {}

    def observe(self, record: StepRecord) -> None:
        """A step of any request: a plain one past the first (which prefills) is counted."""
        if record.draft_length or record.index == 0 or record.interval_ms <= 0.0:
            return
        load = record.load
        sample = record.interval_ms / len(record.emitted)
        rate = self._rates.get(load)
        now = self.clock()
        if rate is None or now - rate.updated > PLAIN_FRESH_S:
            self._rates[load] = _Rate(sample, now)
        else:
            rate.ms_per_token += self.weight * (sample - rate.ms_per_token)
            rate.updated = now

    def ms_per_token(self, load: int) -> float | None:
        """A fresh figure at this load level; None where there is none."""
        rate = self._rates.get(load)
        if rate is None or self.clock() - rate.updated > PLAIN_FRESH_S:
            return None
        return rate.ms_per_token

    def rates(self) -> dict[int, float]:
        """Tokens per ms of plain decoding at each load measured (fresh or not): for metrics."""
        return {load: 1.0 / rate.ms_per_token for load, rate in sorted(self._rates.items()) if rate.ms_per_token > 0}


@dataclass
class FloorSchedule:
    """The floor's state shared by the requests of one model pair, task and sampling kind."""

    interval: int = FIRST_INTERVAL  # plain steps between bursts
    plain_steps: int = 0  # plain steps taken under a shut floor since the last burst
    # Every request's speculative steps, by load: [steps, tokens, ms], decayed over ~256 steps.
    pooled: dict[int, list[float]] = field(default_factory=dict)

    def pool(self, load: int, tokens: int, ms: float) -> None:
        steps_tokens_ms = self.pooled.setdefault(load, [0.0, 0.0, 0.0])
        for i, value in enumerate((1.0, tokens, ms)):
            steps_tokens_ms[i] = POOL_DECAY * steps_tokens_ms[i] + value

    def prior(self, load: int) -> tuple[float, float]:
        """(tokens, ms) of PRIOR_STEPS average pooled speculative steps at `load`; (0, 0) before any."""
        steps, tokens, ms = self.pooled.get(load, (0.0, 0.0, 0.0))
        return (PRIOR_STEPS * tokens / steps, PRIOR_STEPS * ms / steps) if steps else (0.0, 0.0)

    def pooled_speedup(self, load: int, plain_ms_per_token: float | None) -> float | None:
        """Every request's speculative steps at `load`, their goodput over plain decoding's;
        None before POOL_MIN_STEPS of them or without a plain figure.

        Where a new request starts: shut when it is below 1. Why the pool and not the last
        verdict: one request whose prompt the draft does not suit says little of the next.
        On held-out code, where AUTO gains 1.7× overall, the second request's verdict read
        0.88, and every request after it started shut."""
        steps, tokens, ms = self.pooled.get(load, (0.0, 0.0, 0.0))
        if steps < POOL_MIN_STEPS or not plain_ms_per_token or not ms:
            return None
        return tokens / ms * plain_ms_per_token

    def burst_due(self, load: int) -> bool:
        """One plain step under a shut floor, at `load` sessions; whether a burst is due now.

        The burst goes to the request that asks when it falls due. If that request ends
        before its burst is judged (bursts would otherwise fall on the last step of requests
        as long as the spacing), the next shut request takes it once the others have taken
        two bursts' worth of plain steps each."""
        self.plain_steps += 1
        if self.plain_steps < self.interval:
            return False
        self.plain_steps = max(self.interval - 2 * BURST_STEPS * load, 0)
        return True

    def steps_to_burst(self) -> int:
        return max(self.interval - self.plain_steps - 1, 0)

    def record(self, won: bool, burst: bool) -> None:
        """A verdict, a burst's or an open request's. A burst that lost doubles the spacing of
        bursts; a win resets it, since the traffic changed. Only a burst's verdict restarts
        the count of plain steps: an open request's verdicts come every 8 of its steps, and
        restarting the count at each would starve the shut requests beside it of bursts."""
        if won:
            self.interval = FIRST_INTERVAL
        elif burst:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
        if burst:
            self.plain_steps = 0


@dataclass(frozen=True)
class FloorRow:
    """One schedule as /metrics shows it (`gateway.edge.metrics`)."""

    model_pair: str
    task_type: str
    sampling: str  # "greedy" or "sampled"
    speedup: float | None  # every request's speculative steps at load 1 over plain decoding (`pooled_speedup`)
    interval: int  # plain steps between bursts


def floor_snapshot(plain: PlainRates, schedules: dict[tuple[str, str, bool], FloorSchedule]
                   ) -> tuple[dict[int, float], list[FloorRow]]:
    """Plain decoding's goodput by load, and the schedules keyed (model pair, task type, greedy)
    as rows: what /metrics shows."""
    alone = plain.ms_per_token(1)
    rows = [FloorRow(pair, task, "greedy" if greedy else "sampled", schedule.pooled_speedup(1, alone),
                     schedule.interval)
            for (pair, task, greedy), schedule in sorted(schedules.items())]
    return plain.rates(), rows


class RequestFloor:
    """One AUTO request's floor: open (γ as the cost policy chooses it) or shut (plain
    decoding, with a burst of speculation when the shared schedule says)."""

    def __init__(self, plain: PlainRates, schedule: FloorSchedule, load: int = 1) -> None:
        """load: the load bucket the request starts at (its steps report it from then on)."""
        self.plain = plain
        self.schedule = schedule
        pooled = schedule.pooled_speedup(load, plain.ms_per_token(load))
        self.shut = pooled is not None and pooled < 1.0
        self.burst = 0  # speculative steps left in a burst under a shut floor
        self.sampling_plain = 0  # plain steps left to measure plain decoding
        self.load = load
        self._tokens = 0.0  # this request's speculative steps, decayed (`WINDOW_STEPS`)
        self._ms = 0.0
        self._steps = 0  # speculative steps since the last verdict
        # The next draft step catches the draft up (the request's first step, a plain step or
        # another proposer's came before it): left out of the verdict.
        self._catching_up = True
        self._decay = 1.0 - 1.0 / WINDOW_STEPS

    def admit(self, gamma: int) -> int:
        """The γ this step may take, given the cost policy's choice."""
        if self.sampling_plain:
            self.sampling_plain -= 1
            return 0
        if not self.shut:
            return gamma
        if self.burst:
            self.burst -= 1
            return max(gamma, 1)
        if self.schedule.burst_due(self.load):
            # Its first step catches the draft up, left out of the verdict (`observe`);
            # BURST_STEPS more follow to be judged on.
            self.burst = BURST_STEPS
            self._forget()
            return max(gamma, 1)
        return 0

    def plain_steps_ahead(self) -> int | None:
        """Steps ahead that surely decode plainly under the floor; None: the cost policy says."""
        if self.sampling_plain:
            return self.sampling_plain
        if self.shut and not self.burst:
            return self.schedule.steps_to_burst()
        return None

    def observe(self, record: StepRecord) -> None:
        self.load = record.load
        if record.index == 0 or not record.draft_model_tokens or record.interval_ms <= 0.0:
            # The first step prefills; a plain step or a model-free match says nothing of the
            # draft, and leaves it behind by the tokens it committed.
            self._catching_up = True
            return
        if self._catching_up:
            # This step prefilled on the draft every token committed since it last ran: the
            # prompt, or the plain steps before it. A cost of switching to speculation, paid
            # once, not of speculating. Judged with it, a burst after a long spacing (a long
            # catch-up) would lose for it alone and keep the floor shut for good, and a
            # request with a long prompt would shut at its first verdict.
            self._catching_up = False
            return
        self._tokens = self._decay * self._tokens + len(record.emitted)
        self._ms = self._decay * self._ms + record.interval_ms
        self.schedule.pool(self.load, len(record.emitted), record.interval_ms)
        self._steps += 1
        in_burst = self.shut and self.burst > 0
        if self._steps < (EARLY_STEPS if in_burst else BURST_STEPS):
            return
        plain = self.plain.ms_per_token(self.load)
        if plain is None:  # nothing to compare with: measure plain decoding for a few steps
            self.sampling_plain = PLAIN_SAMPLE_STEPS
            self._steps = BURST_STEPS - 1  # ...then judge at the next speculative step
            return
        # The request's own steps, with the pool's (every request's) weighed in as PRIOR_STEPS
        # more. Judged on its own 8 steps alone (WINDOW_STEPS: why they waver), a request that
        # truly gains 10% reads below 1 in a third or more of its verdicts (33% to 44% at γ = 4,
        # acceptance 0.4 to 0.7, independent draws).
        prior_tokens, prior_ms = self.schedule.prior(self.load)
        speedup = (self._tokens + prior_tokens) / (self._ms + prior_ms) * plain
        if in_burst and speedup >= CLEAR_LOSS:
            return  # not clearly lost: the burst runs out
        log.debug("floor verdict at load %d: %.2f (own %.1f tokens in %.0f ms, pool's %.1f in %.0f ms, plain "
                  "%.2f ms a token) %s", self.load, speedup, self._tokens, self._ms, prior_tokens, prior_ms, plain,
                  "in a burst" if self.shut else "open")
        self.schedule.record(won=speedup >= 1.0, burst=self.shut)
        self.burst = 0
        self.shut = speedup < 1.0
        self._steps = 0
        if self.shut:
            self._forget()

    def _forget(self) -> None:
        """A burst is judged on its own steps."""
        self._tokens = self._ms = 0.0
        self._steps = 0
