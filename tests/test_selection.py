"""Draft selection by measured goodput: the bandit starts from the task map, measures every
draft, converges to the better one per (task type, user segment), and in the gateway the
output stays exact whichever draft serves, with stats.draft_model and share metrics."""
from __future__ import annotations

import random
import urllib.request

from conftest import request, start_stack
from specd.selection import DraftSelector
from test_cli import free_port
from test_pipeline import reference_greedy


def serve(selector: DraftSelector, goodput: dict[str, float], rng: random.Random, n: int,
          task: str = "code", segment: str = "acme") -> list[str]:
    """n requests; each draft's goodput is its mean ± 30% noise. Returns the drafts chosen."""
    chosen = []
    for _ in range(n):
        draft = selector.choose(task, segment)
        chosen.append(draft)
        selector.observe(task, segment, draft, tokens=round(100 * goodput[draft] * rng.uniform(0.7, 1.3)), ms=100)
    return chosen


def test_bandit_starts_from_the_task_map_then_measures_every_draft():
    selector = DraftSelector(["general", "coder", "tiny"], {"code": "coder"}, rng=random.Random(0))
    chosen = serve(selector, {"general": 1.0, "coder": 1.2, "tiny": 0.5}, random.Random(1), 3)
    assert chosen[0] == "coder"
    assert sorted(chosen) == ["coder", "general", "tiny"]


def test_bandit_converges_to_the_better_draft():
    selector = DraftSelector(["general", "coder", "tiny"], {"code": "general"}, rng=random.Random(0))
    chosen = serve(selector, {"general": 1.0, "coder": 1.4, "tiny": 0.6}, random.Random(1), 300)
    assert chosen[-100:].count("coder") >= 95, {d: chosen[-100:].count(d) for d in set(chosen)}
    arms = selector.snapshot()
    assert abs(arms[("code", "acme", "coder")].mean - 1.4) < 0.1


def test_bandit_keeps_segments_apart_and_follows_a_change():
    selector = DraftSelector(["a", "b"], rng=random.Random(3), memory=50)
    rng = random.Random(4)
    serve(selector, {"a": 1.0, "b": 0.5}, rng, 200, segment="one")
    serve(selector, {"a": 0.5, "b": 1.0}, rng, 200, segment="two")
    assert serve(selector, {"a": 1.0, "b": 0.5}, rng, 50, segment="one").count("a") >= 45
    assert serve(selector, {"a": 0.5, "b": 1.0}, rng, 50, segment="two").count("b") >= 45
    # Segment one's traffic changes: within a few memories the choice follows it.
    later = serve(selector, {"a": 0.4, "b": 1.0}, rng, 300, segment="one")
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
