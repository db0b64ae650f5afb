"""Each γ policy's decisions on scripted acceptance sequences."""
from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.edge.metrics import AcceptanceCollector
from gateway.policy.gamma import ConfidencePolicy, CostPolicy, EmaPolicy, FixedPolicy
from gateway.policy.loadcap import LoadCap
from gateway.stats.acceptance import AcceptanceStats
from gateway.stats.costmodel import STALE_AFTER_STEPS, StepCosts
from gateway.step.records import DraftLengthPolicy, StepRecord
from gateway.tasks import TaskProfile
from specd.steps import BatchStats


def choose(policy: DraftLengthPolicy) -> int:
    """The policy's γ for a step, under the bound it reads as the step begins."""
    return policy.next_draft_length(policy.bound())


def step(draft_length: int, accepted: int) -> StepRecord:
    return StepRecord(index=0, position=0, generated=0, draft_length=draft_length, draft_model_tokens=draft_length,
                      accepted=accepted, bonus=accepted == draft_length, token=0, emitted=(0,) * (accepted + 1),
                      draft_ms=0.0, verify_ms=0.0, draft_forward_ms=0.0, verify_forward_ms=0.0, draft_bytes=0,
                      verify_bytes=0)


def measured_costs(draft_ms_per_token: float, target_ms: float = 10.0) -> StepCosts:
    costs = StepCosts(weight=1.0)
    for gamma in (0, 2, 4, 8):
        costs.observe(gamma, draft_ms_per_token * gamma, target_ms * (1 + 0.03 * gamma))
    return costs


def test_fixed_never_changes():
    policy = FixedPolicy(5)
    for accepted in (0, 5, 2):
        policy.observe(step(5, accepted))
        assert choose(policy) == 5


def test_ema_grows_on_full_acceptance_and_shrinks_on_rejection():
    policy = EmaPolicy(start=4, min_draft_length=2, max_draft_length=8, target_rate=0.85, steps=50)
    for _ in range(30):
        policy.observe(step(choose(policy), choose(policy)))
    assert choose(policy) == 8
    for _ in range(200):
        policy.observe(step(choose(policy), 0))
    assert choose(policy) == 2
    # Slow by design (EMA over ~50 steps): one bad step does not move γ.
    steady = EmaPolicy(start=4, min_draft_length=2, max_draft_length=8)
    steady.observe(step(4, 0))
    assert choose(steady) == 4


def test_cost_policy_speculates_long_when_acceptance_is_high():
    policy = CostPolicy(measured_costs(0.5), TaskProfile(0.9, 1, 8))
    for _ in range(20):
        gamma = choose(policy)
        policy.observe(step(gamma, gamma))
    assert choose(policy) >= 6


def test_cost_policy_falls_back_to_plain_decoding_and_probes():
    policy = CostPolicy(measured_costs(3.0), TaskProfile(0.7, 1, 8), probe_every=8)
    choices = []
    for _ in range(40):
        gamma = choose(policy)
        choices.append(gamma)
        policy.observe(step(gamma, 0))  # the draft is never right
    tail = choices[10:]
    assert tail.count(0) >= 30 - 5, choices  # mostly plain decoding...
    assert any(g > 0 for g in tail), choices  # ...with a probe now and then


def test_cost_policy_uses_the_task_prior_before_evidence():
    costs = measured_costs(1.0)
    optimistic = choose(CostPolicy(costs, TaskProfile(0.95, 1, 16)))
    pessimistic = choose(CostPolicy(costs, TaskProfile(0.3, 1, 16)))
    assert optimistic > pessimistic


def test_cost_policy_prefers_the_measured_curve():
    # Position 3 is almost always rejected: stop before it even though α is high.
    curve = [0.95, 0.95, 0.05, 0.95, 0.95, 0.95]
    policy = CostPolicy(measured_costs(0.5), TaskProfile(0.9, 1, 6), curve=lambda: curve)
    assert choose(policy) == 2


def test_confidence_asks_for_the_maximum():
    assert choose(ConfidencePolicy(max_draft_length=8)) == 8


def test_cost_policy_probes_less_often_while_probes_fail():
    policy = CostPolicy(measured_costs(3.0), TaskProfile(0.0, 1, 8), probe_every=4)
    probes = []
    for step_index in range(200):
        gamma = choose(policy)
        if gamma:
            probes.append(step_index)
        policy.observe(step(gamma, 0))
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 4 * gaps[0], probes


def test_cost_policy_shrinks_gamma_as_the_target_fills_up():
    """The same pair and acceptance, measured at two loads: alone, verifying more positions
    is nearly free; in a saturated batch every extra position costs as much as a plain
    step, so no γ can pay (docs/design.md §4)."""
    costs = StepCosts(weight=1.0)
    for gamma in (0, 2, 4, 6):
        costs.observe(gamma, 1.0 * gamma, 10.0 * (1 + 0.03 * gamma), batch_size=1)  # alone
        costs.observe(gamma, 1.5 * gamma, 40.0 * (1 + gamma), batch_size=16)  # saturated: compute-bound
    policy = CostPolicy(costs, TaskProfile(0.7, 1, 8))
    costs.observe(4, 4.0, 11.2, batch_size=1)
    alone = choose(policy)
    costs.observe(4, 6.0, 200.0, batch_size=16)
    saturated = choose(policy)
    assert alone >= 3 and saturated == 0, (alone, saturated)


