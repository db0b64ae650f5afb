"""AUTO's load cap: the largest γ any AUTO request of one model pair may propose at each
load level, shared by the pair's requests and moved by trials (`LoadCap`; why and how:
docs/loadcap.md). It starts where the workers' measured costs say (`gateway.policy.priors`), or
where other gateways of the target have got to (`SharedLevel`, `gateway.workers.loadshare`).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.policy.priors import best_caps
from gateway.stats.acceptance import DecayedAcceptance
from gateway.stats.costmodel import load_bucket
from gateway.step.records import StepRecord

log = logging.getLogger(__name__)

MAX_EXPLORE_INTERVAL = 64  # epochs between the load cap's trials, at most
# ...and under a cap of 0 (about two minutes at 8 in flight on SmolLM2 here). Why longer: a
# trial of drafting after a stretch of plain decoding costs every session a catch-up prefill
# on the draft, which on a CPU the verifier shares slows everyone. At 64, such trials every
# half minute kept AUTO at 0.96× plain decoding over three rounds at a cap of 0; at 256,
# 0.99×. What trials are for, noticing that acceptance moved, the pair's acceptance now says
# directly (`_reprice`), and brings the next trial forward.
MAX_PLAIN_EXPLORE_INTERVAL = 256
TRIAL_TURNS = 8  # turns of a load-cap trial, half its own and half the cap in force's
# What a lost trial's switches cost, beyond the cap in force's goodput, is at most this
# share of the level's time until the next (`_LevelArms.trial_cost`). Why: on SmolLM2 at 8
# in flight here a switch to a cap of 1 after plain decoding costs all eight sessions about
# 0.3 s, each draft catching up on its context, and a fresh level's first trials, 8 and 16
# epochs apart (2 to 5 s), took 3.7% of AUTO's time there, every one of them lost.
TRIAL_BUDGET = 0.01
TRIAL_EXTENSIONS = 2  # times a trial runs four more turns while a cap lacks quiet steps (`_Goodput`)
# The trials between two caps at a level are weighed together (`_Verdicts`): their mean for
# the first few, then an average in which each new trial weighs this much.
VERDICT_WEIGHT = 0.25
VERDICT_CLIP = math.log(2.0)  # one trial says at most "twice as fast"
PRIOR_TRIALS = 2  # the trials' worth of evidence a prior's predicted goodput ratios count for
# The prior is priced again at the pair's measured acceptance (`LoadCap.observe`) once this
# many draft tokens' worth of evidence is in, and again whenever it moves this far.
REPRICE_TRIALS = 64
REPRICE_SHIFT = 0.05
ACCEPTANCE_DECAY = 1.0 - 1.0 / 256  # the pair's acceptance forgets over about this many draft steps

Pricing = Callable[[float], dict[int, list[float]]]  # acceptance -> load bucket -> goodput of each γ from 0


@dataclass
class _Goodput:
    """The emitted tokens and step milliseconds of one cap's steps over an epoch, a turn or
    a trial, with those of "quiet" steps kept apart: steps taken a round or more after the
    last prompt of the pair's requests on this gateway was prefilled (`LoadCap.observe`).
    Prompts it cannot see (another gateway's, another draft's on the same target) stay
    in the quiet steps as noise.

    Why apart: a prompt's prefill chunks ride in the target's forwards and slow every step
    in them several times over, and prompts arrive whatever the cap. Over the few rounds of
    a trial's turn, one prefill landing in one cap's turns and not the other's decides the
    trial: on the demo pair at 8 in flight, plain decoding lost its first trial to
    speculating at 0.019 against 0.029 tokens per ms, while its turns without a prompt in
    their forwards ran at 0.033 against speculating's 0.029 (docs/decisions.md, "Trials
    compared on their quiet steps"). So caps are
    compared on their quiet steps where both have enough of them, and on all their steps
    where prompts keep arriving; each cap's goodput is kept on both footings, so that a
    comparison never sets one against the other.
    """

    tokens: float = 0.0
    ms: float = 0.0
    steps: int = 0
    quiet_tokens: float = 0.0
    quiet_ms: float = 0.0
    quiet_steps: int = 0

    def add(self, tokens: int, ms: float, quiet: bool) -> None:
        self.tokens += tokens
        self.ms += ms
        self.steps += 1
        if quiet:
            self.quiet_tokens += tokens
            self.quiet_ms += ms
            self.quiet_steps += 1

    def merge(self, other: _Goodput) -> None:
        for name in ("tokens", "ms", "steps", "quiet_tokens", "quiet_ms", "quiet_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def rate(self, quiet: bool) -> float:
        """Tokens per ms per session, over the quiet steps or over all."""
        tokens, ms = (self.quiet_tokens, self.quiet_ms) if quiet else (self.tokens, self.ms)
        return tokens / ms if ms > 0 else 0.0


def _quiet_enough(tallies: list[_Goodput], load: int) -> bool:
    """Whether every tally has a round's worth of quiet steps to be compared on."""
    return all(tally.quiet_steps >= max(8, load) for tally in tallies)


