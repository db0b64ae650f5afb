"""AUTO against plain decoding on simulated machines of set step costs (`gateway.policy.floor`).

Each machine sets what a step costs: a plain target step, the draft hop per proposed token,
how much the verify step grows per proposed token, and costs the hops do not show (a
sampled step's recovery hop, the draft's catch-up after plain steps). Requests run step by
step through the same loop as the gateway's: the cost policy chooses γ, the step's record
feeds the pair's costs (`StepRecord.rest_ms`, as `gateway.core` feeds them), plain
decoding's rates, the floor and the policy. The same requests decoded plainly on the same
machine are the baseline; AUTO must not fall below it where speculation loses, and must
speculate where it wins.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from conftest import SEEDED_DRAFT_FLOOR_S, request, start_stack
from gateway.edge.metrics import AcceptanceCollector
from gateway.policy.floor import FIRST_INTERVAL, MAX_INTERVAL, FloorSchedule, PlainRates, RequestFloor, floor_snapshot
from gateway.policy.gamma import CostPolicy, FixedPolicy, ProbeSchedule
from gateway.stats.acceptance import AcceptanceStats
from gateway.stats.costmodel import StepCosts
from gateway.step.records import DraftLengthPolicy, StepRecord
from gateway.tasks import TaskProfile
from specd.steps import BatchStats
from tcpproxy import proxy_front
from test_policy import choose

REQUEST_TOKENS = 128


@dataclass(frozen=True)
class Machine:
    """What a step costs, in ms. noise: each step's time varies by ±this share."""

    plain_ms: float
    draft_ms_per_token: float
    verify_growth: float  # the verify step grows by this share of a plain step per proposed token
    recovery_ms: float = 0.0  # a rejecting step's extra hop, seen only in the interval
    catch_up_ms: float = 0.0  # per plain step since the draft last ran, paid by its next hop
    noise: float = 0.05


class Clock:
    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


@dataclass
class Gateway:
    """The state requests share in `gateway.core`: the pair's costs, plain rates, schedules."""

    clock: Clock
    costs: StepCosts
    plain: PlainRates
    schedule: FloorSchedule
    probes: ProbeSchedule
    # Price steps by their hops alone, as before costs were measured over whole steps: a
    # cost model that misses what the hops do not show.
    priced_by_hops: bool = False

    @classmethod
    def fresh(cls, priced_by_hops: bool = False) -> Gateway:
        clock = Clock()
        return cls(clock, StepCosts(), PlainRates(clock=clock), FloorSchedule(), ProbeSchedule(), priced_by_hops)

    def auto(self, prior_alpha: float = 0.7) -> CostPolicy:
        return CostPolicy(self.costs, TaskProfile(prior_alpha, 1, 8), probes=self.probes,
                          floor=RequestFloor(self.plain, self.schedule))


def run_request(policy: DraftLengthPolicy, machine: Machine, alpha: float, gateway: Gateway,
                rng: random.Random) -> tuple[int, float, list[int]]:
    """One request of REQUEST_TOKENS tokens at per-token acceptance α: (tokens, ms, γ per step)."""
    generated, index, since_draft, total_ms, gammas = 0, 0, 0, 0.0, []
    while generated < REQUEST_TOKENS:
        gamma = min(choose(policy), REQUEST_TOKENS - generated - 1)
        noise = rng.uniform(1 - machine.noise, 1 + machine.noise)
        accepted, draft_ms = 0, 0.0
        verify_ms = machine.plain_ms * (1 + machine.verify_growth * gamma) * noise
        interval_ms = verify_ms
        if gamma:
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            draft_ms = (machine.draft_ms_per_token * gamma + machine.catch_up_ms * since_draft) * noise
            interval_ms += draft_ms + (machine.recovery_ms if accepted < gamma else 0.0)
            since_draft = 0
        else:
            since_draft += 1
        record = StepRecord(index=index, position=generated, generated=generated, draft_length=gamma,
                            draft_model_tokens=gamma, accepted=accepted, bonus=bool(gamma) and accepted == gamma,
                            token=0, emitted=(0,) * (accepted + 1), draft_ms=draft_ms, verify_ms=verify_ms,
                            draft_forward_ms=0.0, verify_forward_ms=0.0, draft_bytes=0, verify_bytes=0,
                            verify_batch=BatchStats(size=1, sessions=1), interval_ms=interval_ms)
        gateway.clock.seconds += interval_ms / 1e3
        if index > 0:  # as gateway.core feeds them
            gateway.costs.observe(gamma, draft_ms, verify_ms if gateway.priced_by_hops else record.rest_ms)
        gateway.plain.observe(record)
        policy.observe(record)
        generated += accepted + 1
        total_ms += interval_ms
        gammas.append(gamma)
        index += 1
    return generated, total_ms, gammas