def test_a_gamma_measured_slow_once_is_tried_again_once_its_figure_is_stale():
    """Long drafts measured slow once (a first forward at a new shape, a busy moment), then
    never chosen again: that figure must not rule them out for good."""
    costs = StepCosts(weight=0.1)
    costs.observe(0, 0.0, 10.0)
    for gamma in (5, 6):
        costs.observe(gamma, 1.0 * gamma, 30.0)  # one slow step each
    policy = CostPolicy(costs, TaskProfile(0.8, 1, 8))
    for _ in range(10):
        costs.observe(3, 3.0, 12.0)
    assert choose(policy) <= 4  # the slow figures stand while fresh
    for _ in range(STALE_AFTER_STEPS):
        costs.observe(3, 3.0, 12.0)
    assert choose(policy) >= 5  # the line through γ 0 and 3 stands in for them


def test_probes_propose_one_token():
    policy = CostPolicy(measured_costs(3.0), TaskProfile(0.0, 4, 8), probe_every=4)
    probes = [g for g in (choose(policy) for _ in range(40)) if g]
    assert probes and set(probes) == {1}


def test_cost_policy_settled_on_plain_decoding_foresees_its_plain_steps_up_to_the_next_probe():
    """After a plain step, plain_steps_ahead(8) counts the plain steps that follow, stopping
    exactly at the next probe, once the policy has settled (the verifier then scores them
    ahead); none after a probe, and none while it speculates."""
    policy = CostPolicy(measured_costs(3.0), TaskProfile(0.0, 4, 8), probe_every=4)
    chosen, foreseen = [], []
    for _ in range(40):
        chosen.append(choose(policy))
        foreseen.append(policy.plain_steps_ahead(8))
    assert 1 in chosen  # it probes
    for i, gamma in enumerate(chosen[:-1]):
        ahead = foreseen[i]
        assert chosen[i + 1:i + 1 + ahead] == [0] * len(chosen[i + 1:i + 1 + ahead]), (i, chosen, foreseen)
        if gamma == 0 and ahead < 8 and i + 1 + ahead < len(chosen):
            assert chosen[i + 1 + ahead] != 0, (i, chosen, foreseen)  # it stops at the probe
        if gamma:
            assert ahead == 0
    assert max(foreseen) > 1  # it sees past the next step
    speculating = CostPolicy(measured_costs(0.5), TaskProfile(0.9, 1, 8))
    assert choose(speculating) > 0 and speculating.plain_steps_ahead(8) == 0


def test_overlap_hits_make_longer_drafts_pay():
    """A draft whose tokens cost more than verifying: sequentially no γ pays, but when
    most steps are answered from a pre-drafted branch the draft hop is nearly free."""
    costs = StepCosts(weight=0.1)
    for gamma in (0, 2, 4):
        costs.observe(gamma, 6.0 * gamma, 10.0 * (1 + 0.05 * gamma))  # constant: the EMAs hold these
    sequential = CostPolicy(costs, TaskProfile(0.6, 1, 8))
    overlapped = CostPolicy(costs, TaskProfile(0.6, 1, 8), overlap=True)
    assert choose(sequential) == 0
    for _ in range(50):  # measured: 9 of 10 pre-drafted steps hit, at 1 ms of draft hop
        for hit in [True] * 9 + [False]:
            costs.observe(4, 1.0 if hit else 24.0, 12.0, pre_draft_asked=True, pre_drafted=hit)
    assert 0.8 < costs.hit_rate.value < 0.95  # an EMA ending on a miss
    assert choose(overlapped) >= 2
    assert choose(sequential) == 0


def test_probe_spacing_is_shared_across_requests():
    """A draft the target never agrees with: each new request of the pair starts from the
    spacing the last one reached, so probes thin out across requests, not just within one."""
    from gateway.policy.gamma import ProbeSchedule

    costs, schedule = measured_costs(3.0), ProbeSchedule(4, 4)
    probes_per_request = []
    for _ in range(4):
        policy = CostPolicy(costs, TaskProfile(0.0, 1, 8), probes=schedule)
        probes = 0
        for _ in range(48):
            gamma = choose(policy)
            probes += gamma > 0
            policy.observe(step(gamma, 0))
        probes_per_request.append(probes)
    assert probes_per_request[-1] < probes_per_request[0] and probes_per_request[-1] <= 1, probes_per_request


