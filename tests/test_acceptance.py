"""Acceptance statistics (sums, windows, labels), the cost model, and the Prometheus format."""
from __future__ import annotations

import re

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conftest import request
from gateway.edge.metrics import AcceptanceCollector
from gateway.stats.acceptance import AcceptanceStats, Counts, bucket
from gateway.stats.costmodel import StepCosts, best_draft_length, expected_tokens, expected_tokens_from_curve
from gateway.stats.paircosts import PairCosts
from specd.v1 import gateway_pb2


def test_counts_sum_steps_and_positions():
    counts = Counts()
    counts.add(draft_length=4, accepted=2, emitted=3, generated_before=0)
    counts.add(draft_length=4, accepted=4, emitted=5, generated_before=40)
    counts.add(draft_length=0, accepted=0, emitted=1, generated_before=45)  # a plain step
    assert (counts.steps, counts.drafts, counts.draft_tokens, counts.accepted_tokens) == (3, 2, 8, 6)
    assert counts.emitted_tokens == 8
    assert counts.proposed_per_position == [2, 2, 2, 2]
    assert counts.accepted_per_position == [2, 2, 1, 1]
    assert counts.acceptance_rate == 0.75 and counts.mean_acceptance_length == 4.0
    assert counts.by_generation_bucket == {"0-31": [4, 2], "32-63": [4, 4]}
    assert counts.position_curve() == [1.0, 1.0, 0.5, 1.0]


def test_buckets():
    assert [bucket(n, (32, 128)) for n in (0, 31, 32, 127, 128, 10_000)] == \
        ["0-31", "0-31", "32-127", "32-127", "128+", "128+"]


def test_labels_group_filter_and_window():
    stats = AcceptanceStats(window_steps=3, max_user_segments=2)
    code = stats.labels("d->t", "code", "alice", 10)
    prose = stats.labels("d->t", "general", "bob", 300)
    capped = stats.labels("d->t", "code", "carol", 10)
    assert capped.user_segment == "other" and code.prompt_bucket == "0-31" and prose.prompt_bucket == "128-511"
    for labels, accepted in ((code, 4), (code, 3), (prose, 0), (prose, 1), (capped, 2)):
        stats.record(labels, 4, accepted, accepted + 1, 0)
    by_task = dict((row["task_type"], c) for row, c in stats.query(["task_type"], {}))
    assert by_task["code"].accepted_tokens == 9 and by_task["code"].draft_tokens == 12
    assert by_task["general"].accepted_tokens == 1
    alice = stats.query([], {"user_segment": "alice"})
    assert alice[0][1].drafts == 2
    # The window keeps the 3 most recent steps only.
    (_, window), = stats.query([], {}, window=True)
    assert window.drafts == 3 and window.accepted_tokens == 0 + 1 + 2
    (_, lifetime), = stats.query([], {})
    assert lifetime.drafts == 5 and lifetime.accepted_tokens == 10
    with pytest.raises(ValueError, match="unknown label"):
        stats.query(["model"], {})


def test_expected_tokens_formula_and_curve_agree():
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2)
    assert expected_tokens_from_curve([0.8] * 4, 4) == pytest.approx(expected_tokens(0.8, 4))


def test_step_costs_fit_and_ratios():
    costs = StepCosts(weight=1.0)
    assert costs.estimate(4) is None
    for gamma, draft_ms, verify_ms in ((0, 0.0, 10.0), (2, 2.0, 11.0), (4, 4.0, 12.0)):
        costs.observe(gamma, draft_ms, verify_ms)
    assert costs.target_step_ms() == 10.0
    assert costs.estimate(3).draft_ms == pytest.approx(3.0) and costs.estimate(3).verify_ms == pytest.approx(11.5)
    c, v = costs.ratios()
    assert c == pytest.approx(0.1) and v == {0: 1.0, 2: 1.1, 4: 1.2}
    # With cheap drafts and high acceptance, speculate long; with α = 0, do not speculate.
    assert best_draft_length(0.9, costs, [0, 1, 2, 4, 8]) >= 4
    assert best_draft_length(0.0, costs, [0, 1, 2, 4, 8]) == 0


