"""AUTO's load cap starts where measured costs say: the workers time their forwards at
load, the gateway times its overheads at start-up, and each load level's first cap is the
γ those costs favour (gateway/policy/priors.py), not the longest draft."""
from __future__ import annotations

import random

import pytest

from conftest import request
from gateway.policy.loadcap import LoadCap
from gateway.policy.priors import ForwardTable, Overheads, prior_caps, prior_rates
from gateway.stats.costmodel import LOAD_BUCKETS
from specd.contract import MAX_DRAFT_LENGTH

# A target whose forward grows with the tokens it carries, as on a CPU; a cheap draft.
TARGET = ForwardTable([(b, w, 8.0 + 0.9 * b * w) for b in (1, 8, 32) for w in (1, 2, 5, 9)])
DRAFT = ForwardTable([(b, w, 1.0 + 0.05 * b * w) for b in (1, 8, 32) for w in (1, 2, 5, 9)])


def test_the_table_reads_between_and_past_what_was_measured():
    assert TARGET.ms(1, 1) == pytest.approx(8.9)
    assert TARGET.ms(8, 3) == pytest.approx(8.0 + 0.9 * 8 * 3)  # between widths
    assert TARGET.ms(4, 1) == pytest.approx((TARGET.ms(1, 1) * 4 + TARGET.ms(8, 1) * 3) / 7)  # between batches
    assert TARGET.ms(64, 17) > TARGET.ms(32, 9)  # extended past the largest


def test_noisy_costs_never_price_a_forward_at_nothing():
    """A worker timed at load on a busy machine: its 32-session forwards measured cheaper than
    its 16-session ones. Read linearly past the table, the cost at 64 sessions fell to
    nothing and the prices divided by it (every request of a fresh server failed with
    INTERNAL, once, here). The table never falls, and every price is a finite rate."""
    noisy = [(b, w, {1: 5.0, 2: 6.0, 4: 8.0, 8: 12.0, 16: 30.0, 32: 14.0}[b] * (1 + 0.1 * w))
             for b in (1, 2, 4, 8, 16, 32) for w in (1, 2, 3, 5, 9)]
    table = ForwardTable(noisy)
    assert table.ms(32, 1) >= table.ms(16, 1) and table.ms(64, 9) >= table.ms(32, 9) > 0
    rates = prior_rates(table, ForwardTable(noisy), alpha=0.7, max_draft_length=8, overheads=Overheads(0.0, 0.0))
    assert all(0 < rate < float("inf") for at_load in rates.values() for rate in at_load)


def test_no_grid_of_positive_times_prices_a_forward_at_nothing_where_the_priors_read():
    """Past the widest measured forward each batch's line runs on at its own slope, and a
    larger batch's ran below a smaller one's: read on past the largest batch, the price at
    64 sessions and 16 tokens fell to nothing and a request failed with INTERNAL (the fuzz
    test found it on a busy machine). Any grid of positive times, however noisy, prices
    every forward the priors read above nothing."""
    rng = random.Random(0)
    batches, widths = (1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9)
    for _ in range(2000):
        table = ForwardTable([(b, w, rng.choice([rng.uniform(1e-4, 5.0), 1e-6])) for b in batches for w in widths])
        assert min(table.ms(load, width) for load in LOAD_BUCKETS for width in range(1, MAX_DRAFT_LENGTH + 2)) > 0


def test_costs_that_are_not_a_grid_of_positive_times_give_no_prior():
    assert not ForwardTable([(1, 1, 5.0), (1, 2, 0.0)])
    assert not ForwardTable([(1, 1, 5.0), (2, 1, 6.0), (1, 2, 7.0)])  # (2, 2) missing
    assert not ForwardTable([])


