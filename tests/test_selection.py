"""Draft selection by expected goodput: the bandit starts from the task map, measures every
draft, converges to the better one per (task type, user segment) by acceptance and cost
together, drops a draft the target never agrees with after its trial, and in the gateway
the output stays exact whichever draft serves, with stats.draft_model and share metrics."""
from __future__ import annotations

import random
import urllib.request

from conftest import request, start_stack
from gateway.policy.selection import DraftSelector
from gateway.stats.costmodel import predicted_speedup
from test_cli import free_port
from test_pipeline import reference_greedy
from test_policy import measured_costs


def serve(selector: DraftSelector, acceptance: dict[str, float], rng: random.Random, n: int,
          task: str = "code", segment: str = "acme", spread: float = 0.15) -> list[str]:
    """n requests; a request's α is its draft's mean ± `spread` (uniform: prompts differ).
    Returns the drafts chosen."""
    chosen = []
    for _ in range(n):
        draft = selector.choose(task, segment)
        chosen.append(draft)
        alpha = min(max(acceptance[draft] + rng.uniform(-spread, spread), 0.0), 1.0)
        selector.observe(task, segment, draft, alpha, tokens=round(100 * (1 + 3 * alpha)), ms=100)
    return chosen


def test_bandit_starts_from_the_task_map_then_measures_every_draft():
    selector = DraftSelector(["general", "coder", "tiny"], {"code": "coder"}, rng=random.Random(0))
    chosen = serve(selector, {"general": 0.5, "coder": 0.6, "tiny": 0.2}, random.Random(1), 3)
    assert chosen[0] == "coder"
    assert sorted(chosen) == ["coder", "general", "tiny"]


def test_bandit_converges_to_the_better_draft():
    selector = DraftSelector(["general", "coder", "tiny"], {"code": "general"}, rng=random.Random(0))
    chosen = serve(selector, {"general": 0.55, "coder": 0.7, "tiny": 0.3}, random.Random(1), 300)
    assert chosen[-100:].count("coder") >= 95, {d: chosen[-100:].count(d) for d in set(chosen)}
    arms = selector.snapshot()
    assert abs(arms[("code", "acme", "coder")].alpha - 0.7) < 0.05


def test_a_draft_the_target_never_agrees_with_is_dropped_after_its_trial():
    # The demo's unrelated draft: α ≈ 0 on every prompt, while the others' α varies a lot
    # from prompt to prompt. One request is enough to rule it out.
    selector = DraftSelector(["distilled", "generic", "unrelated"], rng=random.Random(2))
    chosen = serve(selector, {"distilled": 0.7, "generic": 0.6, "unrelated": 0.0}, random.Random(3), 100,
                   spread=0.25)
    assert chosen.count("unrelated") == 1, chosen


def test_a_new_segment_starts_from_the_task_map_then_from_what_other_segments_measured():
    selector = DraftSelector(["distilled", "generic", "unrelated"], {"code": "generic"}, rng=random.Random(6))
    rng = random.Random(7)
    serve(selector, {"distilled": 0.7, "generic": 0.6, "unrelated": 0.0}, rng, 60, segment="acme")
    chosen = serve(selector, {"distilled": 0.7, "generic": 0.6, "unrelated": 0.0}, rng, 30, segment="newco")
    assert chosen[0] == "generic"  # the task map's draft first
    assert "unrelated" not in chosen  # ruled out on acme: no trial of its own is forced
    assert chosen[-10:].count("distilled") >= 9, chosen


def test_a_cheaper_draft_beats_a_more_accurate_costly_one():
    # "big" agrees more but costs 0.9 of a target step per token: at its best γ it is worth
    # less than plain decoding; "small" agrees less at 0.05 per token and pays.
    costs = {"big": measured_costs(9.0), "small": measured_costs(0.5)}
    assert predicted_speedup(0.8, costs["big"], 8) < predicted_speedup(0.6, costs["small"], 8)
    selector = DraftSelector(["big", "small"], speedup=lambda draft, alpha: predicted_speedup(alpha, costs[draft], 8),
                             rng=random.Random(4))
    chosen = serve(selector, {"big": 0.8, "small": 0.6}, random.Random(5), 100)
    assert chosen[-50:].count("small") >= 48, chosen


def test_predicted_speedup_is_one_for_a_useless_draft_and_grows_with_acceptance():
    costs = measured_costs(1.0)
    assert predicted_speedup(0.0, costs, 8) == 1.0  # γ = 0: plain decoding
    speedups = [predicted_speedup(alpha, costs, 8) for alpha in (0.3, 0.5, 0.7, 0.9)]
    assert speedups == sorted(speedups) and speedups[-1] > 3
    assert predicted_speedup(0.9, costs, 2) < speedups[-1]  # a smaller γ bound caps it


def test_bandit_keeps_segments_apart_and_follows_a_change():
    selector = DraftSelector(["a", "b"], rng=random.Random(3), memory=50)
    rng = random.Random(4)
    serve(selector, {"a": 0.7, "b": 0.4}, rng, 200, segment="one")
    serve(selector, {"a": 0.4, "b": 0.7}, rng, 200, segment="two")
    assert serve(selector, {"a": 0.7, "b": 0.4}, rng, 50, segment="one").count("a") >= 45
    assert serve(selector, {"a": 0.4, "b": 0.7}, rng, 50, segment="two").count("b") >= 45
    # Segment one's traffic changes: within a few memories the choice follows it.
    later = serve(selector, {"a": 0.3, "b": 0.7}, rng, 300, segment="one")
    assert later[-50:].count("b") >= 45


def test_gateway_selects_drafts_exactly_and_reports_shares(model_dirs, target_model, tokenizer):
    port = free_port()
    running = start_stack(model_dirs, drafts=("close", "unrelated"), draft_selection="goodput", metrics_port=port)
    try:
        prompt = "def fibonacci(n):"
        expected = reference_greedy(target_model, tokenizer, prompt, 16)
        used = []
        for _ in range(8):
            response = running.stub.Generate(request(prompt, max_new_tokens=16, mode="AUTO"), timeout=60)
            assert list(response.token_ids) == expected  # exact, whichever draft served
            used.append(response.stats.draft_model)
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        running.close()
    assert used[0] == "close"  # the default draft first: no task map here
    assert {"close", "unrelated"} <= set(used)  # both measured
    shares = {line.split('draft_model="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
              for line in exposition.splitlines() if line.startswith("specd_draft_selected_total{")}
    assert shares.keys() == {"close", "unrelated"} and sum(shares.values()) == 8

