"""Sampling transforms agree with transformers' own warpers; packing round-trips."""
from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specd.sampling import Transform, probs_from_logits
from specd.v1 import worker_pb2
from specd.wire import pack_distributions, unpack_distributions, verdict_problem


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                     (0.9, 10, 0.5)])
def test_transform_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    ours = probs_from_logits(logits, Transform(temperature, top_k, top_p))
    assert torch.equal(ours > 0, expected > 0)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)


def test_invalid_transforms_are_named():
    assert Transform(-1.0).problems() and Transform(1.0, top_k=-2).problems()
    assert Transform(1.0, top_p=0.0).problems() and Transform(1.0, top_p=1.5).problems()
    assert Transform(float("nan")).problems()
    assert not Transform(0.0).problems() and not Transform(0.5, 3, 0.9).problems()


@pytest.mark.parametrize("sparse", [False, True])
def test_pack_round_trip(sparse):
    probs = probs_from_logits(torch.randn(4, 30), Transform(1.0, top_k=5 if sparse else 0))
    message = pack_distributions(probs, sparse)
    assert bool(message.token_ids) == sparse
    if sparse:
        assert len(message.probs) == 4 * 5 * 4  # only the support travels
    assert torch.equal(unpack_distributions(message), probs)


def test_an_answer_that_is_not_a_protocol_2_verdict_is_named():
    """A verifier of worker protocol 1 answered a sampled step with γ+1 rows and no verdict;
    the gateway must refuse that, never sample a recovered token from the first row."""
    def rows(n: int) -> worker_pb2.Distributions:
        return pack_distributions(torch.full((n, 5), 0.2), False)

    assert verdict_problem(worker_pb2.VerifyResponse(target_probs=rows(4)), 3) is not None
    assert verdict_problem(worker_pb2.VerifyResponse(target_probs=rows(1)), 0) is not None
    assert verdict_problem(worker_pb2.VerifyResponse(accepted=2, bonus_token=4), 3) is not None
    assert verdict_problem(worker_pb2.VerifyResponse(accepted=1, target_probs=rows(1)), 3) is None
    assert verdict_problem(worker_pb2.VerifyResponse(accepted=3, bonus_token=4), 3) is None