def speedup(machine: Machine, alpha: float, requests: int = 30, seed: int = 0,
            gateway: Gateway | None = None) -> tuple[float, list[list[int]]]:
    """AUTO's goodput over plain decoding's, the two taking turns request by request on one
    machine; and AUTO's γ per step of each request."""
    rng = random.Random(seed)
    gateway = gateway or Gateway.fresh()
    auto = [0, 0.0]
    plain = [0, 0.0]
    traces = []
    for _ in range(requests):
        tokens, ms, gammas = run_request(gateway.auto(), machine, alpha, gateway, rng)
        auto[0] += tokens
        auto[1] += ms
        traces.append(gammas)
        tokens, ms, _ = run_request(FixedPolicy(0), machine, alpha, gateway, rng)
        plain[0] += tokens
        plain[1] += ms
    return (auto[0] / auto[1]) / (plain[0] / plain[1]), traces


def fixed_speedup(machine: Machine, alpha: float, gamma: int, seed: int = 0) -> float:
    """Fixed γ's goodput over plain decoding's on the same machine: the truth AUTO is held to."""
    rng = random.Random(seed)
    gateway = Gateway.fresh()
    spec = run_request(FixedPolicy(gamma), machine, alpha, gateway, rng)
    plain = run_request(FixedPolicy(0), machine, alpha, gateway, rng)
    return (spec[0] / spec[1]) / (plain[0] / plain[1])


# A fast machine serving sampled requests: the draft costs 0.37 of a plain step a token, and
# a rejecting step's recovery hop another 0.4 that the hops do not show (the 2-core
# EPYC at T = 1).
FAST_SAMPLED = Machine(plain_ms=5.3, draft_ms_per_token=1.95, verify_growth=0.08, recovery_ms=2.0, catch_up_ms=0.3)
# A slow machine, where the target's step is dear and the draft cheap.
SLOW = Machine(plain_ms=16.0, draft_ms_per_token=2.0, verify_growth=0.04)
# Speculation pays on OPEN; HIDDEN adds a recovery hop that turns it into a loss.
OPEN = Machine(plain_ms=5.3, draft_ms_per_token=1.0, verify_growth=0.08)
HIDDEN = Machine(plain_ms=5.3, draft_ms_per_token=1.0, verify_growth=0.08, recovery_ms=6.0)


@pytest.mark.parametrize("seed", range(3))
def test_where_speculation_loses_auto_decodes_plainly_and_keeps_within_three_percent(seed):
    assert max(fixed_speedup(FAST_SAMPLED, 0.4, gamma) for gamma in (1, 2, 4)) < 0.95  # it does lose here
    ratio, traces = speedup(FAST_SAMPLED, 0.4, seed=seed)
    assert ratio >= 0.97, ratio
    late = [g for trace in traces[10:] for g in trace]
    assert late.count(0) > 0.8 * len(late), late


@pytest.mark.parametrize("seed", range(3))
def test_where_speculation_wins_auto_speculates(seed):
    best = max(fixed_speedup(SLOW, 0.8, gamma) for gamma in (2, 4, 6))
    assert best > 1.5
    ratio, traces = speedup(SLOW, 0.8, seed=seed)
    assert ratio >= 1.1 and ratio >= 0.85 * best, (ratio, best)


