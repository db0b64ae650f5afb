"""Sampled output through the gateway has the target's distribution.

The empirical joint distribution of the first two generated tokens, over many seeds,
is compared with the target's exact joint distribution under the same transforms
(temperature and top-k) by a chi-square test; the draft is unrelated to the target, so
most proposals are rejected and the recovered-token path carries the test. With
overlapped speculation on, second tokens often come from pre-drafted proposals.
"""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from conftest import request
from specd.sampling import Transform, probs_from_logits

PROMPT = "def fibonacci(n):"
TRANSFORM = Transform(temperature=1.5, top_k=4)


def target_joint(target_model, tokenizer, prompt: str = PROMPT) -> dict[tuple[int, int], float]:
    """P(t1, t2) = p(t1 | prompt) · p(t2 | prompt, t1), computed directly from the target."""
    ids = tokenizer(prompt)["input_ids"]

    def next_probs(tokens: list[int]) -> torch.Tensor:
        logits = target_model(torch.tensor([tokens], device=target_model.device)).logits[:, -1]
        return probs_from_logits(logits, TRANSFORM)[0]

    with torch.no_grad():
        first = next_probs(ids)
        joint = {}
        for t1 in first.nonzero().flatten().tolist():
            second = next_probs(ids + [t1])
            for t2 in second.nonzero().flatten().tolist():
                joint[(t1, t2)] = float(first[t1]) * float(second[t2])
    return joint


@pytest.mark.parametrize("draft_model,gamma,overlap", [("unrelated", 4, False), ("close", 2, False),
                                                       ("close", 1, True)])
def test_first_two_tokens_follow_target_joint_distribution(stack, target_model, tokenizer, draft_model, gamma,
                                                           overlap):
    joint = target_joint(target_model, tokenizer)
    trials = 1500
    hits: list[int] = []

    def sample(seed: int) -> tuple[int, int]:
        req = request(PROMPT, temperature=TRANSFORM.temperature, top_k=TRANSFORM.top_k, seed=seed,
                      max_new_tokens=gamma + 1 + overlap, draft_length=gamma, draft_model=draft_model)
        req.speculation.overlap = overlap  # γ = 1: the second token often comes from a pre-drafted step
        response = stack.stub.Generate(req)
        hits.append(response.stats.pre_draft_hits)
        return tuple(response.token_ids[:2])

    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    if overlap:
        # A second token comes from a pre-drafted step only when the first was rejected
        # and the draft guessed the recovered token (41 of 1,500 here): enough to see a
        # pre-drafted path that broke the law, not a large share.
        assert sum(hits) > 20, "the test needs second tokens from pre-drafted proposals"
    assert_follows_joint(counts, joint, trials)


def assert_follows_joint(counts: Counter, joint: dict[tuple[int, int], float], trials: int) -> None:
    """A chi-square test of the pairs drawn against the target's joint law, and a check
    that the same test would reject a perturbed law (so it has the power to fail)."""
    assert set(counts) <= set(joint), "a pair outside the target's top-k support was generated"
    pairs = sorted(joint, key=lambda pair: joint[pair], reverse=True)
    observed = np.array([counts[p] for p in pairs], dtype=float)
    expected = np.array([joint[p] for p in pairs]) * trials
    # Pool the rare pairs into one bin so every expected count is at least 5.
    common = expected >= 5
    observed = np.append(observed[common], observed[~common].sum())
    expected = np.append(expected[common], expected[~common].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected *= observed.sum() / expected.sum()
    assert len(expected) >= 5, "the test needs several outcomes to have power"
    assert chisquare(observed, expected).pvalue > 1e-3
    # Power check: the same test rejects the target's law with a perturbed second token.
    skewed = np.roll(expected, 1)
    assert chisquare(observed, skewed * observed.sum() / skewed.sum()).pvalue < 1e-3
