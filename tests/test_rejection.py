"""The rejection-sampling math, checked three ways (as vLLM checks its sampler):
hand-built greedy cases, a statistical test that could fail, and a slow reference loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.rejection import Draws, StepOutcome, finish_verdict, target_verdict, verify_greedy


def greedy(draft, target):
    return verify_greedy(draft, target)


def test_greedy_all_accepted_takes_bonus():
    assert greedy([5, 6, 7], [5, 6, 7, 9]) == StepOutcome(3, 9, True)


def test_greedy_first_mismatch_emits_target_argmax():
    assert greedy([5, 6, 7], [5, 2, 7, 9]) == StepOutcome(1, 2, False)
    assert greedy([5, 6, 7], [1, 6, 7, 9]) == StepOutcome(0, 1, False)


def test_greedy_no_draft_is_plain_step():
    assert greedy([], [4]) == StepOutcome(0, 4, True)


def test_forced_acceptance_and_rejection():
    gen = torch.Generator().manual_seed(0)
    vocab = 4
    one_hot = torch.eye(vocab)
    # Target puts all mass on the draft's tokens: always accepted, bonus from p_{γ+1}.
    out = _split_step(torch.tensor([1, 2]), one_hot[[1, 2]], one_hot[[1, 2, 3]], Draws.draw(2, gen))
    assert out == StepOutcome(2, 3, True)
    # Target gives the first draft token zero mass: rejected at once, recovered from p - q.
    out = _split_step(torch.tensor([1, 2]), one_hot[[1, 2]], one_hot[[0, 2, 3]], Draws.draw(2, gen))
    assert out == StepOutcome(0, 0, False)


def _random_dists(gen, rows, vocab, sharpness=2.0):
    return torch.softmax(sharpness * torch.randn(rows, vocab, generator=gen), dim=-1)


def _first_token_histogram(p, q, trials, seed):
    """Histogram of the first emitted token when the draft samples from q, γ = 1."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[1])
    for _ in range(trials):
        x = torch.multinomial(q[0], 1, generator=gen)
        out = _split_step(x, q, p, Draws.draw(1, gen))
        counts[int(x[0]) if out.accepted else out.token] += 1
    return counts


def _expected(dist, trials):
    """Expected counts; renormalised in float64 because scipy checks the sums that tightly."""
    dist = dist.double().numpy()
    return trials * dist / dist.sum()


def test_output_follows_target_distribution_and_not_draft():
    gen = torch.Generator().manual_seed(11)
    vocab = 8
    p = _random_dists(gen, 2, vocab)
    q = _random_dists(gen, 1, vocab)
    trials = 20000
    counts = _first_token_histogram(p, q, trials, seed=3)
    # The emitted token has the target's law: a chi-square test cannot reject it...
    assert chisquare(counts, _expected(p[0], trials)).pvalue > 1e-3
    # ...and the same test does reject the draft's law, so it has the power to fail.
    assert chisquare(counts, _expected(q[0], trials)).pvalue < 1e-6


def _split_step(draft_tokens, draft_probs, target_probs, draws):
    """A step as the services run it: the verifier's verdict from qᵢ(xᵢ) alone, then the
    recovered token drawn where q is (the draft) from the one row the verifier sent."""
    tokens = draft_tokens.tolist()
    q_proposed = [float(draft_probs[i, x]) for i, x in enumerate(tokens)]
    return finish_verdict(target_verdict(tokens, q_proposed, target_probs, draws), lambda i: draft_probs[i], draws)


def reference_rejection_sample(draft_tokens, draft_probs, target_probs, draws):
    """The algorithm as written in Leviathan et al., one token at a time, with the same
    draws, sampling by walking the cumulative sum in plain Python."""

    def inverse_cdf(weights, u):
        total, at = sum(weights), 0.0
        for token, w in enumerate(weights):
            at += w
            if w > 0 and u * total < at:
                return token
        return max(t for t, w in enumerate(weights) if w > 0)

    gamma = len(draft_tokens)
    for i in range(gamma):
        x = int(draft_tokens[i])
        p, q = float(target_probs[i, x]), float(draft_probs[i, x])
        if not draws.accept[i] < min(1.0, p / q):
            residual = [max(0.0, float(a) - float(b)) for a, b in zip(target_probs[i], draft_probs[i])]
            return StepOutcome(i, inverse_cdf(residual, draws.final), False)
    return StepOutcome(gamma, inverse_cdf(target_probs[gamma].double().tolist(), draws.final), True)


@pytest.mark.parametrize("gamma", [0, 1, 3, 6])
def test_split_step_matches_reference_loop(gamma):
    """The split step the services run and the paper's loop agree draw for draw."""
    gen = torch.Generator().manual_seed(gamma)
    for trial in range(200):
        vocab = 6
        q = _random_dists(gen, gamma, vocab, sharpness=1.0)
        p = _random_dists(gen, gamma + 1, vocab, sharpness=1.0)
        x = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(gamma)]) \
            if gamma else torch.zeros(0, dtype=torch.long)
        draws = Draws.draw(gamma, torch.Generator().manual_seed(trial))
        assert _split_step(x, q, p, draws) == reference_rejection_sample(x, q, p, draws)


def test_seeded_steps_reproduce():
    gen = torch.Generator().manual_seed(5)
    q, p = _random_dists(gen, 4, 10), _random_dists(gen, 5, 10)
    x = torch.tensor([1, 2, 3, 4])
    runs = [[_split_step(x, q, p, Draws.draw(4, g)) for _ in range(20)]
            for g in (torch.Generator().manual_seed(9), torch.Generator().manual_seed(9))]
    assert runs[0] == runs[1]