def run_under_load(cap: LoadCap, step_ms, sessions: int, steps: int, alpha: float = 0.7) -> list[int]:
    """Steps of AUTO requests that all share `cap`, in a world where a step under cap c costs
    step_ms(c) for everyone (every session in the forward speculates alike); the γ of each step."""
    rng = random.Random(0)
    costs = measured_costs(0.5)  # alone, a long draft pays: the request's own choice is γ ≥ 3
    policy = CostPolicy(costs, TaskProfile(alpha, 1, 8), load_cap=cap)
    chosen = []
    for index in range(1, steps + 1):
        bound = policy.bound()
        gamma = policy.next_draft_length(bound)
        accepted = 0
        while accepted < gamma and rng.random() < alpha:
            accepted += 1
        chosen.append(gamma)
        policy.observe(StepRecord(
            index=index, position=0, generated=0, draft_length=gamma, draft_model_tokens=gamma, accepted=accepted,
            bonus=accepted == gamma, token=0, emitted=(0,) * (accepted + 1), draft_ms=0.5 * gamma,
            verify_ms=step_ms(cap.cap()),
            draft_forward_ms=0.0, verify_forward_ms=0.0, draft_bytes=0, verify_bytes=0,
            verify_batch=BatchStats(size=sessions, tokens=sessions, sessions=sessions),
            interval_ms=0.5 * gamma + step_ms(cap.cap()) + 0.2, load_cap=bound))
    return chosen


def test_load_cap_turns_speculation_off_where_the_forward_is_compute_bound():
    """Sixteen sessions on a target whose forward's time grows with every token in it: each
    request alone would still speculate, but all of them doing so is slower than none."""
    cap = LoadCap(max_draft_length=8)
    chosen = run_under_load(cap, lambda c: 5.0 + 16 * (c + 1) * 1.5, sessions=16, steps=3000)
    late = chosen[-1000:]
    assert cap.caps()[16] == 0 and late.count(0) >= 0.9 * len(late), cap.rates()
    assert cap.rates()[16][0] > max(rate for c, rate in cap.rates()[16].items() if c > 0)


def test_load_cap_keeps_speculating_where_verifying_is_nearly_free():
    """A memory-bound forward (a GPU's, at this batch): more positions cost almost nothing, so
    the cap stays where the requests' own choice is."""
    cap = LoadCap(max_draft_length=8)
    chosen = run_under_load(cap, lambda c: 10.0 + 16 * (c + 1) * 0.02, sessions=16, steps=3000)
    assert cap.caps()[16] >= 3 and sum(chosen[-1000:]) / 1000 >= 2.5, cap.rates()


def test_load_cap_trials_thin_out_while_they_lose_and_a_lone_session_is_never_capped():
    cap = LoadCap(max_draft_length=8)
    chosen = run_under_load(cap, lambda c: 5.0 + 16 * (c + 1) * 1.5, sessions=16, steps=15000)
    # A trial takes turns with the cap in force: its steps come in bursts a few hundred steps long.
    speculating = [i for i, gamma in enumerate(chosen) if gamma > 0]
    trials = [i for previous, i in zip(speculating, speculating[1:]) if i - previous > 300]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert len(gaps) >= 2 and gaps[-1] > gaps[0], trials
    alone = run_under_load(cap, lambda c: 10.0, sessions=1, steps=50)
    assert cap.cap() == 8 and min(alone[1:]) >= 3


def test_under_a_cap_of_0_trials_thin_out_further_until_the_acceptance_moves():
    """A trial of drafting after plain steps costs every session a catch-up prefill on the
    draft: under a cap of 0 losing trials thin out past `MAX_EXPLORE_INTERVAL` epochs, to
    `MAX_PLAIN_EXPLORE_INTERVAL`. The pair's acceptance moving brings the next one forward,
    whatever the last one's switches cost."""
    from gateway.policy.loadcap import MAX_EXPLORE_INTERVAL

    cap = LoadCap(max_draft_length=8)
    starts = []
    for index in range(1, 80_001):
        arm = cap.cap()
        if arm != cap.caps().get(16, 8) and (not starts or index - starts[-1] > 300):
            starts.append(index)
        cap.observe(arm, capped_step(index, min(arm, 1), 1.0 / (0.050 if arm == 0 else 0.030)))
    level = cap._levels[16]
    assert level.best == 0
    epoch = 3 * 16  # steps
    assert starts[-1] - starts[-2] > 2 * MAX_EXPLORE_INTERVAL * epoch, starts  # 3,264 steps at 64 epochs
    assert level.trial_cost > 0  # the last lost trial's switches: the next waits for them too
    cap.price = lambda alpha: {16: [0.05, 0.03]}
    cap._reprice(0.9)
    assert level.best == 0 and level.explore_every == cap.explore_every and level.trial_cost == 0