def test_prometheus_exposition_format():
    stats = AcceptanceStats()
    labels = stats.labels("d->t", "code", "", 5)
    stats.record(labels, 4, 3, 4, 0)
    stats.record(labels, 0, 0, 1, 4)
    costs = PairCosts()
    costs.observe("d->t", 4, 2.0, 10.0)
    costs.observe("d->t", 0, 0.0, 9.0)
    registry = CollectorRegistry()
    registry.register(AcceptanceCollector(stats, costs))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    accepted = families["specd_spec_decode_num_accepted_tokens"]
    assert accepted.type == "counter"
    (sample,) = accepted.samples
    assert sample.name == "specd_spec_decode_num_accepted_tokens_total" and sample.value == 3
    assert sample.labels == {"model_pair": "d->t", "task_type": "code", "user_segment": "", "prompt_bucket": "0-31"}
    per_pos = {s.labels["position"]: s.value for s in families["specd_spec_decode_num_accepted_tokens_per_pos"].samples}
    assert per_pos == {"1": 1, "2": 1, "3": 1, "4": 0}
    assert families["specd_spec_decode_num_steps"].samples[0].value == 2
    assert families["specd_spec_decode_target_step_seconds"].samples[0].value == 0.009


def test_gateway_reports_acceptance_stats(stack):
    for draft_model, segment in (("close", "tenant-a"), ("unrelated", "tenant-b")):
        req = request("def fibonacci(n):", max_new_tokens=20, draft_model=draft_model)
        req.user_segment = segment
        req.task_type = "code"
        response = stack.stub.Generate(req)
        assert sum(response.stats.proposed_per_position) == response.stats.proposed_tokens
        assert sum(response.stats.accepted_per_position) == response.stats.accepted_tokens
    reply = stack.stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest(
        group_by=["model_pair"], filter={"task_type": "code", "user_segment": "tenant-a"}))
    assert [dict(r.labels) for r in reply.rows] == [{"model_pair": "close->target"}]
    assert reply.rows[0].acceptance_rate == pytest.approx(reply.rows[0].accepted_tokens / reply.rows[0].draft_tokens)
    assert {c.model_pair for c in reply.costs} >= {"close->target", "unrelated->target"}
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest(group_by=["colour"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_classified_task_type_is_reported(stack):
    response = stack.stub.Generate(request("def fibonacci(n):", max_new_tokens=4, mode="AUTO"))
    assert response.stats.task_type == "code" and response.stats.policy == "cost"


def test_bench_runs_against_a_gateway(stack, tmp_path):
    import argparse

    from specd_cli import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--gateway", stack.gateway_address, "--configs", "fixed:2,ema,cost",
                              "--max-new-tokens", "12", "--draft-model", "close", "--out", str(tmp_path)])
    workload = {"code": ["def fibonacci(n):"], "general": ["The acceptance rate is"]}
    results, costs = bench.run_gateway(args, workload, bench.parse_configs(args.configs))
    assert costs is not None and costs.model_pair == "close->target" and costs.draft_cost_ratio > 0
    assert [r.config.label for r in results] == ["target-only", "fixed γ=2", "ema", "cost (AUTO)"]
    assert all(r.tokens == 24 for r in results)
    assert all(r.same_as_target_only == 2 for r in results)  # greedy: every output is target-only's
    assert results[0].proposed == 0 and results[1].proposed > 0
    assert set(results[1].by_task) == {"code", "general"}
    text = bench.table(results, {}, costs)
    assert "target-only" in text and "measured costs of close->target" in text
    assert len(bench.plots(results, tmp_path)) == 3
    assert (tmp_path / "tokens_per_s.png").stat().st_size > 0