def test_speculation_is_priced_out_as_the_load_grows():
    caps = prior_caps(TARGET, DRAFT, alpha=0.7, max_draft_length=8, overheads=Overheads(0.2, 1.0))
    assert caps[1] >= 3  # alone, verifying more positions is nearly free: speculate
    assert caps[32] == 0  # 32 sessions × γ+1 tokens each: plain decoding serves more
    assert all(caps[a] >= caps[b] for a, b in zip(sorted(caps), sorted(caps)[1:]))  # never more under more load
    # A poor acceptance prices speculation out sooner; a large overhead per hop, too.
    assert prior_caps(TARGET, DRAFT, 0.3, 8, Overheads(0.2, 1.0))[8] <= caps[8]
    assert prior_caps(TARGET, DRAFT, 0.7, 8, Overheads(0.2, 20.0))[1] == 0


def test_a_level_starts_at_the_prior_and_says_so():
    rates = prior_rates(TARGET, DRAFT, alpha=0.7, max_draft_length=8, overheads=Overheads(0.2, 1.0))
    cap = LoadCap(8, price=lambda alpha: rates)
    cap.requests = 32  # 32 requests in flight: the load floor
    assert cap.cap() == 0 and cap.origins() == {32: "prior"}
    cap.requests = 1000  # past the loads priced: the heaviest's
    assert cap.cap() == 0
    assert LoadCap(8).cap() == 8  # no prior: alone
    # The predicted ratios are evidence already: one trial of cap 1 that measured 8% more
    # goodput than plain decoding does not overturn a prior that predicts much less.
    level = cap._level(32)
    verdict = level.verdicts[(0, 1)]
    assert verdict.trials == 2 and verdict.mean < 0
    assert verdict.add(0.08) < 0.05


def test_a_level_on_the_prior_is_priced_again_at_the_pairs_acceptance():
    """Priced at a task's prior acceptance (0.7), four sessions start at γ = 2; the pair's
    draft then measures 0.3, where the same costs favour plain decoding, and the level
    moves there at once, before any trial, still on the prior. A level a trial decided
    keeps what the trial said. (SmolLM2's draft, α ≈ 0.33, started at γ = 5 at 8 in flight
    and lost for about 40 s of trials: docs/loadcap.md.)"""
    from gateway.step.records import StepRecord
    from specd.steps import BatchStats

    price = lambda alpha: prior_rates(TARGET, DRAFT, alpha, max_draft_length=8, overheads=Overheads(0.2, 1.0))  # noqa: E731
    cap = LoadCap(8, price=price, alpha=0.7)
    cap.requests = 4
    assert (cap.cap(), cap.origin()) == (2, "prior")
    decided = cap._level(8)
    decided.best, decided.decided, decided.all_rates = 3, 1, {3: 0.1}  # as if a trial there had raised it
    rng = random.Random(0)

    def step(index: int, gamma: int, sessions: int = 4) -> StepRecord:
        accepted = 0
        while accepted < gamma and rng.random() < 0.3:
            accepted += 1
        return StepRecord(index=index, position=0, generated=0, draft_length=gamma, draft_model_tokens=gamma,
                          accepted=accepted, bonus=accepted == gamma, token=0, emitted=(0,) * (accepted + 1),
                          draft_ms=1.0, verify_ms=10.0, draft_forward_ms=0.0, verify_forward_ms=0.0, draft_bytes=0,
                          verify_bytes=0, verify_batch=BatchStats(size=sessions, tokens=sessions, sessions=sessions),
                          interval_ms=12.0)

    for index in range(1, 81):
        cap.observe(cap.cap(), step(index, cap.cap()))
    assert abs(cap.priced_alpha - 0.3) < 0.15
    assert (cap.cap(), cap.origin()) == (0, "prior")
    assert cap._level(4).verdicts[(0, 2)].mean < 0  # the ratios weighed in are the new prices
    assert cap._level(8).best == 3