@pytest.mark.parametrize("switch_ms", [20.0, 300.0])
def test_a_lost_trial_waits_until_its_cost_is_a_small_share_of_the_time_since(switch_ms):
    """Plain decoding in force at 16 sessions; a cap of 1 runs 10% slower. A switch to it
    makes every session's first step under it take `switch_ms` (the draft catching up on
    its context; 20 ms: no catch-up). The trials' verdicts leave those steps out, but what
    a lost trial's switches cost is at most `TRIAL_BUDGET` of the level's time until the
    next: with a dear switch the trials are far rarer than the epochs alone space them
    (8, 16, 32... epochs of 48 steps)."""
    from gateway.policy.loadcap import TRIAL_BUDGET

    cap = LoadCap(max_draft_length=8)
    cap.cap()
    level = cap._level(16)
    level.best, level.settle = 0, 0
    trials = []  # [session-ms at its start, at its end, its cost]
    catching_up, previous = 0, 0
    session_ms = 0.0  # the level's time, summed over its sessions' steps
    for index in range(1, 120_001):
        running = level.trial is not None
        arm = cap.cap()
        if arm and not previous:  # every switch to the cap of 1, a trial's second turn pair included
            catching_up = 16
        previous = arm
        interval = 20.0 if arm == 0 else 22.0
        if arm and catching_up:
            catching_up -= 1
            interval = switch_ms
        session_ms += interval
        cap.observe(arm, capped_step(index, min(arm, 1), interval))
        if level.trial is not None and not running:
            trials.append([session_ms, None, None])
        elif running and level.trial is None:
            trials[-1][1:] = [session_ms, level.trial_cost]
    assert level.best == 0 and len(trials) >= 3, trials
    waits = [after[0] - before[1] for before, after in zip(trials, trials[1:])]
    costs = [cost for _, _, cost in trials[:-1]]
    if switch_ms > 100:
        # Two switches a trial, each 16 × 280 ms: 9 s, and at least 900 s before the next.
        assert all(cost >= 2 * 16 * (switch_ms - 20.0) for cost in costs), costs
        # TRIAL_BUDGET is 1%; with the epochs' schedule alone the waits were 15 to 246 s (16 to
        # 256 epochs), so the switches took 3.6% to 58% of the level's time.
        assert TRIAL_BUDGET <= 0.01 and all(wait >= cost / 0.01 for wait, cost in zip(waits, costs)), (waits, costs)
    else:
        # Switches that cost nothing: the epochs' schedule alone spaces the trials, the first
        # wait 16 epochs of 48 steps (about 15 s).
        assert max(costs) == 0.0 and waits[0] < 16 * 48 * 22.0 * 1.5, (waits, costs)


def test_an_unlucky_first_measure_of_plain_decoding_does_not_decide_for_good():
    """The first trial of cap 0 comes early, often while the first prompts still prefill and
    slow every forward. Plain decoding is measured again later, and wins where it should."""
    steps = iter(range(10**6))

    def step_ms(c: int) -> float:
        prefilling = next(steps) < 200  # the first trial of cap 0 falls in here
        return 5.0 + 16 * (c + 1) * 3.0 + (400.0 if prefilling else 0.0)

    cap = LoadCap(max_draft_length=8)
    chosen = run_under_load(cap, step_ms, sessions=16, steps=3000)
    assert cap.caps()[16] == 0 and chosen[-500:].count(0) >= 400, cap.rates()


def capped_step(index: int, draft_length: int, interval_ms: float, sessions: int = 16) -> StepRecord:
    """A step of one session among `sessions` in the verifier's forward: one token emitted,
    `interval_ms` since the request's last commit (what `LoadCap` measures goodput from)."""
    return StepRecord(index=index, position=0, generated=0, draft_length=draft_length,
                      draft_model_tokens=draft_length, accepted=0, bonus=False, token=0, emitted=(0,), draft_ms=0.0,
                      verify_ms=0.0, draft_forward_ms=0.0, verify_forward_ms=0.0, draft_bytes=0, verify_bytes=0,
                      verify_batch=BatchStats(size=sessions, tokens=sessions, sessions=sessions),
                      interval_ms=interval_ms)


def test_neighbour_trials_go_both_ways_between_the_plain_ones():
    """Goodput peaks at the cap in force: trials of plain decoding and of both neighbours
    lose. A lost plain trial must not turn the direction back, or one neighbour is never tried."""
    cap = LoadCap(max_draft_length=8)
    cap.observe(8, StepRecord(index=1, position=0, generated=0, draft_length=5, draft_model_tokens=5, accepted=5,
                              bonus=True, token=0, emitted=(0,) * 6, draft_ms=1.0, verify_ms=1.0, draft_forward_ms=0.0,
                              verify_forward_ms=0.0, draft_bytes=0, verify_bytes=0, interval_ms=2.0))
    tried = []
    for index in range(1, 60_000):
        arm = cap.cap()
        if not tried or tried[-1] != arm:
            tried.append(arm)
        goodput = 0.05 - 0.004 * abs(arm - 5)  # tokens per ms, best at 5
        cap.observe(arm, capped_step(index, arm, 1 / goodput))
    assert {0, 4, 6} <= set(tried) and cap.caps()[16] == 5, tried