@pytest.mark.parametrize("priced_by_hops", [False, True], ids=["whole-step costs", "hop costs"])
def test_a_cost_the_hops_do_not_show_turns_a_win_into_a_loss_and_auto_follows(priced_by_hops):
    """The same machine but for a recovery hop the hops do not show: without it speculating
    pays, with it it loses. Costs measured over whole steps price it; a model priced by its
    hops alone misses it, and the floor holds where the model fails."""
    assert fixed_speedup(OPEN, 0.5, 2) > 1.05 and fixed_speedup(HIDDEN, 0.5, 2) < 0.9
    assert speedup(OPEN, 0.5, gateway=Gateway.fresh(priced_by_hops))[0] >= 1.03
    assert speedup(HIDDEN, 0.5, gateway=Gateway.fresh(priced_by_hops))[0] >= 0.97


@pytest.mark.parametrize("seed", range(3))
def test_the_floor_holds_where_the_cost_model_misses_a_cost(seed):
    ratio, _ = speedup(HIDDEN, 0.5, seed=seed, gateway=Gateway.fresh(priced_by_hops=True))
    assert ratio >= 0.97, ratio


def test_speculation_comes_back_when_the_traffic_changes():
    """K collapsing to 0 and never recovering, as users of adaptive schedules elsewhere report:
    after many requests whose draft was never right, a run of requests it suits is
    speculated again within a few requests, though the bursts had thinned out to the
    longest spacing."""
    gateway = Gateway.fresh()
    speedup(SLOW, 0.02, requests=40, gateway=gateway)
    assert gateway.schedule.interval >= MAX_INTERVAL // 4, gateway.schedule
    assert gateway.schedule.pooled_speedup(1, gateway.plain.ms_per_token(1)) < 1.0  # new requests start shut
    ratio, traces = speedup(SLOW, 0.85, requests=20, gateway=gateway, seed=1)
    late = [g for trace in traces[5:] for g in trace]
    assert sum(g > 0 for g in late) > 0.8 * len(late) and ratio >= 1.3, ratio


def test_a_request_that_keeps_winning_does_not_starve_a_shut_one_of_bursts():
    """Two requests of one kind in flight, taking steps in turn: one open and winning (a verdict
    every 8 of its steps), one shut. The shut one still gets its burst once the spacing's
    plain steps have passed."""
    schedule = FloorSchedule()
    bursts = 0
    for step in range(1, 200):
        if step % 8 == 0:
            schedule.record(won=True, burst=False)  # the open request's verdict
        bursts += schedule.burst_due(load=2)  # the shut request's plain step
    assert bursts >= 199 // (FIRST_INTERVAL + 2 * 8) - 1, bursts


def test_a_shut_floor_foresees_its_plain_steps_for_the_verifier_to_run_ahead():
    gateway = Gateway.fresh()
    speedup(FAST_SAMPLED, 0.4, requests=3, gateway=gateway, seed=1)  # the pool says speculating loses
    policy = gateway.auto()
    assert choose(policy) == 0
    assert policy.plain_steps_ahead(8) == min(8, gateway.schedule.steps_to_burst()) > 0


def test_a_request_with_no_plain_figure_to_compare_with_measures_plain_decoding():
    """Every request speculating and nothing decoding plainly: after a burst's worth of
    steps the floor takes a few plain steps, to have plain decoding's rate at this load."""
    gateway = Gateway.fresh()
    rng = random.Random(0)
    tokens, ms, gammas = run_request(gateway.auto(prior_alpha=0.9), SLOW, 0.9, gateway, rng)
    assert 0 in gammas[1:20] and gateway.plain.ms_per_token(1) is not None, gammas


# -- through the services ---------------------------------------------------------------------

