"""The feature-reading draft's unrolled forward is the draft's own, one proposal at a time.

`FeatureDraft.unroll` computes every depth of every proposal along a sequence at once,
with masks. These tests check it against the plain computation: depth 1 against the
copied decoder layer run as transformers runs it (causal), and depth k at every index
against a causal forward over a sequence whose last features are the draft's own earlier
predictions, which is what drafting a proposal does.
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specd.worker.featuredraft import FeatureDraft


def _target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def _draft(target: LlamaForCausalLM) -> FeatureDraft:
    draft = FeatureDraft(target, vocabulary=list(range(0, 97, 2))).eval()
    with torch.no_grad():  # a trained draft: its fc and layer moved from where they start
        for parameter in [*draft.fc.parameters(), *draft.layer.parameters()]:
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return draft


@torch.no_grad()
def test_depth_1_is_the_decoder_layer_run_causally_then_normed():
    target = _target()
    draft = _draft(target)
    ids = torch.randint(0, 97, (2, 11))
    features = torch.randn(2, 11, 32)
    (mine,) = draft.unroll(ids, features, 1)
    hidden = draft._inputs(ids, features)
    positions = torch.arange(1, 12).unsqueeze(0).expand(2, -1)
    causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]
    theirs = draft.layer(hidden, position_embeddings=draft.rotary(hidden, positions), attention_mask=causal)
    theirs = draft.norm(theirs[0] if isinstance(theirs, tuple) else theirs)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_every_depth_equals_drafting_one_proposal_at_a_time():
    target = _target()
    draft = _draft(target)
    n, depth = 9, 4
    ids = torch.randint(0, 97, (1, n))
    features = torch.randn(1, n, 32)
    unrolled = draft.unroll(ids, features, depth)
    for start in range(n):
        fed = [features[0, i] for i in range(start + 1)]  # the target's features up to the proposal's start
        for k in range(1, depth + 1):
            index = start + k - 1
            if index >= n:
                break
            (causal,) = draft.unroll(ids[:, :index + 1], torch.stack(fed).unsqueeze(0), 1)
            torch.testing.assert_close(unrolled[k - 1][0, index], causal[0, -1], rtol=1e-4, atol=1e-5)
            fed.append(causal[0, -1])  # the next token reads this prediction
    # and the depths differ: a proposal's later tokens read predictions, not the target's features
    assert not torch.allclose(unrolled[0][0, 3:], unrolled[1][0, 3:])


@torch.no_grad()
def test_a_new_draft_predicts_the_feature_it_was_given():
    """Where training starts: fc passes the feature on and the layer adds nothing, so the
    first prediction is the target's own last distribution, on the right scale."""
    target = _target()
    draft = FeatureDraft(target, vocabulary=list(range(97)))
    features = torch.randn(1, 6, 32)
    (predicted,) = draft.unroll(torch.randint(0, 97, (1, 6)), features, 1)
    torch.testing.assert_close(predicted, draft.norm(features))