def test_requests_in_flight_are_a_floor_on_the_load():
    """A wave of requests after a quiet spell: the last step reported one session, but
    sixteen requests of the pair are in flight here, so their first steps are capped too."""
    cap = LoadCap(max_draft_length=8)
    run_under_load(cap, lambda c: 5.0 + 16 * (c + 1) * 1.5, sessions=16, steps=600)
    assert cap.rates()[16] and cap.caps()[16] == 0
    run_under_load(cap, lambda c: 10.0, sessions=1, steps=2)  # a lone request: no cap
    assert cap.cap() == 8
    wave = [cap.enter() for _ in range(16)]
    assert cap.caps()[16] == 0
    for request in wave:
        request.leave()
    assert cap.cap() == 8


def test_a_level_reached_only_as_the_load_drains_follows_the_measured_one_above():
    """Waves of sixteen requests: each wave's last requests pass through four in flight, too
    briefly to gather an epoch there. Until that level measures for itself it takes the
    cap measured at sixteen, not the longest draft chosen alone; a lower level measured
    since outranks it."""
    cap = LoadCap(max_draft_length=8)
    run_under_load(cap, lambda c: 10.0, sessions=1, steps=20)  # alone the requests draft long
    assert cap.widest >= 3
    run_under_load(cap, lambda c: 5.0 + 4 * (c + 1) * 1.5, sessions=4, steps=3)  # the drain: no epoch
    assert cap.caps() == {} and cap.cap() == cap.widest  # nothing measured yet: the widest draft
    run_under_load(cap, lambda c: 5.0 + 16 * (c + 1) * 1.5, sessions=16, steps=600)
    assert cap.caps() == {16: 0}
    drain = run_under_load(cap, lambda c: 5.0 + 4 * (c + 1) * 1.5, sessions=4, steps=3)
    assert drain == [0, 0, 0] and 4 not in cap.caps()
    run_under_load(cap, lambda c: 10.0 + 2 * (c + 1) * 0.02, sessions=2, steps=600)  # at two, drafting pays
    assert cap.caps()[2] > 0
    assert run_under_load(cap, lambda c: 5.0 + 4 * (c + 1) * 1.5, sessions=4, steps=2)[-1] > 0


def test_steps_count_at_the_load_their_cap_was_chosen_for():
    """Workers that report one session each (several verifier replicas, say) while sixteen
    requests are in flight here: the cap is read at load 16, so its steps must teach load 16."""
    cap = LoadCap(max_draft_length=8)
    for _ in range(16):
        cap.enter()
    run_under_load(cap, lambda c: 5.0 + 16 * (c + 1) * 1.5, sessions=1, steps=600)
    assert 16 in cap.rates() and cap.caps()[16] == 0, cap.rates()


def steps_under_cap(cap: LoadCap, goodput, chosen: int, steps: int, start: int = 1) -> list[int]:
    """`steps` steps at load 16 whose requests choose γ = `chosen` under any cap above it;
    goodput(arm) is tokens per ms per session under the cap in force. The caps, step by step."""
    caps = []
    for index in range(start, start + steps):
        arm = cap.cap()
        caps.append(arm)
        gamma = min(arm, chosen)
        cap.observe(arm, capped_step(index, gamma, 1 / goodput(arm)))
    return caps


def test_a_cap_measured_better_than_the_one_in_force_is_tried_again_at_once():
    """Plain decoding's first trial lost narrowly; then speculating got slower than plain
    decoding had measured. Plain decoding is tried again within an epoch or two, not after
    the dozens of epochs the exploration schedule would wait, and wins."""
    cap = LoadCap(max_draft_length=8)
    early = steps_under_cap(cap, lambda arm: 0.0318 if arm == 0 else 0.033, chosen=4, steps=300)
    assert 0 in early and cap.caps()[16] == 8 and cap.rates()[16][0] < cap.rates()[16][8]  # the plain trial lost
    later = steps_under_cap(cap, lambda arm: 0.0318 if arm == 0 else 0.025, chosen=4, steps=400, start=301)
    assert cap.caps()[16] == 0 and later.index(0) < 4 * 48, (later.index(0), cap.rates())


def test_a_neighbour_trial_starts_from_the_drafts_the_requests_chose():
    """Requests choose γ = 4 under a cap of 8, so a cap of 7 would change nothing: the
    neighbour tried below is 3."""
    cap = LoadCap(max_draft_length=8)
    caps = steps_under_cap(cap, lambda arm: 0.03 - 0.001 * (4 - min(arm, 4)), chosen=4, steps=6000)
    assert 3 in caps and 7 not in caps, sorted(set(caps))


