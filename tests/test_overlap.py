"""Overlapped speculation: the draft pre-drafts the next step while the target verifies.

Exactness is unchanged: greedy equals transformers' generate, a seed gives the same
output with overlap on or off, and nothing pre-drafted leaks into the output when every
verdict misses. (The sampled distribution with overlap on is checked by
tests/test_sampled_distribution.py.)
"""
from __future__ import annotations

import time
import urllib.request

import pytest

from conftest import request, start_stack
from test_cli import free_port
from test_pipeline import reference_greedy

PROMPTS = ["def fibonacci(n):", "The acceptance rate is", "class Cache:\n    def", "Speculative decoding lets"]


def overlapped(prompt: str, overlap: bool = True, **kwargs):
    req = request(prompt, **kwargs)
    req.speculation.overlap = overlap
    return req


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_with_overlap_equals_generate_and_hits(stack, target_model, tokenizer, gamma):
    hits = 0
    for prompt in PROMPTS:
        response = stack.stub.Generate(overlapped(prompt, max_new_tokens=40, draft_length=gamma, draft_model="close"))
        assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 40), prompt
        assert 0 < response.stats.pre_draft_steps < response.stats.steps
        hits += response.stats.pre_draft_hits
    assert hits > 0  # the close draft guesses verdicts right some of the time


def test_auto_with_overlap_stays_exact(stack, target_model, tokenizer):
    for prompt in PROMPTS[:2]:
        response = stack.stub.Generate(overlapped(prompt, max_new_tokens=40, mode="AUTO", draft_model="close"))
        assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 40)


@pytest.mark.parametrize("draft_model", ["close", "unrelated"])
def test_a_seed_gives_the_same_output_with_overlap_on_or_off(stack, draft_model):
    for seed in (3, 11):
        kwargs = dict(temperature=1.0, top_k=50, seed=seed, max_new_tokens=32, draft_model=draft_model)
        sequential = stack.stub.Generate(overlapped(PROMPTS[0], overlap=False, **kwargs))
        first = stack.stub.Generate(overlapped(PROMPTS[0], **kwargs))
        second = stack.stub.Generate(overlapped(PROMPTS[0], **kwargs))
        assert list(first.token_ids) == list(second.token_ids) == list(sequential.token_ids)
        assert list(first.stats.draft_lengths) == list(sequential.stats.draft_lengths)


def _gauge(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))


def test_every_verdict_missing_changes_nothing(model_dirs, target_model, tokenizer):
    """Only the all-accepted branch, and a draft the target never agrees with four times
    in a row: no step can be answered from a branch; the output is the target's."""
    metrics_port = free_port()
    running = start_stack(model_dirs, pre_draft_branches="bonus", draft_metrics_port=metrics_port)
    try:
        for prompt in PROMPTS:
            response = running.stub.Generate(overlapped(prompt, max_new_tokens=32, draft_length=4,
                                                        draft_model="unrelated"))
            assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 32)
            assert response.stats.pre_draft_steps > 5 and response.stats.pre_draft_hits == 0
        # Branches of finished requests are dropped with their sessions.
        for _ in range(100):
            if _gauge(metrics_port, "specd_worker_pre_drafted_sessions") == 0:
                break
            time.sleep(0.05)
        assert _gauge(metrics_port, "specd_worker_pre_drafted_sessions") == 0
        assert _gauge(metrics_port, "specd_worker_sessions") == 0
    finally:
        running.close()
