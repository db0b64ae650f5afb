"""KV caches built for batching: per-session block-grown storage and one batched forward.

Each session keeps, per layer, its keys and values in tensors [KV heads, capacity, head
dim] that grow in blocks of `block_tokens` positions, so memory stays within one block
of what its tokens need (no preallocation to the context window), and rolling back
rejected draft positions is a change of one integer (`SessionKV.crop`).

A batched forward runs several sessions' new tokens through the model at once. The
model calls `BatchCache.update(...)` once per layer (transformers' Cache interface),
which writes each session's new keys and values into that session's storage. Two
layouts are offered (the README says which is the default and why):

- ``ragged`` (as vLLM): one row of Σ T tokens, so the projections and MLPs see no
  padding; attention (`ragged_attention`, registered with transformers as
  ``specd_ragged``) runs per session on views of its own storage: no copy of any cache.
- ``padded`` (as SGLang): rows [B, T_max]; each session's new tokens right-aligned, its
  cached keys copied left-aligned into [B, KV heads, L_max + T_max, head dim] and a 4-D
  mask saying which keys each query may see; transformers' own attention runs on that.

Models whose attention goes through `cache.update` (every transformers decoder with full
attention: Llama, Mistral, Qwen, ...) work; sliding-window and linear-attention layers
are refused at load. No gRPC here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

Layout = Literal["padded", "ragged"]
RAGGED_ATTENTION = "specd_ragged"  # the attention implementation a model needs for the ragged layout


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

    def fork(self, keep: int) -> SessionKV:
        """A copy of this session's first `keep` cached positions and tokens (a branch)."""
        layers, (heads, _, dim) = len(self.keys), self.keys[0].shape
        fork = SessionKV(layers, heads, dim, self.keys[0].dtype, self.keys[0].device, self.block_tokens, self.stream)
        fork.reserve(keep + self.block_tokens)
        for i in range(layers):
            fork.keys[i][:, :keep] = self.keys[i][:, :keep]
            fork.values[i][:, :keep] = self.values[i][:, :keep]
        fork.length = keep
        fork.tokens = self.tokens[:keep]
        return fork

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
        at = 0
        for b, row in enumerate(self.rows):
            n = len(row.tokens)
            self._store(layer_idx, b, key_states[0, :, at:at + n], value_states[0, :, at:at + n])
            at += n
        return key_states, value_states  # ragged_attention reads each session's storage instead

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

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only asked when position_ids are missing; `prepare` always passes them.
        raise NotImplementedError("a BatchCache forward carries explicit position ids")


@dataclass
class BatchInputs:
    """What `prepare` hands to the model, and how to read each row's logits back."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # padded: 4-D additive float mask (0 = attend, dtype min = masked)
    cache: BatchCache
    logits_to_keep: int | torch.Tensor
    rows_of_logits: list[tuple[int, slice]]  # for each row: (batch index, slice of kept positions)


def prepare(rows: Sequence[BatchRow], layout: Layout, dtype: torch.dtype, device: torch.device) -> BatchInputs:
    """Lay the rows out for one forward (growing each session's storage first)."""
    starts = [row.session.length for row in rows]
    for row, start in zip(rows, starts):
        row.session.reserve(start + len(row.tokens))
    if layout == "padded":
        return _prepare_padded(rows, starts, dtype, torch.finfo(dtype).min, device)
    return _prepare_ragged(rows, starts, device)


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


def _prepare_ragged(rows, starts, device) -> BatchInputs:
    ids: list[int] = []
    positions: list[int] = []
    kept: list[int] = []
    reads: list[tuple[int, slice]] = []
    for row, start in zip(rows, starts):
        n = len(row.tokens)
        reads.append((0, slice(len(kept), len(kept) + row.keep)))
        kept += range(len(ids) + n - row.keep, len(ids) + n)
        ids += row.tokens
        positions += range(start, start + n)
    kept = kept or [len(ids) - 1]  # an empty index would mean "every position" to transformers
    return BatchInputs(torch.tensor([ids], device=device), torch.tensor([positions], device=device), None,
                       BatchCache(rows, "ragged", starts), torch.tensor(kept, device=device), reads)


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     batch_cache: BatchCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a ragged batch, session by session, on views of each session's storage.

    query: [1, heads, Σ T, head dim]; returns [1, Σ T, heads, head dim] as transformers'
    attention functions do. Each session's queries see its cached keys and, causally, its
    new ones (`BatchCache.update` has already stored those). Without a ragged batch (a
    plain forward of the same model, or the padded layout) this is transformers' SDPA.
    """
    if batch_cache is None or batch_cache.layout != "ragged":
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer: int = module.layer_idx  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    outputs = []
    at = 0
    for row, start in zip(batch_cache.rows, batch_cache.starts):
        n = len(row.tokens)
        keys = row.session.keys[layer][:, :start + n].unsqueeze(0)
        values = row.session.values[layer][:, :start + n].unsqueeze(0)
        # One new token sees everything; several see their own past only (bottom-right causal).
        mask = None if n == 1 else torch.ones(n, start + n, dtype=torch.bool, device=query.device).tril(start)
        outputs.append(torch.nn.functional.scaled_dot_product_attention(
            query[:, :, at:at + n], keys, values, attn_mask=mask, scale=scaling, enable_gqa=True))
        at += n
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)


def finish(rows: Sequence[BatchRow]) -> None:
    """After the forward: every session now caches the tokens it fed."""
    for row in rows:
        row.session.length += len(row.tokens)


def use_layout(model: PreTrainedModel, layout: Layout) -> None:
    """Set the model's attention up for a layout (ragged needs `ragged_attention`)."""
    if layout == "ragged":
        model.set_attn_implementation(RAGGED_ATTENTION)


@torch.inference_mode()
def forward(model: torch.nn.Module, rows: Sequence[BatchRow], layout: Layout, dtype: torch.dtype,
            device: torch.device) -> list[torch.Tensor]:
    """One batched forward of `rows` (a model set up by `use_layout`); logits [keep, V] per row."""
    inputs = prepare(rows, layout, dtype, device)
    out = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                attention_mask=inputs.attention_mask, cache=inputs.cache, use_cache=True,
                logits_to_keep=inputs.logits_to_keep, batch_cache=inputs.cache)
    finish(rows)
    # The math after the forward is a few small vectors: it runs on the CPU.
    logits = out.logits.float().cpu()
    return [logits[b, kept] for b, kept in inputs.rows_of_logits]