def test_after_a_trial_wins_the_next_neighbour_is_beside_the_new_cap():
    """Goodput first peaks at γ = 3, then grows with γ: the cap climbs 4, 5, … one trial
    after another, not back down from what the requests chose under the old cap. Slowly:
    on the way down from 8 to 3 each higher cap lost its trials, and those verdicts weigh
    against it until new trials outvote them (`_Verdicts`)."""
    cap = LoadCap(max_draft_length=8)
    steps_under_cap(cap, lambda arm: 0.03 - 0.002 * abs(arm - 3) - (0.01 if arm == 0 else 0), chosen=8, steps=3000)
    assert cap.caps()[16] == 3, cap.rates()
    climbing = steps_under_cap(cap, lambda arm: 0.02 + 0.003 * arm, chosen=8, steps=25_000, start=3001)
    assert 8 in climbing and 2 not in climbing, sorted(set(climbing))
    assert cap.caps()[16] == 8, cap.rates()


def steps_on_a_drifting_machine(cap: LoadCap, goodput, steps: int, seed: int = 0) -> list[int]:
    """`steps_under_cap` (requests choosing γ = 4) on a machine whose speed drifts: ±20% over
    600 steps, a few dozen epochs' worth, with 5% of noise on each step besides."""
    rng = random.Random(seed)
    caps = []
    for index in range(1, steps + 1):
        arm = cap.cap()
        caps.append(arm)
        speed = (1.0 + 0.2 * math.sin(2 * math.pi * index / 600)) * rng.uniform(0.95, 1.05)
        cap.observe(arm, capped_step(index, min(arm, 4), 1 / (goodput(min(arm, 4)) * speed)))
    return caps


@pytest.mark.parametrize("seed", range(4))
def test_a_drifting_machine_does_not_switch_the_cap_on_its_drift(seed):
    """Speculating (γ = 4) is truly 8% better than plain decoding, and each γ below 4 a little
    worse. The machine's speed swings by ±20%, far more than that, but slowly: a trial
    measured beside the cap in force sees the same speed, so it loses as it should, and the
    cap stays where the requests' own choice is."""
    cap = LoadCap(max_draft_length=8)
    caps = steps_on_a_drifting_machine(cap, lambda gamma: 0.030 + 0.0006 * gamma, steps=12_000, seed=seed)
    late = caps[6000:]
    assert cap.caps()[16] >= 4 and sum(1 for c in late if c < 4) < 0.15 * len(late), (cap.rates(), sorted(set(late)))


@pytest.mark.parametrize("seed", range(4))
def test_a_drifting_machine_still_finds_that_plain_decoding_pays(seed):
    """The mirror: plain decoding truly 8% better than any speculating, on the same drift."""
    cap = LoadCap(max_draft_length=8)
    caps = steps_on_a_drifting_machine(cap, lambda gamma: 0.0324 if gamma == 0 else 0.030, steps=12_000, seed=seed)
    late = caps[6000:]
    assert cap.caps()[16] == 0 and late.count(0) > 0.85 * len(late), cap.rates()


def test_a_cap_that_wins_only_on_noise_does_not_keep_coming_back():
    """Plain decoding truly 10% better than a cap of 1, but each round's speed (16 steps)
    swings by a factor of e^N(0, 0.4): one trial's log ratio varies by about 0.28, as on the
    demo pair at 8 in flight. Decided trial by trial, a cap of 1 wins about a third of its
    trials, and the later halves of these runs spent 44% of their steps speculating.
    Weighed together with the trials before, it stops winning, and plain decoding holds
    (7% speculating)."""
    shares = []
    for seed in range(4):
        rng = random.Random(seed)
        cap, caps, swing = LoadCap(max_draft_length=8), [], 1.0
        for index in range(1, 40_001):
            if index % 16 == 1:
                swing = math.exp(rng.gauss(0.0, 0.4))
            arm = cap.cap()
            caps.append(arm)
            gamma = min(arm, 1)
            cap.observe(arm, capped_step(index, gamma, 1.0 / ((0.033 if gamma == 0 else 0.030) * swing)))
        assert cap.caps()[16] == 0, cap.rates()
        shares.append(caps[20_000:].count(0) / 20_000)
    assert sum(shares) / len(shares) > 0.85, shares


def steps_with_prompts_arriving(cap: LoadCap, goodput, share: float, steps: int, seed: int) -> list[int]:
    """Requests choosing γ = 4 under `cap`, 16 sessions a round. In `share` of the rounds a
    new request arrives, and its prompt, prefilled in that round's forwards, makes every
    step of the round three times as slow, whatever the cap; its first step ends the round.
    (A request that ends meanwhile keeps the sessions at 16.)"""
    rng = random.Random(seed)
    caps, arrived = [], None
    for index in range(1, steps + 1):
        if index % 16 == 1 and rng.random() < share:
            arrived = cap.enter()
        arm = cap.cap()
        caps.append(arm)
        gamma = min(arm, 4)
        cap.observe(arm, capped_step(index, gamma, (1.0 if arrived is None else 3.0) / goodput(gamma)))
        if index % 16 == 0 and arrived is not None:  # the round ends with the new request's first step
            first = capped_step(0, gamma, 1.0 / goodput(gamma))
            cap.observe(arm, first)  # as its policy passes it on, then its other observers
            arrived.observe(first)
            arrived.leave()
            arrived = None
    return caps


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("plain_pays", [True, False])
def test_prompts_arriving_during_a_trial_do_not_decide_it(plain_pays, seed):
    """Plain decoding truly 10% better than speculating (and the mirror). A prompt arrives in a
    fifth of the rounds and triples their steps: over the few rounds of a trial, that noise
    is larger than the difference, and it falls on whichever cap's turn it happens to.
    Compared on the steps taken a round or more after the last prompt, the cap lands right."""
    cap = LoadCap(max_draft_length=8)
    better, worse = 0.033, 0.030
    caps = steps_with_prompts_arriving(cap, lambda gamma: (better if gamma == 0 else worse) if plain_pays else
                                       (worse if gamma == 0 else better), share=0.2, steps=6000, seed=seed)
    late = caps[3000:]
    if plain_pays:
        assert cap.caps()[16] == 0 and late.count(0) > 0.85 * len(late), cap.rates()
    else:
        assert cap.caps()[16] > 0 and late.count(0) < 0.15 * len(late), cap.rates()