def test_a_pair_is_first_priced_at_the_acceptance_its_draft_card_measured():
    """A draft whose card says it is accepted 0.34 of the time (SmolLM2's, from `specd
    distill`) starts its load cap priced there, not at the task default of 0.7 that puts
    a long draft at every load; a draft without a card starts at the default."""
    import json

    from gateway.policy.shared import PolicyTables
    from specd.steps import ModelInfo

    costs = tuple((b, w, 8.0 + 0.9 * b * w) for b in (1, 8, 32) for w in (1, 2, 5, 9))
    card = json.dumps({"acceptance_vs_target": {"chat": {"alpha": 0.30, "gamma": 4},
                                                "code": {"alpha": 0.38, "gamma": 4}}})
    target = ModelInfo("target", 100, 512, "t", (0,), forward_costs=costs)
    drafts = {"carded": ModelInfo("carded", 100, 512, "t", (0,), card_json=card,
                                  forward_costs=tuple((b, w, 1.0 + 0.05 * b * w) for b, w, _ in costs)),
              "bare": ModelInfo("bare", 100, 512, "t", (0,), card_json="not json")}
    tables = PolicyTables(MAX_DRAFT_LENGTH, 0.7, target, drafts)
    tables.overheads = Overheads(0.5, 0.5)
    assert tables.pair_alpha("carded") == pytest.approx(0.34)
    assert tables.pair_alpha("bare") == tables.pair_alpha("unknown") == 0.7
    shared = tables.for_request("carded|target", "carded", "general", greedy=True, in_flight=8)
    assert shared.load_cap.priced_alpha == pytest.approx(0.34)
    price = tables.pricing("carded")
    alpha = tables.pair_alpha("carded")
    assert price is not None and shared.load_cap.prior == price(alpha) == tables.prior("carded") != price(0.7)


def test_a_fresh_gateway_measures_its_overheads_and_prices_its_caps(stack):
    core = stack.gateway.servicer.core
    overheads = core.policies.overheads
    assert overheads is not None and overheads.spec_ms >= overheads.plain_ms >= 0
    assert core.backend.target.forward_costs  # the verifier timed its forwards at load
    prior = core.policies.prior("close")
    assert prior is not None and set(prior) >= {1, 8, 32}
    # The probes were the doctor's kind of request: they count in no statistic.
    assert not stack.stub.GetAcceptanceStats(request_stats()).rows or all(
        row.labels.get("user_segment") != "specd-doctor" for row in stack.stub.GetAcceptanceStats(
            request_stats()).rows)
    assert stack.stub.Generate(request("def fibonacci(n):", max_new_tokens=4, mode="AUTO")).stats.generated_tokens == 4


def request_stats():
    from specd.v1 import gateway_pb2

    return gateway_pb2.AcceptanceStatsRequest(group_by=["user_segment"])


def test_the_gateway_says_where_its_caps_start(stack):
    """GetGatewayInfo (what `specd doctor` prints) carries each load level's prior and cap."""
    from specd.v1 import gateway_pb2
    from specd_cli.doctor import check_load_caps

    info = stack.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
    pairs = {row.model_pair for row in info.load_caps}
    for pair in pairs:
        loads = [row.load for row in info.load_caps if row.model_pair == pair]
        assert loads == sorted(loads) and {1, 8} <= set(loads)
    assert pairs
    assert all(row.cap == row.prior for row in info.load_caps if row.origin == "prior")  # until a trial moves it
    finding = check_load_caps(info)
    assert finding.check == "load caps" and "8: γ≤" in finding.evidence


def test_a_step_says_which_cap_it_ran_under():
    """The cost policy reports the cap in force and its origin; the trace carries them."""
    from gateway.step.records import StepRecord
    from gateway.step.tracing import step_attributes

    rates = prior_rates(TARGET, DRAFT, alpha=0.7, max_draft_length=8, overheads=Overheads(0.2, 1.0))
    cap = LoadCap(8, price=lambda alpha: rates)
    assert cap.origin() == "alone"
    cap.requests = 32
    assert (cap.cap(), cap.origin()) == (0, "prior")
    record = StepRecord(index=1, position=10, generated=1, draft_length=0, accepted=0, bonus=False, token=5,
                        emitted=(5,), draft_ms=0.0, verify_ms=1.0, draft_forward_ms=0.0, verify_forward_ms=1.0,
                        draft_bytes=0, verify_bytes=10, load_cap=(0, "prior"))
    attributes = step_attributes(record)
    assert attributes["specd.gamma.cap"] == 0 and attributes["specd.gamma.cap_origin"] == "prior"
