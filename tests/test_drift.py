"""Drift detection: a segment's sliding-window acceptance against its lifetime (or a pinned
baseline). The verdict fires on a real drop and stays quiet on noise; the gateway exports
it as a gauge and refuses a bad baseline file with a message that says what to write."""
from __future__ import annotations

import json
import random
import urllib.request

import pytest

from conftest import request, start_stack
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from gateway.stats.acceptance import AcceptanceStats
from gateway.stats.drift import DriftSettings, Sample, judge, load_baseline
from specd.config import ServerSettings
from specd.contract import baseline_document
from test_cli import free_port

GAMMA = 4


def geometric_step(rng: random.Random, alpha: float, gamma: int = GAMMA) -> int:
    """Accepted draft tokens of one step of γ when each is accepted with probability α."""
    accepted = 0
    while accepted < gamma and rng.random() < alpha:
        accepted += 1
    return accepted


def feed(stats: AcceptanceStats, labels, rng: random.Random, alpha: float, steps: int,
         gamma: int = GAMMA) -> list[bool]:
    """Record `steps` steps of γ at acceptance α; the drift flag after each one."""
    flags = []
    for _ in range(steps):
        accepted = geometric_step(rng, alpha, gamma)
        stats.record(labels, gamma, accepted, accepted + 1, 0)
        verdict = stats.drift(labels)
        flags.append(verdict is not None and verdict.flagged)
    return flags


def test_a_drop_of_20_points_raises_the_flag_within_the_window():
    stats = AcceptanceStats(window_steps=300)
    labels = stats.labels("d->t", "code", "acme", 40)
    rng = random.Random(0)
    assert not any(feed(stats, labels, rng, 0.8, 3000))
    flags = feed(stats, labels, rng, 0.55, 300)
    assert flags[-1], stats.drift(labels)
    verdict = stats.drift(labels)
    assert verdict.reference == "lifetime" and verdict.drop > 0.1 and verdict.z >= 3


@pytest.mark.parametrize("seed", range(10))
def test_noise_never_raises_the_flag(seed):
    # The same acceptance all along: whatever the window holds is noise, checked after every step.
    stats = AcceptanceStats(window_steps=200)
    labels = stats.labels("d->t", "code", "acme", 40)
    assert not any(feed(stats, labels, random.Random(seed), 0.6, 4000))


def test_a_longer_draft_at_the_same_acceptance_raises_no_flag():
    # When load falls the policy lengthens drafts: accepted / proposed drops from 0.62 at
    # γ=2 to 0.33 at γ=8 while α stays 0.7. That is not drift.
    stats = AcceptanceStats(window_steps=300)
    labels = stats.labels("d->t", "code", "acme", 40)
    rng = random.Random(5)
    assert not any(feed(stats, labels, rng, 0.7, 3000, gamma=2))
    assert not any(feed(stats, labels, rng, 0.7, 600, gamma=8))
    verdict = stats.drift(labels)
    assert abs(verdict.window_alpha - 0.7) < 0.05 and abs(verdict.reference_alpha - 0.7) < 0.05


def test_other_segments_keep_their_own_reference():
    # The window holds the last steps of all traffic: 1000 keep enough of both segments.
    stats = AcceptanceStats(window_steps=1000)
    rng = random.Random(1)
    steady, falling = stats.labels("d->t", "code", "a", 40), stats.labels("d->t", "code", "b", 40)
    for _ in range(2000):
        feed(stats, steady, rng, 0.7, 1)
        feed(stats, falling, rng, 0.7, 1)
    # 400 steps at α 0.3 leave 300 of segment b's at 0.7 in the window: its pooled α is
    # about 0.53 (a step rejected early reaches few positions, so it weighs less).
    feed(stats, falling, rng, 0.3, 400)
    table = dict(stats.drift_table())
    assert table[("d->t", "code", "b")].flagged
    assert not table[("d->t", "code", "a")].flagged


def test_a_pinned_baseline_replaces_lifetime_acceptance():
    stats = AcceptanceStats(window_steps=300, baseline={("d->t", "code"): 0.9})
    labels = stats.labels("d->t", "code", "acme", 40)
    flags = feed(stats, labels, random.Random(2), 0.6, 300)  # never better since start-up
    verdict = stats.drift(labels)
    assert flags[-1] and verdict.reference == "baseline" and verdict.reference_alpha == 0.9


def test_too_few_drafts_give_no_verdict():
    assert judge(Sample(20, 80, 0), 0.9, DriftSettings(min_drafts=100)) is None
    assert judge(Sample(200, 800, 700), Sample(5, 20, 20), DriftSettings(min_drafts=100)) is None


def test_baseline_file_round_trip_and_bad_files(tmp_path):
    good = tmp_path / "baseline.json"
    good.write_text(json.dumps(baseline_document([("d->t", "code", 0.7123, 800)])))
    assert load_baseline(good) == {("d->t", "code"): 0.7123}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"baselines": [{"model_pair": "d->t", "task_type": "code"}]}))
    with pytest.raises(ValueError, match="specd doctor --write-baseline"):
        load_baseline(bad)
    bad.write_text(json.dumps({"baselines": [{"model_pair": "d->t", "task_type": "code", "alpha": 7}]}))
    with pytest.raises(ValueError, match=r"α must be in \[0, 1\]"):
        load_baseline(bad)
    # A file that pinned accepted / proposed is refused: it is not comparable with α.
    bad.write_text(json.dumps({"baselines": [{"model_pair": "d->t", "task_type": "code", "acceptance_rate": 0.5}]}))
    with pytest.raises(ValueError, match="moves with γ; write it again with `specd doctor --write-baseline`"):
        load_baseline(bad)


def test_gateway_refuses_a_bad_baseline_before_dialling_workers(tmp_path, stack):
    missing = tmp_path / "nowhere.json"
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0), verifier_address="127.0.0.1:1",
                               acceptance_baseline=missing)
    with pytest.raises(ValueError, match="acceptance baseline"):
        stack.loop.run(create_gateway(settings))


def test_gateway_exports_the_drift_gauge_against_a_pinned_baseline(model_dirs, tmp_path):
    # The close draft agrees far less than a 0.99 baseline: after enough drafts the flag is up.
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(baseline_document([("close->target", "code", 0.99, 1000)])))
    port = free_port()
    running = start_stack(model_dirs, drafts=("close",), acceptance_baseline=baseline, metrics_port=port,
                          drift=DriftSettings(min_drafts=20))
    try:
        for seed in range(1, 5):
            req = request(f"def f{seed}(x):", max_new_tokens=24, draft_model="close")
            req.task_type = "code"
            running.stub.Generate(req, timeout=60)
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        running.close()
    labels = 'model_pair="close->target",reference="baseline",task_type="code",user_segment=""'
    flagged = [line for line in exposition.splitlines()
               if line.startswith("specd_spec_decode_acceptance_drift_flagged{")]
    assert flagged, exposition
    assert all(label in flagged[0] for label in labels.split(",")) and flagged[0].endswith(" 1.0")
    drift = [line for line in exposition.splitlines() if line.startswith("specd_spec_decode_acceptance_drift{")]
    assert float(drift[0].rsplit(" ", 1)[1]) > 0.1