@pytest.mark.parametrize("ended", ["after its steps", "before its first step"])
def test_a_request_the_cap_does_not_measure_leaves_no_prompt_behind(ended):
    """A request of the pair under a fixed γ (or one that failed at once) enters and leaves
    the load cap, but its steps do not teach it. Its prompt must stop counting as
    prefilling when it ends, or no step is ever quiet again and prompts decide the trials."""
    cap = LoadCap(max_draft_length=8)
    other = cap.enter()
    if ended == "after its steps":
        for index in range(3):
            other.observe(capped_step(index, 4, 30.0))  # only its own observers see its steps
    other.leave()
    caps = steps_with_prompts_arriving(cap, lambda gamma: 0.033 if gamma == 0 else 0.030, share=0.2, steps=6000,
                                       seed=2)
    assert cap.caps()[16] == 0 and caps[3000:].count(0) > 0.85 * 3000, cap.rates()


def test_with_a_prompt_in_every_forward_the_cap_is_still_measured():
    """No forward is free of prompts: the caps are compared on all their steps."""
    cap = LoadCap(max_draft_length=8)
    caps = steps_with_prompts_arriving(cap, lambda gamma: 0.036 if gamma == 0 else 0.030, share=1.0, steps=3000,
                                       seed=0)
    assert cap.caps()[16] == 0 and caps[-500:].count(0) > 400, cap.rates()


def test_the_load_cap_and_what_it_measured_are_in_prometheus():
    """An operator asking why AUTO stopped speculating under load reads the cap in force
    at each load level, the goodput of each cap tried there, and what the lost trials'
    switches cost, from /metrics."""
    cap = LoadCap(max_draft_length=8)
    arriving = [cap.enter() for _ in range(4)]  # the cap is read at load 4, where nothing is measured yet
    assert cap.cap() == 8 and cap.caps() == {}
    for request in arriving:
        request.leave()
    steps_under_cap(cap, lambda arm: 0.04 if arm == 0 else 0.02, chosen=4, steps=600)
    registry = CollectorRegistry()
    registry.register(AcceptanceCollector(AcceptanceStats(), load_caps=lambda: {"d->t": cap}))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    (in_force,) = families["specd_spec_decode_load_cap"].samples
    assert in_force.labels == {"model_pair": "d->t", "load": "16"} and in_force.value == 0
    goodput = {s.labels["cap"]: s.value for s in families["specd_spec_decode_load_cap_goodput"].samples}
    assert goodput["0"] > goodput["8"] > 0, goodput
    # What the lost trials of a cap of 1 cost in switches (each 25 ms step then took 50).
    (switches,) = families["specd_spec_decode_load_cap_trial_switch_seconds"].samples
    assert switches.labels["load"] == "16" and cap.switch_ms()[16] > 0
    assert switches.value == pytest.approx(cap.switch_ms()[16] / 1e3)


def test_a_trial_left_by_the_load_is_dropped_not_resumed():
    """The load leaves 16 in the middle of a trial of plain decoding (truly 3% worse here) and
    comes back to a machine 30% slower. Resumed, the trial would set its turns before the
    excursion against the cap in force's after it, and plain decoding would win."""
    cap = LoadCap(max_draft_length=8)
    index = 0

    def steps(sessions: int, speed: float, count: int) -> None:
        nonlocal index
        for _ in range(count):
            index += 1
            arm = cap.cap()
            goodput = (0.029 if arm == 0 else 0.030) * speed
            cap.observe(arm, capped_step(index, min(arm, 4), 1 / goodput, sessions))

    # A new level's settle, an epoch, then the first trial's first three turns (best, plain,
    # plain, with a settle at the switch): its fourth turn, the cap in force's, is next.
    steps(16, 1.0, 16 + 48 + 16 + 16 + 2 * 16)
    assert cap.cap() == 8
    steps(8, 1.0, 500)
    steps(16, 0.7, 2000)
    assert cap.caps()[16] == 8, cap.rates()