@dataclass
class _Verdicts:
    """What the trials between two caps at one level said, together: the mean log ratio of
    the higher cap's goodput to the lower's over their trials (each clipped to ±`VERDICT_CLIP`),
    an average that weighs each new trial `VERDICT_WEIGHT` once there have been enough.

    Why together: on the demo pair at 8 in flight, one trial's log ratio between plain
    decoding and a cap of 1 varied with a standard deviation of 0.28 around a mean gap of
    0.10 (docs/decisions.md, "The trials between two caps weighed together"). Decided trial
    by trial, a cap of 1 won a
    third of its trials and plain decoding won it back, and the level spent a third of its
    steps speculating. Weighed together the flapping fades as trials accumulate, while
    a gap as wide as the first trial usually shows (plain decoding against 16: 0.46)
    decides at once. The clip keeps one trial spoiled by a burst of prompts from deciding
    the next few."""

    mean: float = 0.0
    trials: int = 0

    def add(self, log_ratio: float) -> float:
        self.trials += 1
        clipped = min(max(log_ratio, -VERDICT_CLIP), VERDICT_CLIP)
        self.mean += max(1.0 / self.trials, VERDICT_WEIGHT) * (clipped - self.mean)
        return self.mean


@dataclass(frozen=True)
class SharedLevel:
    """One load level as gateways share it through the verifier (`gateway.workers.loadshare`): the
    cap in force and its verdicts, (lower cap, higher cap) → (mean log ratio, trials)."""

    cap: int
    verdicts: dict[tuple[int, int], tuple[float, int]]

    def evidence(self) -> int:
        return sum(trials for _, trials in self.verdicts.values())


@dataclass
class _LevelArms:
    """The caps tried at one load level, and the one in force."""

    best: int
    trial: int | None = None  # a cap on trial against best, in turns (`turns`)
    turns: list[int] = field(default_factory=list)  # the trial's turns still to run: which cap each is for
    window: dict[int, _Goodput] = field(default_factory=dict)  # cap -> its steps over the trial's turns
    # cap -> tokens per ms per session over all its steps: a trial's from its turns; the cap
    # in force's from the last trial's turns, with its epochs since averaged in
    all_rates: dict[int, float] = field(default_factory=dict)
    rates: dict[int, float] = field(default_factory=dict)  # the same over quiet steps, where enough were seen
    running: _Goodput = field(default_factory=_Goodput)  # the running epoch's (or turn's) steps
    settle: int = 0  # steps still to leave out after the cap changed
    epochs: int = 0  # since the last scheduled trial
    since_trial: int = 0  # epochs since any trial ended
    rival_after: int = 1  # epochs a rival waits after a trial; doubles each time a rival loses
    explore_every: int = 8  # epochs between trials; doubles after each trial that lost
    downward: bool = True  # which neighbour the next trial takes
    plain_next: bool = False  # the next trial re-measures plain decoding (cap 0), not a neighbour
    remeasure: bool = False  # the trial on now measures again a cap measured before (plain decoding, or a
    # rival): it is no neighbour, so losing it turns no direction
    rival: bool = False  # the trial on now is a rival's (`LoadCap._rival`)
    outvoted: set[int] = field(default_factory=set)  # higher caps whose last trial's turns won by the margin,
    # its verdict lost
    extended: int = 0  # times the trial on now ran four more turns for want of quiet steps
    switching: _Goodput = field(default_factory=_Goodput)  # the trial's steps left out after a switch to it
    # What the last lost trial's switches to it cost beyond the cap in force's goodput
    # (session-ms: the sum of each session's step intervals; `_charge`), and the session-ms of
    # the cap in force's steps since it ended: the next trial waits until the cost is at most
    # `TRIAL_BUDGET` of them (`_affordable`).
    trial_cost: float = 0.0
    since_ms: float = 0.0
    verdicts: dict[tuple[int, int], _Verdicts] = field(default_factory=dict)  # (lower cap, higher) -> trials'
    drafted: int = 0  # the longest model draft proposed in the running epoch
    used: int | None = None  # ...and in the last full epoch of the cap in force (None: not yet measured)
    source: str = "prior"  # where the cap started: "prior", "shared" (other gateways', `SharedLevel`)
    decided: int = 0  # trials decided here since it started or took a shared level

    def evidence(self) -> int:
        """The trials behind the level's verdicts, a prior's and a shared level's included."""
        return sum(verdict.trials for verdict in self.verdicts.values())

    @property
    def arm(self) -> int:
        return self.turns[0] if self.turns else self.best

    def comparable(self) -> dict[int, float]:
        """Each cap's goodput on one footing for all: quiet steps where the cap in force has
        a quiet figure (caps without one left out), else all steps."""
        return self.rates if self.best in self.rates else self.all_rates