def test_bench_load_stage_takes_rounds_in_turn(stack, tmp_path, capsys, monkeypatch):
    """`--rounds` with `--concurrency`: at each level each configuration runs once a round,
    the rounds in turn (so the machine's drift falls on both alike), each round starting
    with the next configuration (none always runs second), each level's and round's
    requests in user segments of their own (none is drafted from another's responses to
    the same prompts by the suffix cache), and each round's ratio to target-only is
    printed beside the merged table."""
    import argparse
    import json

    from specd_cli import bench

    segments = set()
    build = bench.build_request

    def recording(*args, **kwargs):
        segments.add(kwargs["user_segment"])
        return build(*args, **kwargs)

    monkeypatch.setattr(bench, "build_request", recording)

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--gateway", stack.gateway_address, "--configs", "cost", "--concurrency", "1,2",
                              "--requests-per-level", "2", "--rounds", "2", "--max-new-tokens", "6",
                              "--draft-model", "close", "--out", str(tmp_path)])
    workload = {"code": ["def fibonacci(n):"], "general": ["The acceptance rate is"]}
    assert bench.run_load(args, workload, bench.parse_configs(args.configs)) == 0
    round_lines = [line for line in capsys.readouterr().out.splitlines() if "(round " in line]
    progress = [line.split()[0] + " " + line.split()[1] + (" AUTO" if "AUTO" in line else "") + " "
                + line.split("(round ")[1].rstrip(")") for line in round_lines]
    in_turn = {1: ("target-only", "cost AUTO"), 2: ("cost AUTO", "target-only")}  # round -> who ran when
    assert progress == [f"N={n} {config} {number}" for n in (1, 2) for number in (1, 2)
                        for config in in_turn[number]], progress
    assert len(segments - {"bench-warm-up"}) == 2 * 2 * 2, segments  # configurations × levels × rounds
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["rounds"] == 2 and [row["tokens"] for row in report["rows"]] == [2 * 2 * 6] * 4
    lines = [line for line in (tmp_path / "load.md").read_text().splitlines() if "round by round" in line]
    assert [line.split(" ÷")[0].split() for line in lines] == [["N=1", "cost", "(AUTO)"], ["N=2", "cost", "(AUTO)"]]
    ratios = [line.split("round by round: ")[1].split(" (")[0].split() for line in lines]
    assert all(len(each) == 2 and all(float(r) > 0 for r in each) for each in ratios), ratios
    # Each round's ratio is that round's own, as its progress lines printed it (the merged
    # table's totals once stood in for the first round's).
    rates = {}  # (level, target-only or not, round) -> tokens/s
    for line in round_lines:
        level, label, rate, number = re.match(r"\s*N=(\d+)\s+(.*?)\s+([\d.]+) tokens/s \(round (\d+)\)", line).groups()
        rates[int(level), label == "target-only", int(number)] = float(rate)
    for n, printed in zip((1, 2), ratios, strict=True):
        own = [rates[n, False, number] / rates[n, True, number] for number in (1, 2)]
        assert [float(r) for r in printed] == pytest.approx(own, abs=0.01 + 0.02 * max(own)), (printed, own)


def test_the_merged_table_leaves_each_rounds_results_as_measured():
    from specd_cli.loadbench import LoadResult, merged, round_ratios

    rounds = [[LoadResult("target-only", 8, tokens=100, seconds=1.0), LoadResult("AUTO", 8, tokens=100, seconds=2.0)],
              [LoadResult("target-only", 8, tokens=100, seconds=1.0), LoadResult("AUTO", 8, tokens=100, seconds=0.5)]]
    totals = merged(rounds)
    assert [(r.tokens, r.seconds) for r in totals] == [(200, 2.0), (200, 2.5)]
    assert [(r.tokens, r.seconds) for r in rounds[0]] == [(100, 1.0), (100, 2.0)]
    assert "round by round: 0.50 2.00 (mean 1.25, spread 1.50)" in round_ratios(rounds)


def test_conditional_acceptance_and_measured_prior():
    counts = Counts()
    counts.add(4, 4, 5, 0)  # all four accepted
    counts.add(4, 0, 1, 0)  # first rejected
    # positions reached: 2 at position 1, then 1 at 2..4: 5 reached, 4 accepted
    assert counts.alpha == pytest.approx(4 / 5)
    stats = AcceptanceStats()
    labels = stats.labels("d->t", "code", "", 1)
    assert stats.measured_alpha("d->t", "code") is None
    for _ in range(4):
        stats.record(labels, 4, 4, 5, 0)
        stats.record(labels, 4, 0, 1, 0)
    assert stats.measured_alpha("d->t", "code") == pytest.approx(4 / 5)
    # A task the pair has not served yet starts from the pair's acceptance on its other tasks.
    assert stats.measured_alpha("d->t", "prose") == pytest.approx(4 / 5)
    assert stats.measured_alpha("other->t", "code") is None


def test_task_types_are_capped_like_segments():
    stats = AcceptanceStats(max_task_types=2)
    labels = [stats.labels("d->t", f"role-{n}", "s", 10).task_type for n in range(5)]
    assert labels == ["role-0", "role-1", "other", "other", "other"]
    assert stats.labels("d->t", "role-1", "s", 10).task_type == "role-1"  # known ones keep their name
    # Per segment (a tenant, with API keys): another segment's task types are its own.
    assert [stats.labels("d->t", f"role-{n}", "t", 10).task_type for n in (4, 5, 6)] == ["role-4", "role-5", "other"]