def test_a_rival_that_keeps_losing_is_tried_again_less_and_less_often():
    """Every cap slows alike, by 40% over the run (contexts growing, say): the cap in force's
    average keeps falling below what the others measured before, but each re-trial beside it
    loses. The re-trials thin out as the scheduled trials do."""
    def trials(speed) -> int:
        cap = LoadCap(max_draft_length=8)
        caps = []
        for index in range(1, 20_001):
            arm = cap.cap()
            caps.append(arm != cap.caps().get(16, 8))
            goodput = (0.029 if arm == 0 else 0.030) * speed(index)
            cap.observe(arm, capped_step(index, min(arm, 4), 1 / goodput))
        on_trial = [i for i, other in enumerate(caps) if other]
        return 1 + sum(1 for previous, i in zip(on_trial, on_trial[1:]) if i - previous > 300)

    flat, slowing = trials(lambda i: 1.0), trials(lambda i: 1 - 0.4 * i / 20_000)
    assert slowing < 2 * flat, (slowing, flat)  # 16 against 8 when every rival re-trial came at once


@pytest.mark.parametrize("seed", range(4))
def test_plain_decodings_dips_do_not_bring_a_losing_cap_back(seed):
    """Plain decoding truly 8% better than speculating, on a machine whose speed drifts from
    round to round (correlated, about 8% a round, as on the demo pair at 8 in flight). Plain
    decoding's average dips below the cap of 1's last figure now and then; that is the
    machine, which slows both alike, so it brings no extra trial of the cap (each one costs
    every session a catch-up prefill on the draft). Only the schedule's trials come: 14 or 15
    here, against 17 to 19 when every dip brought one."""
    rng = random.Random(seed)
    cap, speed, on_trial = LoadCap(max_draft_length=8), 0.0, []
    for index in range(1, 40_001):
        if index % 16 == 1:
            speed = 0.66 * speed + rng.gauss(0.0, 0.083)
        arm = cap.cap()
        if arm != cap.caps().get(16, 8):
            on_trial.append(index)
        goodput = (0.050 if arm == 0 else 0.046) * math.exp(speed)
        cap.observe(arm, capped_step(index, min(arm, 1), 1.0 / goodput))
    trials = 1 + sum(1 for previous, i in zip(on_trial, on_trial[1:]) if i - previous > 300)
    assert cap.caps()[16] == 0 and trials <= 16, (trials, cap.rates())


@pytest.mark.parametrize("own_turns, outvoted", [(1.02, False), (1.15, True)])
def test_only_a_clear_win_on_its_own_turns_brings_an_outvoted_cap_back_as_a_rival(own_turns, outvoted):
    """Plain decoding in force; a cap of 1 lost its trials before (the verdicts say −0.5 over
    ten). Its next trial's own turns run 2% faster than plain decoding's: that is within
    one trial's noise (a tie, as SmolLM2's pair at 8 in flight gave, log ratios −0.10 to
    +0.02), and re-trying it as a rival costs every session a catch-up prefill on the draft
    each time, so it waits for the schedule. 15% faster, and outweighed only by older
    verdicts: the goodput landscape may have moved, so it is re-tried soon."""
    from gateway.policy.loadcap import _Verdicts

    cap = LoadCap(max_draft_length=8)
    cap.cap()
    level = cap._level(16)
    level.best, level.settle = 0, 0
    level.verdicts[(0, 1)] = _Verdicts(-0.5, 10)
    cap._start_trial(level, 16, 1, remeasure=False, reason="a test")
    steps_under_cap(cap, lambda arm: 0.030 * (own_turns if arm else 1.0), chosen=1, steps=200)
    assert level.trial is None and level.best == 0 and level.verdicts[(0, 1)].mean < 0
    assert (1 in level.outvoted) == outvoted


def test_a_sampled_rejection_drafts_the_next_proposal_as_long_as_the_next_step_will_ask():
    """At T = 1 most steps end in a rejection, whose recovery hop drafts the next proposal;
    the next step takes a prefix. Drafted only as long as this step's, γ could never grow
    there; drafted longer than the next step asks, the extra tokens cost draft time. AUTO's
    cost policy foresees its next choice from this step's outcome; fixed γ asks its own."""
    policy = CostPolicy(measured_costs(0.5), TaskProfile(0.95, 1, 8))
    foreseen = policy.recovery_draft_length(2, accepted=1)
    policy.observe(step(2, 1))
    assert foreseen == choose(policy) > 2
    losing = CostPolicy(measured_costs(3.0), TaskProfile(0.3, 1, 8))
    assert losing.recovery_draft_length(2, accepted=0) == 0  # the hop only draws the recovered token
    assert EmaPolicy(start=4, min_draft_length=2, max_draft_length=8).recovery_draft_length(4, accepted=1) == 5
    assert FixedPolicy(4).recovery_draft_length(4, accepted=0) == 4
    assert ConfidencePolicy(max_draft_length=12).recovery_draft_length(3, accepted=0) == 12