def make_deep_twin(draft: Path, directory: Path, dead_layers: int) -> None:
    """A target that computes exactly what `draft` computes, at the cost of `dead_layers` more
    decoder layers: each adds nothing to the residual stream (its attention and MLP output
    projections are zero) but costs a layer's forward all the same. A model with set step
    costs: greedy acceptance is 100%, and the target's step costs what its depth says."""
    small = AutoModelForCausalLM.from_pretrained(draft)
    config = LlamaConfig(**{**small.config.to_dict(),
                            "num_hidden_layers": small.config.num_hidden_layers + dead_layers})
    deep = LlamaForCausalLM(config)
    deep.load_state_dict(small.state_dict(), strict=False)
    with torch.no_grad():
        for layer in deep.model.layers[small.config.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    deep.save_pretrained(directory)
    AutoTokenizer.from_pretrained(draft).save_pretrained(directory)


def auto_speculated(stack, prompts: int = 12) -> list[int]:
    """γ per step of AUTO's last three requests (first steps left out: they prefill); each
    request's greedy output checked against plain decoding's."""
    lengths = []
    for i in range(prompts):
        prompt = f"def function_{i}(values):\n    total = {i}\n"
        auto = stack.stub.Generate(request(prompt, mode="AUTO", max_new_tokens=40))
        off = stack.stub.Generate(request(prompt, mode="OFF", max_new_tokens=40))
        assert list(auto.token_ids) == list(off.token_ids)
        if i >= prompts - 3:
            lengths += list(auto.stats.draft_lengths)[1:]
    return lengths


def test_auto_speculates_where_the_target_is_dear_and_its_draft_agrees(model_dirs, tmp_path):
    """A target 40 layers deeper than its draft and computing the same function: speculating
    saves whole target steps, and AUTO does it."""
    dirs = {**model_dirs, "target": tmp_path / "deep", "twin": model_dirs["unrelated"]}
    make_deep_twin(model_dirs["unrelated"], dirs["target"], dead_layers=40)
    stack = start_stack(dirs, drafts=("twin",), draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    try:
        lengths = auto_speculated(stack)
        assert sum(gamma > 0 for gamma in lengths) > 0.8 * len(lengths), lengths
    finally:
        stack.close()


@pytest.mark.parametrize("slow", ["draft", "verifier"])
def test_auto_decodes_plainly_where_each_reply_of_a_worker_crosses_a_slow_link(model_dirs, slow):
    """Each of one worker's replies held back 40 ms (a worker in another zone), while a step of
    the tiny models here takes a few ms. Behind a slow draft link every speculative step
    pays 40 ms more. Behind a slow verifier link, plain decoding pays nothing for it: the
    verifier scores plain steps ahead (`verifier_service.runahead`), so their replies
    overlap the wait, while a speculative step waits its reply out; plain decoding measured
    3 ms a token there, speculating 10 to 15. AUTO decodes plainly behind either."""
    front, proxies = proxy_front(slow)
    stack = start_stack(model_dirs, front=front, drafts=("close",), draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    try:
        proxies[slow].latency_s = 0.04
        lengths = auto_speculated(stack)
        assert sum(gamma > 0 for gamma in lengths) < 0.25 * len(lengths), lengths
    finally:
        stack.close()


def test_the_floor_and_plain_decodings_goodput_are_in_prometheus():
    """An operator asking why AUTO decodes plainly reads plain decoding's goodput and the
    floor's last verdict from /metrics."""
    gateway = Gateway.fresh(priced_by_hops=True)
    speedup(HIDDEN, 0.5, requests=6, gateway=gateway)
    registry = CollectorRegistry()
    snapshot = floor_snapshot(gateway.plain, {("d->t", "code", False): gateway.schedule})
    registry.register(AcceptanceCollector(AcceptanceStats(), floors=lambda: snapshot))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    (plain,) = families["specd_plain_goodput_tokens_per_ms"].samples
    assert plain.labels == {"load": "1"} and plain.value == pytest.approx(1 / HIDDEN.plain_ms, rel=0.1)
    labels = {"model_pair": "d->t", "task_type": "code", "sampling": "sampled"}
    (pooled,) = families["specd_spec_decode_floor_speedup"].samples
    (interval,) = families["specd_spec_decode_floor_burst_interval"].samples
    assert pooled.labels == interval.labels == labels
    assert pooled.value < 1 and interval.value > 16