class InFlight:
    """One request of a pair in flight, as the pair's `LoadCap` counts it (`LoadCap.enter`).
    An observer of the request's steps, whatever its policy: its first step ends its
    prompt's prefill."""

    def __init__(self, cap: LoadCap) -> None:
        self._cap = cap
        self._prefilling = True

    def observe(self, record: StepRecord) -> None:
        self._end_prefill()

    def leave(self) -> None:
        """The request ended, after its first step or before it."""
        self._end_prefill()
        self._cap._request_left()

    def _end_prefill(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self._cap._prompt_prefilled()


class LoadCap:
    """The largest γ any AUTO request of one model pair may propose at each load level.

    Why a shared cap: a request choosing γ alone sees what its step costs it, not what its
    draft tokens cost the other sessions in the target's batched forward. When every
    session speculates, every forward carries γ+1 tokens per session; on hardware where
    the forward's time grows with its tokens, decoding plainly can then serve more tokens
    per second than speculating, although each request alone would still gain by it. The
    cap is decided for everyone at once, like vLLM's K*(bs) = argmax_K (1 + Σ_{i<K} a_i) /
    ITL(bs, K), but measured online rather than profiled: at each load level (the sessions
    the verifier holds, bucketed by `load_bucket`) the cap in force runs for an epoch of
    steps, and its goodput (emitted tokens per millisecond between a request's commits, i.e.
    per session) is compared first with plain decoding's (cap 0), then, in turn, with a
    neighbouring cap's and plain decoding's again, one trial in every `explore_every`
    epochs (twice as long after each trial that lost, since a trial costs goodput); a
    trial that wins by `margin`, weighed with the earlier trials of the same two caps
    (`_Verdicts`), becomes the cap and the next cap along is tried at once. A lower cap
    measured earlier that beats the average of the cap in force by `margin` (or a higher one
    that the older verdicts outvoted, `_rival`) is tried again soon, after one epoch, twice
    as long each time such a trial loses. Neighbours are taken beside the longest γ the
    requests chose under the cap in force, which is what the cap lets through.

    A trial is not one epoch against the cap in force's average: it takes turns with the
    cap in force, a round of steps each, in the order best, trial, trial, best, twice
    (`TRIAL_TURNS`), and compares the two over the same stretch of time. Why: a machine's
    speed drifts over seconds. On the demo pair at 8 in flight, goodput over 32 steps
    swung by 11% (coefficient of variation), and two epochs in a row moved together
    (correlation 0.66); the difference of two neighbouring rounds varies about half as
    much as two epochs taken apart. The order cancels a steady drift as well. The two are
    compared on their quiet steps, those taken a round or more after the last prompt was
    prefilled (`_Goodput`); a trial whose caps lack them runs more turns
    (`TRIAL_EXTENSIONS`), and is decided on all its steps if they still lack them.
    With one session there is no one else to slow down: no cap.

    Where a level starts: the γ the prior favours (`price`: acceptance → load bucket → the
    goodput of each γ from 0 as the workers' measured forward costs predict it,
    `gateway.policy.priors`), so a fresh gateway does not learn by losing; the predicted
    ratio of every two caps is weighed in as `PRIOR_TRIALS` trials of them (`_Verdicts`), so
    a noisy trial or two does not overturn it. The prior is priced first at `alpha`, a
    task's prior acceptance, and again at the pair's own as soon as its steps measure it
    (`_reprice`). Why: priced at 0.7, SmolLM2's distilled draft (α ≈ 0.33) started at γ = 5
    at 8 in flight, where its trials then took about 40 s of losing to bring it to plain
    decoding, and AUTO ran at 0.85× of plain decoding over a 16-request run. Without a
    prior: a measured neighbouring level's cap, else the longest draft a request chose alone.
    Where other gateways of the target have learned more (`shared`, kept by the verifier:
    `gateway.workers.loadshare`), a level starts from their cap and verdicts instead, so a
    new replica does not pay their trials again.
    """

    def __init__(self, max_draft_length: int, epoch_rounds: int = 3, explore_every: int = 8, weight: float = 0.5,
                 margin: float = 0.05, price: Pricing | None = None, alpha: float = 0.7,
                 shared: dict[int, SharedLevel] | None = None) -> None:
        self.max_draft_length = max_draft_length
        self.price = price
        self.priced_alpha = alpha  # the acceptance the prior is priced at
        # The pair's acceptance over its recent steps at every load, those taken alone
        # included: the load changes neither what the draft proposes nor what the target accepts.
        self._acceptance = DecayedAcceptance(ACCEPTANCE_DECAY)
        self.prior = price(alpha) if price else None
        # What the other gateways of the target learned, by load (`adopt`): where a level
        # starts when it holds more evidence than the prior.
        self.shared = dict(shared or {})
        self.prior_caps = best_caps(self.prior) if self.prior else {}
        self.margin = margin  # how much better than the cap in force a trial must do to replace it
        self.epoch_rounds = epoch_rounds  # an epoch: about this many steps of every session
        self.explore_every = explore_every
        self.weight = weight
        self.load = 1  # the load bucket the last step reported
        self.requests = 0  # this gateway's requests of the pair in flight (`enter`/`leave`)
        self.widest = 0  # the longest draft proposed alone: where a new level's cap starts
        self._levels: dict[int, _LevelArms] = {}
        self._observed = 1  # the load the last step counted at
        self._prefilling = 0  # requests in flight that have not had their first step
        self._since_prompt = 0  # steps observed since a prompt was last prefilling
        self._switch_ms: dict[int, float] = {}  # by load: every lost trial's switches' cost (`_charge`), summed

    def enter(self) -> InFlight:
        """A request of the pair starts (any mode or policy: its prompt rides in the target's
        forwards all the same); observe its steps with what this returns, and call its
        `leave` when it ends. Until its own steps report the load, the requests in flight
        here are a floor on it: a wave of new requests arriving after a quiet spell must not
        each speculate its first step as if alone."""
        self.requests += 1
        self._prefilling += 1
        return InFlight(self)

    def _prompt_prefilled(self) -> None:
        self._prefilling -= 1

    def _request_left(self) -> None:
        self.requests -= 1

    def _current_load(self) -> int:
        """The load bucket now: the last step's report, floored by the requests in flight here."""
        return max(self.load, load_bucket(max(self.requests, 1)))

    def cap(self) -> int:
        """The cap in force at the current load (the largest γ with a single session)."""
        load = self._current_load()
        if load <= 1:
            return self.max_draft_length
        return self._level(load).arm

    def caps(self) -> dict[int, int]:
        """The cap in force at each load bucket measured (what `cap()` gives there between
        trials), and where a level not reached yet will start from other gateways' cap.
        Copies: the metrics thread reads them while the event loop writes."""
        caps = {load: min(level.cap, self.max_draft_length) for load, level in self.shared.items()}
        caps.update({load: level.best for load, level in self._levels.items()
                     if level.all_rates or level.source == "shared"})
        return dict(sorted(caps.items()))

    def switch_ms(self) -> dict[int, float]:
        """What lost trials' switches cost at each load bucket, summed (session-ms; `_charge`). A
        copy, as `caps`."""
        return dict(sorted(self._switch_ms.items()))

    def rates(self) -> dict[int, dict[int, float]]:
        """Measured goodput (tokens per ms per session) of each cap tried, by load bucket, on
        the footing the level compares them on (`_LevelArms.comparable`)."""
        return {load: dict(level.comparable()) for load, level in sorted(self._levels.items())}

    def _level(self, load: int) -> _LevelArms:
        level = self._levels.get(load)
        if level is None:
            level = self._levels[load] = _LevelArms(self._borrowed(load), settle=load,
                                                    explore_every=self.explore_every)
            if self.prior:
                self._weigh_prior(level, load)
            else:
                level.source = "learned"  # no prior: borrowed from a measured level, or the widest draft
            shared = self.shared.get(load)
            if shared is not None and shared.evidence() > level.evidence():
                self._take(level, shared, load)
        elif not level.all_rates and not level.turns and level.source != "shared":
            # Not measured yet: follow the levels that are, until an epoch of its own is
            # averaged in (a shared level was measured, on other gateways). Why: a level
            # reached only as the load drains (the last requests of a wave) may never gather
            # an epoch, and would keep for good the cap it started at.
            borrowed = self._borrowed(load)
            if borrowed != level.best:
                level.best, level.running, level.drafted, level.settle = borrowed, _Goodput(), 0, load
        return level

    def _weigh_prior(self, level: _LevelArms, load: int) -> None:
        """Weigh the prior's predicted goodput ratios into a level that starts at its cap."""
        assert self.prior
        rates = self.prior.get(load, self.prior[max(self.prior)])[:self.max_draft_length + 1]
        for low in range(len(rates)):
            for high in range(low + 1, len(rates)):
                level.verdicts[(low, high)] = _Verdicts(
                    min(max(math.log(rates[high] / rates[low]), -VERDICT_CLIP), VERDICT_CLIP), PRIOR_TRIALS)
        # A trial costs goodput: where the costs say both neighbours lose clearly, try
        # them four times as rarely (as if three trials had lost already).
        best = level.best
        neighbours = [rates[g] for g in (best - 1, best + 1) if 0 <= g < len(rates)]
        clear = all(math.log(rate / rates[best]) < -math.log1p(2 * self.margin) for rate in neighbours)
        level.explore_every = min(4 * self.explore_every, MAX_EXPLORE_INTERVAL) if clear else self.explore_every

    def _reprice(self, alpha: float) -> None:
        """Price the prior again at the pair's measured acceptance, and start over from it
        every level still on the prior alone (no trial decided there, nothing taken from
        other gateways). What trials decided is evidence of its own and stays, but its
        levels try a neighbour again soon."""
        assert self.price is not None
        self.priced_alpha = alpha
        self.prior = self.price(alpha)
        self.prior_caps = best_caps(self.prior)
        log.info("load cap priced again at the pair's acceptance %.2f: it starts at %s (load → γ)",
                 alpha, {load: min(cap, self.max_draft_length) for load, cap in self.prior_caps.items()})
        for load, level in self._levels.items():
            if level.source != "prior" or level.decided:
                # What trials decided here stays, but it was measured at another acceptance:
                # the next trial comes as soon as it would after a win, whatever the last cost.
                level.explore_every, level.rival_after, level.trial_cost = min(level.explore_every,
                                                                               self.explore_every), 1, 0.0
                continue
            level.verdicts.clear()
            cap = self._prior_cap(load)
            if cap != level.best:  # what ran under the old cap, a trial on now included, is left behind
                self._leave(level, load)
                level.all_rates.clear()
                level.rates.clear()
                level.best, level.used, level.epochs, level.since_trial = cap, None, 0, 0
            level.trial_cost = 0.0  # a trial cut short by the new price charged its switches to the old one
            self._weigh_prior(level, load)

    def origin(self) -> str:
        """Where the cap at the current load came from: "alone" (one session: no cap),
        "prior", "shared" or "learned" (`origins`)."""
        load = self._current_load()
        if load <= 1:
            return "alone"
        self._level(load)
        return self.origins()[load]

    def origins(self) -> dict[int, str]:
        """How each load level's cap in force came to be: "prior" (from the measured costs),
        "shared" (other gateways' trials, `adopt`), or "learned" (a trial here decided it or
        is running, or, without a prior, it was borrowed)."""
        origins = {load: "shared" for load in self.shared}
        origins.update({load: "learned" if level.decided or level.trial is not None else level.source
                        for load, level in self._levels.items()})
        return dict(sorted(origins.items()))

    def adopt(self, shared: dict[int, SharedLevel]) -> None:
        """What the other gateways of the target learned (the verifier's table): each level
        takes it where it holds more evidence than the level here, between trials. Levels
        not reached yet start from it."""
        self.shared = dict(shared)
        for load, level in self._levels.items():
            entry = shared.get(load)
            if entry is not None and level.trial is None and entry.evidence() > level.evidence():
                self._take(level, entry, load)

    def _take(self, level: _LevelArms, shared: SharedLevel, load: int) -> None:
        """Start `level` over from a shared level: its cap and the verdicts behind it."""
        cap = min(shared.cap, self.max_draft_length)
        level.verdicts = {pair: _Verdicts(mean, trials) for pair, (mean, trials) in shared.verdicts.items()
                          if pair[1] <= self.max_draft_length}
        level.source, level.decided = "shared", 0
        level.outvoted.clear()  # outvoted by verdicts this level no longer holds
        if cap != level.best:
            level.best, level.used, level.drafted, level.running = cap, None, 0, _Goodput()
            level.settle = load  # the steps in flight were chosen under the old cap

    def learned(self) -> dict[int, SharedLevel]:
        """The levels worth sharing: those trials moved beyond the prior (here, or on another
        gateway before it was taken here)."""
        return {load: SharedLevel(level.best, {pair: (v.mean, v.trials) for pair, v in level.verdicts.items()})
                for load, level in sorted(self._levels.items()) if level.decided or level.source == "shared"}

    def _prior_cap(self, load: int) -> int:
        """The prior's cap at `load` (past the loads it priced, the heaviest's)."""
        return min(self.prior_caps.get(load, self.prior_caps[max(self.prior_caps)]), self.max_draft_length)

    def _borrowed(self, load: int) -> int:
        """The cap an unmeasured level at `load` takes: the prior's for that load (past the
        loads it priced, the heaviest's), if there is one; else the nearest measured lower
        level's (load only makes a long draft dearer, so it is an upper bound here), else the
        nearest measured higher level's (the cap best at a heavier load, which a level's own
        trials may then raise), else the longest draft a request chose alone."""
        if self.prior_caps:
            return self._prior_cap(load)
        measured = [bucket for bucket, level in self._levels.items() if level.all_rates]
        lower = [bucket for bucket in measured if bucket < load]
        higher = [bucket for bucket in measured if bucket > load]
        if lower:
            return self._levels[max(lower)].best
        if higher:
            return self._levels[min(higher)].best
        return min(self.widest or self.max_draft_length, self.max_draft_length)

    def observe(self, cap: int, record: StepRecord) -> None:
        """A step taken under `cap`; steps from a cap no longer in force are left out. The step
        counts at the load `cap` reads, so its goodput is credited to the level that chose it."""
        self.load = record.load
        if record.draft_model_tokens and self.price is not None:
            self._acceptance.observe(record.accepted, rejected=not record.bonus)
            if (self._acceptance.trials >= REPRICE_TRIALS
                    and abs(self._acceptance.alpha - self.priced_alpha) >= REPRICE_SHIFT):
                self._reprice(self._acceptance.alpha)
        load = self._current_load()
        # Quiet: a round of steps since a prompt last rode in the forwards (`_Goodput`). The
        # other sessions' steps that shared a prompt's last forward come back around its
        # first, which ends its prefill (`InFlight`, which observes after the policy).
        self._since_prompt = 0 if self._prefilling > 0 or record.index == 0 else self._since_prompt + 1
        quiet = self._since_prompt >= load
        if load != self._observed:
            left = self._levels.get(self._observed)
            if left is not None:
                self._leave(left, self._observed)
            self._observed = load
        if load <= 1:
            self.widest = max(self.widest, record.draft_model_tokens)
            return
        level = self._level(load)
        if cap != level.arm or record.index == 0:  # the first step also prefills the prompt
            return
        if level.settle > 0:  # it shared forwards with steps chosen under the previous cap
            level.settle -= 1
            if level.trial is not None and cap == level.trial:  # a switch to the trial: what it costs
                level.switching.add(len(record.emitted), record.interval_ms, quiet)
            return
        if not level.turns:
            level.since_ms += record.interval_ms
        level.drafted = max(level.drafted, record.draft_model_tokens)
        # The whole interval between the request's commits, not just its hops: under load the
        # gateway's own work and the hand-offs are part of what a step costs a session.
        level.running.add(len(record.emitted), record.interval_ms, quiet)
        if level.turns:
            if level.running.steps >= max(8, load):  # about a round: each session's step once
                self._end_turn(level, load)
        elif level.running.steps >= max(32, self.epoch_rounds * load):
            self._end_epoch(level, load)

    def _leave(self, level: _LevelArms, load: int) -> None:
        """The load moved to another level: drop this one's running epoch and any trial on it.
        Why: when the load comes back, maybe much later on a machine running at another
        speed, a trial resumed there would weigh turns of two different stretches. A trial
        dropped still cost what its switches did."""
        if level.trial is not None:
            self._charge(level, load, level.all_rates.get(level.best, 0.0))
        level.trial, level.turns, level.window, level.remeasure, level.rival = None, [], {}, False, False
        level.running, level.drafted = _Goodput(), 0
        level.settle = load  # on return, the steps in flight were chosen at another load

    def _end_epoch(self, level: _LevelArms, load: int) -> None:
        """An epoch of the cap in force ended: average it in, and maybe start a trial."""
        self._average_in(level.all_rates, level.best, level.running.rate(quiet=False))
        if _quiet_enough([level.running], load):
            self._average_in(level.rates, level.best, level.running.rate(quiet=True))
        level.used = level.drafted
        level.running, level.drafted = _Goodput(), 0
        level.since_trial += 1
        if len(level.all_rates) == 1 and level.best > 0:
            # First: does speculating pay at all at this load?
            self._start_trial(level, load, 0, remeasure=True, reason="the first at this load")
        elif not self._affordable(level):
            level.epochs += 1  # the next scheduled trial is due as soon as it is affordable
        elif level.since_trial >= level.rival_after and (rival := self._rival(level)) is not None:
            # A cap measured before now does clearly better than the one in force, whose
            # average has fallen since: measure it again soon rather than wait for its turn.
            # A machine slowing down for every cap alike can look the same to a lower cap, so a
            # rival that loses waits twice as long for its next chance.
            self._start_trial(level, load, rival, remeasure=True, reason="a rival: it measured faster than the "
                              "average of the cap in force")
            level.rival = True
        else:
            level.epochs += 1
            if level.epochs >= level.explore_every:
                level.epochs = 0
                # Every other trial measures plain decoding again: one early trial of it
                # (often while the first prompts are still prefilling) must not decide for good.
                remeasure = level.plain_next and level.best > 0
                self._start_trial(level, load, 0 if remeasure else self._neighbour(level), remeasure,
                                  reason="scheduled")
                level.plain_next = not level.plain_next

    def _average_in(self, rates: dict[int, float], arm: int, rate: float) -> None:
        previous = rates.get(arm)
        rates[arm] = rate if previous is None else previous + self.weight * (rate - previous)

    def _start_trial(self, level: _LevelArms, load: int, trial: int | None, remeasure: bool, reason: str) -> None:
        """Put `trial` (if any) on trial against the cap in force, in turns."""
        if trial is None or trial == level.best:
            return
        log.debug("load cap at load %d: a trial of %d against %d (%s)", load, trial, level.best, reason)
        level.trial, level.remeasure, level.switching = trial, remeasure, _Goodput()
        # Best, trial, trial, best, twice: each cap's turns sit at the same mean time (a steady
        # drift cancels), and each has as many turns right after a switch as after its own.
        level.turns = [level.best, trial, trial, level.best] * (TRIAL_TURNS // 4)
        level.window, level.extended = {}, 0

    def _end_turn(self, level: _LevelArms, load: int) -> None:
        """One turn of a trial ended: add it to its cap's window; after the last, decide."""
        arm, trial = level.turns.pop(0), level.trial
        assert trial is not None  # turns are a trial's
        level.window.setdefault(arm, _Goodput()).merge(level.running)
        level.running, level.drafted = _Goodput(), 0
        if (not level.turns and level.extended < TRIAL_EXTENSIONS
                and not _quiet_enough(list(level.window.values()), load)):
            # Prompts kept arriving in one cap's turns: measure both a little longer, in the same order.
            level.extended += 1
            level.turns = [level.best, trial, trial, level.best]
        if level.turns:
            if level.turns[0] != arm:
                level.settle = load
            return
        self._decide(level, load)

    def _decide(self, level: _LevelArms, load: int) -> None:
        """The trial's turns are done: the trial wins if it beat the cap in force, measured over
        the same stretch, by `margin`."""
        trial, best = level.trial, level.best
        assert trial is not None
        quiet = _quiet_enough(list(level.window.values()), load)
        rate = {arm: tally.rate(quiet) for arm, tally in level.window.items()}
        # Both caps' figures from the same turns, on each footing: what `_rival` compares
        # later starts level, and the cap in force's epochs average in from there.
        for arm in (trial, best):
            tally = level.window.get(arm, _Goodput())
            level.all_rates[arm] = tally.rate(quiet=False)
            if _quiet_enough([tally], load):
                level.rates[arm] = tally.rate(quiet=True)
            else:
                level.rates.pop(arm, None)  # an older quiet figure would set another stretch against this one
        # A trial must win clearly, over the trials of the same two caps so far: a cap switched
        # on noise costs every session until the next trial, more than a small real gain is worth.
        pair = (min(trial, best), max(trial, best))
        higher_over_lower = math.log(max(rate.get(pair[1], 0.0), 1e-9) / max(rate.get(pair[0], 0.0), 1e-9))
        verdict = level.verdicts.setdefault(pair, _Verdicts()).add(higher_over_lower)
        won = (verdict if trial > best else -verdict) > math.log1p(self.margin)
        if won:
            level.trial_cost, level.since_ms, level.switching = 0.0, 0.0, _Goodput()  # the win pays for it
        else:
            self._charge(level, load, level.all_rates[best])
        level.trial, level.window, level.since_trial = None, {}, 0
        level.decided += 1
        log.info("load cap at load %d: %d %s its trial against %d (%.4f against %.4f tokens/ms a session; "
                 "log ratio %+.2f over %d trials; its switches cost %.0f session-ms beyond the cap in force's goodput)",
                 load, trial, "won" if won else "lost", best, rate.get(trial, 0.0), rate.get(best, 0.0), verdict,
                 level.verdicts[pair].trials, level.trial_cost)
        # Outvoted: its own turns beat the cap in force by the margin, and only the trials
        # before outweighed them. A narrower win is within one trial's noise, and a rival
        # re-trial on it costs every session a catch-up prefill on the draft.
        if not won and rate.get(trial, 0.0) > (1.0 + self.margin) * rate.get(best, 0.0):
            level.outvoted.add(trial)
        else:
            level.outvoted.discard(trial)
        if won:
            level.outvoted.clear()  # they were beside the old cap
            level.best, level.explore_every, level.rival_after = trial, self.explore_every, 1
            level.used = None  # what the requests chose under the old cap says nothing of the new one
        else:  # a trial costs goodput: the more of them lose, the rarer they get
            if not level.remeasure:  # the next neighbour tried is on the other side
                level.downward = not level.downward
            longest = MAX_PLAIN_EXPLORE_INTERVAL if best == 0 else MAX_EXPLORE_INTERVAL
            if level.rival:
                level.rival_after = min(2 * level.rival_after, longest)
            else:
                level.explore_every = min(2 * level.explore_every, longest)
        level.remeasure = level.rival = False
        if won:  # the steps in flight were chosen under the old cap; the next cap along, at once
            level.settle = load
            self._start_trial(level, load, self._neighbour(level), remeasure=False, reason="the next after a win")

    def _charge(self, level: _LevelArms, load: int, best_rate: float) -> None:
        """Keep what the switches to the trial ending now cost: the session-ms of the steps its
        turns left out after each switch to it, beyond what the cap in force takes for the same
        tokens. Why those: the verdict leaves them out, since they are not what the cap costs
        once running, but a switch to drafting after plain steps has every session's draft
        catch up on its context first, and that is most of what a losing trial costs. Its
        turns' own shortfall is the price of measuring, which the epochs' schedule spaces."""
        spent, level.switching = level.switching, _Goodput()
        level.trial_cost = max(0.0, spent.ms - spent.tokens / best_rate) if best_rate > 0 else 0.0
        level.since_ms = 0.0
        self._switch_ms[load] = self._switch_ms.get(load, 0.0) + level.trial_cost

    @staticmethod
    def _affordable(level: _LevelArms) -> bool:
        """Whether the last lost trial's switches cost at most `TRIAL_BUDGET` of the level's time since."""
        return level.trial_cost <= TRIAL_BUDGET * level.since_ms

    def _rival(self, level: _LevelArms) -> int | None:
        """A measured cap whose goodput beats the cap in force's average by the margin, if
        any, among those worth measuring again: a lower cap, or a higher one that beat the cap
        in force by the margin over its last trial's own turns and lost only on the verdicts
        before it (`_LevelArms.outvoted`).

        Why not any higher cap: the cap in force's average falling below a lower cap's figure
        may be acceptance falling, which a lower cap gains from; a higher cap gains from none
        of it. Plain decoding's goodput does not depend on the draft at all, so its average
        dipping below a cap of 1's figure says only that the machine ran slower, for both. On
        the demo pair at 8 in flight such re-trials were 4 of a long run's 5 trials, all
        lost, each costing every session a catch-up prefill on the draft (docs/loadcap.md).
        A higher cap whose own turns won is another matter: the goodput landscape may have
        moved (acceptance rising), and the older verdicts lag behind it."""
        rates = level.comparable()
        floor = (1.0 + self.margin) * rates.get(level.best, 0.0)
        rivals = {arm: rate for arm, rate in rates.items()
                  if (arm < level.best or arm in level.outvoted) and rate > floor}
        return max(rivals, key=rivals.__getitem__) if rivals else None

    def _neighbour(self, level: _LevelArms) -> int | None:
        """The next cap to try beside the cap in force, in the level's current direction.

        Beside what the cap lets through, that is: a cap above every γ the requests chose
        under it acts as the longest of them, and its neighbour is one either side of that."""
        effective = level.best if level.used is None else min(level.best, max(level.used, 1))
        down, up = effective - 1, effective + 1
        if effective < level.best:  # the requests chose below the cap: only a lower one changes anything
            return down if down >= 0 else None
        if level.downward:
            return down if down >= 0 else (up if up <= self.max_draft_length else None)
        return up if up <= self.max_draft_length else (down if down >= 0 else None)
