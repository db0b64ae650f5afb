"""Sampling transforms shared by the draft and the target.

Exactness needs the draft's q and the target's p to be built by the same function from
their logits: first the penalties and biases that depend on the tokens before a position
(`penalized`: logit bias, then repetition, frequency and presence penalties, then the
ending tokens held back until min_tokens; vLLM's order), then temperature, min_p, top-k
and top-p (vLLM's order; transformers' warpers keep the same for the last three).
Greedy takes the argmax of the penalized logits. Pure torch; no gRPC.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Logits are divided by the temperature: below this, float32 logits of ordinary size
# overflow to inf and softmax returns NaN. Sampling this cold is greedy in all but name.
MIN_TEMPERATURE = 1e-3
# What the worker protocol's float32 and int32 fields can carry.
FLOAT32_MAX = 3.4028234663852886e38
INT32_MAX = 2 ** 31 - 1
MIN_TOP_P = 1e-30
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI allows 300)
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs bound, vLLM's default max_logprobs


@dataclass(frozen=True)
class Transform:
    """How logits become a sampling distribution. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Applied to the logits before the rest, at each position over the tokens before it
    # (`penalized`). OpenAI's presence and frequency penalties count output tokens only;
    # vLLM's repetition penalty counts prompt and output tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids in order
    output_start: int = 0  # where the output starts in a session's tokens: the prompt's length
    # vLLM's min_p: after temperature, tokens less likely than min_p × the likeliest go.
    min_p: float = 0.0
    # While the output is shorter than min_tokens, `suppressed` (the ids that would end it:
    # EOS and the request's stop token ids) cannot be chosen.
    min_tokens: int = 0
    suppressed: tuple[int, ...] = ()

    @classmethod
    def from_fields(cls, temperature: float, top_k: int, top_p: float, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, repetition_penalty: float = 0.0,
                    logit_bias: dict[int, float] | None = None, output_start: int = 0, min_p: float = 0.0,
                    min_tokens: int = 0, suppressed: Sequence[int] = ()) -> Transform:
        """From a message's fields (public or worker), where proto3's 0 means unset: a
        top_p of 0 is 1.0, no nucleus cut, and a repetition penalty of 0 is 1.0, none. The
        one place those defaults are applied."""
        return cls(temperature, top_k, top_p or 1.0, presence_penalty, frequency_penalty, repetition_penalty or 1.0,
                   tuple(sorted((logit_bias or {}).items())), output_start, min_p, min_tokens,
                   tuple(sorted(set(suppressed))))

    @property
    def penalized(self) -> bool:
        """Whether the logits depend on the tokens before each position (or carry a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or (self.min_tokens and self.suppressed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def sparse(self) -> bool:
        """True when the distribution's support is truncated (send the support only)."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:  # also catches NaN
                found.append(f"{name} must be in [-2, 2] (0 = off), as OpenAI's, got {value:g}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            found.append(f"repetition_penalty must be in (0, 100] (1 = off), got {self.repetition_penalty:g}")
        if not 0.0 <= self.min_p <= 1.0:  # also catches NaN
            found.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p:g}")
        if self.min_tokens < 0:
            found.append(f"min_tokens must be >= 0, got {self.min_tokens}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            found.append(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:  # also catches NaN
                found.append(f"logit_bias for token {token} must be in [-100, 100], as OpenAI's, got {bias:g}")
                break
        return found


def penalized(logits: torch.Tensor, transform: Transform, tokens: Sequence[int]) -> torch.Tensor:
    """The logits [n, V] of n consecutive positions with the transform's bias and penalties
    applied; row i follows the tokens `tokens[:len(tokens) - n + 1 + i]` (so the last row
    follows them all). The same logits, untouched, when the transform has none.

    In vLLM's order, all before temperature: logit bias; repetition penalty over the prompt
    and output tokens (a positive logit divided by it, a negative one multiplied); then
    OpenAI's frequency penalty (times the token's count in the output) and presence penalty
    (once it occurs in the output) subtracted; last, while fewer than `min_tokens` output
    tokens precede a row, its `suppressed` tokens go to -inf. Output tokens are those from
    `transform.output_start` on, proposed ones included: each row counts what precedes it.
    """
    if not transform.penalized:
        return logits
    rows, vocab = logits.shape
    logits = logits.float().clone()
    if transform.logit_bias:
        ids = torch.tensor([t for t, _ in transform.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in transform.logit_bias if t < vocab], dtype=torch.float32)
        logits[:, ids.to(logits.device)] += bias.to(logits.device)
    history = torch.tensor(list(tokens), dtype=torch.long)
    first = len(tokens) - rows + 1  # tokens before row 0
    start = min(transform.output_start, first)
    # Ids past `vocab` (a draft whose logits are cut to the target's vocabulary) have no logit to change.
    output = history[start:first]
    counts = torch.bincount(output[output < vocab], minlength=vocab).float().expand(rows, vocab).clone()
    later = history[first:first + rows - 1]  # the token each row adds to the next rows' history
    if len(later):
        added = torch.zeros(rows, vocab, dtype=torch.float32)
        inside = later < vocab
        added[torch.arange(1, rows)[inside], later[inside]] = 1.0
        counts += added.cumsum(0)
    counts = counts.to(logits.device)
    if transform.repetition_penalty != 1.0:
        seen = counts > 0
        if start:
            prompt = torch.zeros(vocab, dtype=torch.bool)
            before = history[:start]
            prompt[before[before < vocab]] = True
            seen |= prompt.to(logits.device)
        scaled = torch.where(logits > 0, logits / transform.repetition_penalty, logits * transform.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if transform.frequency_penalty:
        logits -= transform.frequency_penalty * counts
    if transform.presence_penalty:
        logits -= transform.presence_penalty * (counts > 0).float()
    if transform.min_tokens and transform.suppressed:
        produced = first - transform.output_start + torch.arange(rows)  # output tokens before each row
        early = (produced < transform.min_tokens).to(logits.device)
        ids = torch.tensor([t for t in transform.suppressed if t < vocab], dtype=torch.long, device=logits.device)
        logits[early.nonzero().flatten()[:, None], ids[None, :]] = float("-inf")
    return logits


def probs_from_logits(logits: torch.Tensor, transform: Transform) -> torch.Tensor:
    """Turn logits [n, V] into float32 probabilities [n, V] under a sampling transform.

    Tokens removed by top-k/top-p get probability exactly 0. Must not be called for a
    greedy transform: greedy uses argmax of the raw logits.
    """
    assert logits.dim() == 2, f"expected [n, V] logits, got {tuple(logits.shape)}"
    assert not transform.greedy, "greedy decoding uses argmax, not probabilities"
    scores = logits.float()
    if transform.temperature != 1.0:  # a division at T = 1 would only copy the row
        scores = scores / transform.temperature
    if transform.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        threshold = transform.min_p * probs.max(dim=-1, keepdim=True).values
        scores = scores.masked_fill(probs < threshold, float("-inf"))
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


def allowed_from_words(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool [n, vocab] from a grammar's bitmask, int32 [n, ceil(vocab / 32)]: bit j of word i
    allows token 32·i + j (llguidance's and xgrammar's layout)."""
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=words.device)) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab].bool()


def restricted(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """The logits [n, V] with every token a grammar forbids at -inf (`allowed`: bool [n, V'],
    ids past V' forbidden too); the same logits when there is no grammar."""
    if allowed is None:
        return logits
    width = min(allowed.shape[1], logits.shape[1])
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep[:, :width] = allowed[:, :width].to(logits.device)
    return logits.float().masked_fill(~keep, float("-inf"))


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's own log-probabilities [n, V] (logprobs' meaning: before any processing)."""
    return torch.log_softmax(logits.float(), dim=-1)
