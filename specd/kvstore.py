"""KV caches built for batching: per-session block-grown storage and one batched forward.

Each session keeps, per layer, its keys and values in tensors [KV heads, capacity, head
dim] that grow in blocks of `block_tokens` positions, so memory stays within one block
of what its tokens need (no preallocation to the context window), and rolling back
rejected draft positions is a change of one integer (`SessionKV.crop`).

A batched forward runs several sessions' new tokens through the model at once. The
model calls `BatchCache.update(...)` once per layer (transformers' Cache interface):
it writes each session's new keys and values into that session's storage and returns
the batch's keys and values for attention, with a 4-D mask saying which keys each
query may see. Two layouts are offered (the README says which is the default and why):

- ``padded`` (as SGLang): rows [B, T_max]; each session's new tokens right-aligned, its
  cached keys left-aligned in [B, KV heads, L_max + T_max, head dim].
- ``ragged`` (as vLLM): one row of Σ T tokens; keys of every session concatenated, a
  block-diagonal causal mask keeps sessions apart.

Models whose attention goes through `cache.update` (every transformers decoder with full
attention: Llama, Mistral, Qwen, ...) work; sliding-window and linear-attention layers
are refused at load. No gRPC here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch

Layout = Literal["padded", "ragged"]


class SessionKV:
    """One session's keys and values for every layer, and the tokens it knows.

    `tokens` is the sequence as the worker knows it; the cache covers its first
    `length` positions (a draft's last proposal is known but not cached).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_tokens: int, stream: str = "") -> None:
        self.block_tokens = block_tokens
        self.length = 0
        self.tokens: list[int] = []
        self.stream = stream  # the worker stream that opened it; only that stream's end drops it
        empty = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.keys = [empty] * layers
        self.values = [empty] * layers

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def crop(self, keep: int) -> None:
        """Forget cached positions from `keep` on (rejected draft tokens): O(1)."""
        self.length = min(self.length, keep)

    def reserve(self, needed: int) -> None:
        """Grow every layer's storage to hold `needed` positions, a whole block at a time."""
        if needed <= self.capacity:
            return
        blocks = -(-needed // self.block_tokens)
        grow = blocks * self.block_tokens - self.capacity
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            pad = k.new_empty(k.shape[0], grow, k.shape[2])
            self.keys[i] = torch.cat([k, pad], dim=1)
            self.values[i] = torch.cat([v, pad.clone()], dim=1)

    def nbytes(self) -> int:
        """Bytes held by this session's keys and values (capacity, not just length)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values))


@dataclass
class BatchRow:
    """One session's part of a batched forward: feed `tokens`, keep logits of the last `keep`."""

    session: SessionKV
    tokens: list[int]
    keep: int


@dataclass
class BatchCache:
    """The cache object of ONE batched forward (duck-typed transformers `Cache`).

    Built by `prepare`; the model calls `update` once per layer. After the forward every
    session's `length` has grown by the tokens it fed.
    """

    rows: Sequence[BatchRow]
    layout: Layout
    starts: list[int] = field(default_factory=list)  # cached length of each session before the forward
    offsets: list[int] = field(default_factory=list)  # padded: left padding of each row's new tokens

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values of every session; return the keys/values attention reads.

        key_states, value_states: padded [B, KV heads, T_max, D]; ragged [1, KV heads, Σ T, D].
        """
        if self.layout == "padded":
            return self._update_padded(key_states, value_states, layer_idx)
        return self._update_ragged(key_states, value_states, layer_idx)

    def _store(self, layer: int, b: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        session, start = self.rows[b].session, self.starts[b]
        session.keys[layer][:, start:start + keys.shape[1]] = keys
        session.values[layer][:, start:start + values.shape[1]] = values

    def _update_padded(self, key_states, value_states, layer):
        batch, heads, t_max, dim = key_states.shape
        l_max = max(self.starts)
        cached_k = key_states.new_zeros(batch, heads, l_max, dim)
        cached_v = torch.zeros_like(cached_k)
        for b, row in enumerate(self.rows):
            start, off = self.starts[b], self.offsets[b]
            cached_k[b, :, :start] = row.session.keys[layer][:, :start]
            cached_v[b, :, :start] = row.session.values[layer][:, :start]
            self._store(layer, b, key_states[b, :, off:], value_states[b, :, off:])
        return torch.cat([cached_k, key_states], dim=2), torch.cat([cached_v, value_states], dim=2)

    def _update_ragged(self, key_states, value_states, layer):
        at = 0
        for b, row in enumerate(self.rows):
            n = len(row.tokens)
            self._store(layer, b, key_states[0, :, at:at + n], value_states[0, :, at:at + n])
            at += n
        cached_k = [row.session.keys[layer][:, :s] for row, s in zip(self.rows, self.starts)]
        cached_v = [row.session.values[layer][:, :s] for row, s in zip(self.rows, self.starts)]
        return (torch.cat([*cached_k, key_states[0]], dim=1).unsqueeze(0),
                torch.cat([*cached_v, value_states[0]], dim=1).unsqueeze(0))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only asked when position_ids are missing; `prepare` always passes them.
        raise NotImplementedError("a BatchCache forward carries explicit position ids")


@dataclass
class BatchInputs:
    """What `prepare` hands to the model, and how to read each row's logits back."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor  # 4-D additive float mask: 0 = attend, dtype min = masked
    cache: BatchCache
    logits_to_keep: int | torch.Tensor
    rows_of_logits: list[tuple[int, slice]]  # for each row: (batch index, slice of kept positions)


def prepare(rows: Sequence[BatchRow], layout: Layout, dtype: torch.dtype, device: torch.device) -> BatchInputs:
    """Lay the rows out for one forward (growing each session's storage first)."""
    starts = [row.session.length for row in rows]
    for row, start in zip(rows, starts):
        row.session.reserve(start + len(row.tokens))
    masked = torch.finfo(dtype).min
    if layout == "padded":
        return _prepare_padded(rows, starts, dtype, masked, device)
    return _prepare_ragged(rows, starts, dtype, masked, device)


def _prepare_padded(rows, starts, dtype, masked, device) -> BatchInputs:
    t_max, l_max = max(len(r.tokens) for r in rows), max(starts)
    batch = len(rows)
    ids = torch.zeros(batch, t_max, dtype=torch.long)
    positions = torch.zeros(batch, t_max, dtype=torch.long)
    allowed = torch.zeros(batch, t_max, l_max + t_max, dtype=torch.bool)
    causal = torch.ones(t_max, t_max, dtype=torch.bool).tril()
    offsets = []
    for b, (row, start) in enumerate(zip(rows, starts)):
        n = len(row.tokens)
        off = t_max - n
        offsets.append(off)
        ids[b, off:] = torch.tensor(row.tokens)
        positions[b, off:] = torch.arange(start, start + n)
        allowed[b, off:, :start] = True
        allowed[b, off:, l_max + off:] = causal[off:, off:]
        # Padding queries see only themselves (a row with no key at all would be NaN).
        allowed[b, torch.arange(off), l_max + torch.arange(off)] = True
    keep = max(1, max(r.keep for r in rows))  # 0 would mean "every position" to transformers
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, masked).unsqueeze(1)
    cache = BatchCache(rows, "padded", starts, offsets)
    return BatchInputs(ids.to(device), positions.to(device), mask.to(device), cache, keep,
                       [(b, slice(keep - r.keep, keep)) for b, r in enumerate(rows)])


def _prepare_ragged(rows, starts, dtype, masked, device) -> BatchInputs:
    total_new, total_cached = sum(len(r.tokens) for r in rows), sum(starts)
    allowed = torch.zeros(total_new, total_cached + total_new, dtype=torch.bool)
    ids, positions, kept, reads = [], [], [], []
    q_at, k_at = 0, 0
    for row, start in zip(rows, starts):
        n = len(row.tokens)
        ids += row.tokens
        positions += range(start, start + n)
        allowed[q_at:q_at + n, k_at:k_at + start] = True
        allowed[q_at:q_at + n, total_cached + q_at:total_cached + q_at + n] = torch.ones(n, n, dtype=torch.bool).tril()
        reads.append((0, slice(len(kept), len(kept) + row.keep)))
        kept += range(q_at + n - row.keep, q_at + n)
        q_at, k_at = q_at + n, k_at + start
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, masked)[None, None]
    cache = BatchCache(rows, "ragged", starts)
    kept = kept or [total_new - 1]  # an empty index would mean "every position" to transformers
    return BatchInputs(torch.tensor([ids], device=device), torch.tensor([positions], device=device),
                       mask.to(device), cache, torch.tensor(kept, device=device), reads)


def finish(rows: Sequence[BatchRow]) -> None:
    """After the forward: every session now caches the tokens it fed."""
    for row in rows:
        row.session.length += len(row.tokens)
