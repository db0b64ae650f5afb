"""Speculative sampling: accept or reject draft tokens so the output keeps the target's law.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"). Words used:

- draft tokens x₁..x_γ: what the draft proposed, with its distributions q₁..q_γ;
- target distributions p₁..p_{γ+1}: the target's, from one forward over the proposal;
- accepted: the leading draft tokens kept (xᵢ kept with probability min(1, pᵢ(xᵢ)/qᵢ(xᵢ)));
- recovered token: sampled from norm(max(0, pᵢ − qᵢ)) at the first rejection;
- bonus token: sampled from p_{γ+1} when every draft token was accepted.

A step emits the accepted tokens plus one recovered or bonus token. Pure torch; no gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutcome:
    """What one verification decided."""

    accepted: int  # number of leading draft tokens accepted
    token: int  # the recovered token (after a rejection) or the bonus token
    bonus: bool  # True when every draft token was accepted and `token` came from p_{γ+1}


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> StepOutcome:
    """Greedy special case: accept while xᵢ == argmax pᵢ, then emit the target's argmax.

    draft_tokens: [γ] int64; target_argmax: [γ+1] int64.
    """
    gamma = draft_tokens.shape[0]
    assert target_argmax.shape == (gamma + 1,), "need γ+1 target positions"
    mismatch = (draft_tokens != target_argmax[:gamma]).nonzero()
    accepted = int(mismatch[0, 0]) if mismatch.numel() else gamma
    return StepOutcome(accepted, int(target_argmax[accepted]), accepted == gamma)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> StepOutcome:
    """Accept a prefix of the draft tokens and sample one more token, exactly.

    draft_tokens: [γ] int64; draft_probs: [γ, V] (q); target_probs: [γ+1, V] (p).
    γ may be 0: then this is a plain sample from p₁. Draws γ uniforms, then one
    categorical sample, always in this order, so a seeded generator reproduces a step.
    """
    gamma = draft_tokens.shape[0]
    assert draft_probs.shape[0] == gamma and target_probs.shape[0] == gamma + 1
    positions = torch.arange(gamma)
    p_draft = target_probs[positions, draft_tokens]
    q_draft = draft_probs[positions, draft_tokens]
    uniforms = torch.rand(gamma, generator=generator, dtype=torch.float64)
    # u < p/q written as u·q < p: no division, and q = 0 (impossible for a sampled
    # token) would simply reject.
    kept = uniforms * q_draft.double() < p_draft.double()
    rejected = (~kept).nonzero()
    if rejected.numel() == 0:
        return StepOutcome(gamma, _sample(target_probs[gamma], generator), True)
    accepted = int(rejected[0, 0])
    residual = torch.clamp(target_probs[accepted] - draft_probs[accepted], min=0.0)
    if residual.sum() <= 0:
        # p == q up to rounding: rejection had probability ~0, and p itself is the law.
        residual = target_probs[accepted]
    return StepOutcome(accepted, _sample(residual, generator), False)


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One categorical draw from non-negative weights [V] (normalised by multinomial)."""
    return int(torch.multinomial(weights.float(), 1, generator=generator))
