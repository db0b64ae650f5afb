"""Sampling transforms shared by the draft and the target.

Exactness needs the draft's q and the target's p to be built by the same function from
their logits: temperature, then top-k, then top-p (the order of transformers' warpers).
Pure torch; no gRPC.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Logits are divided by the temperature: below this, float32 logits of ordinary size
# overflow to inf and softmax returns NaN. Sampling this cold is greedy in all but name.
MIN_TEMPERATURE = 1e-3
# What the worker protocol's float32 and int32 fields can carry.
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2 ** 31 - 1
MIN_TOP_P = 1e-30


@dataclass(frozen=True)
class Transform:
    """How logits become a sampling distribution. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @classmethod
    def from_fields(cls, temperature: float, top_k: int, top_p: float) -> Transform:
        """From a message's fields (public or worker), where proto3's 0 means unset: a
        top_p of 0 is 1.0, no nucleus cut. The one place that default is applied."""
        return cls(temperature, top_k, top_p or 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sparse(self) -> bool:
        """True when the distribution's support is truncated (send the support only)."""
        return self.top_k > 0 or self.top_p < 1.0

    def problems(self) -> list[str]:
        """Human-readable reasons this transform is invalid; empty when valid."""
        found = []
        if not self.temperature >= 0.0:  # also catches NaN
            found.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        elif 0.0 < self.temperature < MIN_TEMPERATURE:
            found.append(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature:g}; "
                         f"use 0 for the most likely token")
        elif not self.temperature <= FLOAT32_MAX:  # the worker protocol carries float32
            found.append(f"temperature must be finite and at most {FLOAT32_MAX:.3g}, got {self.temperature:g}")
        if self.top_k < 0:
            found.append(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        elif self.top_k > INT32_MAX:
            found.append(f"top_k must be at most {INT32_MAX}, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            found.append(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        elif self.top_p < MIN_TOP_P:
            found.append(f"top_p must be at least {MIN_TOP_P:g} (smaller rounds to 0 on the wire), got {self.top_p:g}")
        return found


def probs_from_logits(logits: torch.Tensor, transform: Transform) -> torch.Tensor:
    """Turn logits [n, V] into float32 probabilities [n, V] under a sampling transform.

    Tokens removed by top-k/top-p get probability exactly 0. Must not be called for a
    greedy transform: greedy uses argmax of the raw logits.
    """
    assert logits.dim() == 2, f"expected [n, V] logits, got {tuple(logits.shape)}"
    assert not transform.greedy, "greedy decoding uses argmax, not probabilities"
    scores = logits.float() / transform.temperature
    if transform.top_k > 0:
        k = min(transform.top_k, scores.shape[-1])
        kth_best = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if transform.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p: a token stays while the
        # mass of the tokens ranked above it is still short of top_p.
        drop_sorted = mass_before >= transform.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs
