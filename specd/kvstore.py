"""A paged KV store built for batching: one preallocated pool of blocks per model, a block
table per session, and one batched forward over any number of sessions.

The pool (`KVPool`) holds every layer's keys and values in tensors [layers, slots, KV
heads, head dim], cut into blocks of `block_tokens` slots, allocated once when the model
loads (as vLLM's paged attention does): a session never grows by `torch.cat`. A session
(`SessionKV`) owns a list of blocks (its block table); rolling back rejected draft
positions is a change of one integer (`SessionKV.crop`), and a session's blocks go back
to the pool when the session is let go (its store evicts it, a failed step drops it, a
pre-drafted branch is not taken).

A batched forward (`forward`) runs all rows' new tokens as ONE row of Σ T tokens, so the
projections and MLPs see no padding. The model calls `BatchCache.update(...)` once per
layer (transformers' Cache interface), which writes every session's new keys and values
into their slots with one indexed copy; attention (`paged_attention`, registered with
transformers as ``specd_paged``) then gathers every session's blocks through its block
table (one `index_select` of whole blocks, the cheapest gather on a CPU) into a padded
[sessions, KV heads, longest, head dim] tensor and runs one SDPA call with a mask. Each
layer costs the same few operator calls whatever the number of sessions; the
per-session work (slot numbers, block tables, the mask) is done once per forward in
`prepare`. On a GPU the gather is where a paged or varlen kernel would go. On a CPU
the gather's copy costs memory bandwidth: docs/performance.md has the measurements
against a loop over sessions on views of their own storage.

Models whose attention goes through `cache.update` and transformers' attention interface
(every transformers decoder with full attention: Llama, Mistral, Qwen, ...) work;
sliding-window and linear-attention layers are refused at load. No gRPC here.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PAGED_ATTENTION = "specd_paged"  # the attention implementation `use_paged_attention` sets
NULL_BLOCK = 0  # a block never handed out: a block table's padding points at it


class KVPool:
    """Every session's keys and values for one model, in fixed blocks allocated up front.

    `keys`/`values`: [layers, blocks × block_tokens, KV heads, head dim]. Every block is
    zeroed when it is handed out, and block 0 is never handed out (table padding points
    at it): a gather reads whole blocks, and the masked positions it reads are then
    finite, never uninitialised memory (in SDPA, weight 0 × NaN would poison a row).
    Blocks are handed out and taken back from plain list operations, each atomic under the
    GIL: sessions are let go on the event loop and, rarely, on the model's thread.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 block_tokens: int, blocks: int) -> None:
        if blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is reserved)")
        self.block_tokens = block_tokens
        self.blocks = blocks
        shape = (layers, blocks * block_tokens, kv_heads, head_dim)
        # torch.empty: on a CPU the pages are committed as sessions first write them.
        self.keys = torch.empty(shape, dtype=dtype, device=device)
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.keys[:, :block_tokens].zero_()
        self.values[:, :block_tokens].zero_()
        self._free = list(range(blocks - 1, NULL_BLOCK, -1))  # pop() hands out low blocks first
        self.block_bytes = 2 * layers * block_tokens * kv_heads * head_dim * self.keys.element_size()
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # see `gather`

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        """One free block, zeroed (None: the pool is full)."""
        try:
            block = self._free.pop()
        except IndexError:
            return None
        slots = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
        self.keys[:, slots].zero_()
        self.values[:, slots].zero_()
        return block

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of `blocks` (a flat list of block tables), in order:
        two [len(blocks), block_tokens, KV heads, head dim] tensors.

        They are views of two scratch buffers the pool keeps and grows (on the model's
        thread, the only caller): a fresh output per call would cost the page faults of
        megabytes of new memory on every layer of every forward.
        """
        shape = (self.blocks, self.block_tokens, *self.keys.shape[2:])
        needed = blocks.shape[0]
        if self._scratch is None or self._scratch[0].shape[0] < needed:
            self._scratch = (self.keys.new_empty((needed, *shape[1:])), self.values.new_empty((needed, *shape[1:])))
        keys, values = self._scratch[0][:needed], self._scratch[1][:needed]
        torch.index_select(self.keys[layer].view(shape), 0, blocks, out=keys)
        torch.index_select(self.values[layer].view(shape), 0, blocks, out=values)
        return keys, values

    def release(self, blocks: list[int]) -> None:
        """Take a let-go session's blocks back (last first, so the next session that takes
        them gets them in ascending order again: one run, read without a gather)."""
        self._free.extend(reversed(blocks))


class SessionKV:
    """One session's place in the pool (its block table) and the tokens it knows.

    `tokens` is the sequence as the worker knows it; the cache covers its first
    `length` positions (a draft's last proposal is known but not cached). Position p lives
    in slot `blocks[p // block_tokens] * block_tokens + p % block_tokens` of every layer.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.length = 0
        self.tokens: list[int] = []
        self.blocks: list[int] = []
        # The blocks go back when the session is garbage, whoever let go of it last.
        weakref.finalize(self, pool.release, self.blocks)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_tokens

    def crop(self, keep: int) -> None:
        """Forget cached positions from `keep` on (rejected draft tokens): O(1)."""
        self.length = min(self.length, keep)

    def reserve(self, needed: int) -> bool:
        """Hold blocks for `needed` positions; False when the pool ran out first."""
        while self.capacity < needed:
            block = self.pool.allocate()
            if block is None:
                return False
            self.blocks.append(block)
        return True

    def slots(self, start: int, stop: int) -> list[int]:
        """Slot numbers of positions [start, stop) (all reserved)."""
        size, blocks = self.pool.block_tokens, self.blocks
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def fork(self, keep: int, needed: int) -> SessionKV | None:
        """A new session holding a copy of this one's first `keep` cached positions and
        tokens, with room for `needed` positions (None: the pool is full)."""
        fork = SessionKV(self.pool)
        if not fork.reserve(max(needed, keep)):
            return None
        if keep:
            device = self.pool.keys.device
            source, target = (torch.tensor(s.slots(0, keep), device=device) for s in (self, fork))
            self.pool.keys[:, target] = self.pool.keys[:, source]
            self.pool.values[:, target] = self.pool.values[:, source]
        fork.length = keep
        fork.tokens = self.tokens[:keep]
        return fork

    def nbytes(self) -> int:
        """Bytes of the pool this session holds (whole blocks, not just its length)."""
        return len(self.blocks) * self.pool.block_bytes


@dataclass
class BatchRow:
    """One session's part of a batched forward: feed `tokens`, keep logits of the last `keep`."""

    session: SessionKV
    tokens: list[int]
    keep: int


@dataclass
class BatchCache:
    """The cache object of ONE batched forward (duck-typed transformers `Cache`), with the
    index tensors every layer shares; built by `prepare`.

    - write_slots [Σ T]: the slot of each new token.
    - read_blocks [B × W]: each row's block table, padded to the widest (W blocks) with the
      null block.
    - keys: how many gathered positions attention reads (W × block_tokens; one row reads
      just its own).
    - run: one row whose blocks are consecutive reads slots [run) of the pool directly,
      with no gather (a lone session's blocks usually are).
    - allowed [B, 1, T, keys]: which keys each padded query sees (None: one query, which
      sees all it reads).
    - query_rows [Σ T]: where each new token sits in the padded [B × T] query layout
      (None: every row feeds T tokens, so the ragged row is already that layout).
    """

    pool: KVPool
    write_slots: torch.Tensor
    read_blocks: torch.Tensor
    batch: int
    keys: int
    run: tuple[int, int] | None
    allowed: torch.Tensor | None
    query_rows: torch.Tensor | None
    longest_feed: int  # T

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values [1, KV heads, Σ T, D] of every session (one copy each);
        `paged_attention` reads them back from the pool."""
        self.pool.keys[layer_idx].index_copy_(0, self.write_slots, key_states[0].transpose(0, 1))
        self.pool.values[layer_idx].index_copy_(0, self.write_slots, value_states[0].transpose(0, 1))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Only asked when position_ids are missing; `prepare` always passes them.
        raise NotImplementedError("a BatchCache forward carries explicit position ids")


@dataclass
class BatchInputs:
    """What `prepare` hands to the model, and how to read each row's logits back."""

    input_ids: torch.Tensor  # [1, Σ T]
    position_ids: torch.Tensor  # [1, Σ T]
    cache: BatchCache
    logits_to_keep: torch.Tensor  # indices into Σ T
    kept: list[slice]  # for each row: its slice of the kept logits


def prepare(rows: Sequence[BatchRow], device: torch.device) -> BatchInputs:
    """Lay the rows out for one forward; every session has reserved room for its feed.

    Per-token indices and block tables are made in Python (a decoding step feeds a few
    tokens per row); the mask [B, 1, T, keys] in a few tensor operations.
    """
    size = rows[0].session.pool.block_tokens
    batch, longest = len(rows), max(len(row.tokens) for row in rows)
    ids: list[int] = []
    positions: list[int] = []
    write_slots: list[int] = []
    query_rows: list[int] = []
    kept: list[int] = []
    reads: list[slice] = []
    starts: list[int] = []
    for b, row in enumerate(rows):
        session, n, start = row.session, len(row.tokens), row.session.length
        assert session.capacity >= start + n, "reserve a session's positions before its forward"
        reads.append(slice(len(kept), len(kept) + row.keep))
        kept += range(len(ids) + n - row.keep, len(ids) + n)
        ids += row.tokens
        positions += range(start, start + n)
        write_slots += session.slots(start, start + n)
        query_rows += range(b * longest, b * longest + n)
        starts.append(start)
    kept = kept or [len(ids) - 1]  # an empty index would mean "every position" to transformers
    ends = [start + len(row.tokens) for start, row in zip(starts, rows)]
    widest = max(ends)
    width = -(-widest // size)
    read_blocks = [block for row in rows
                   for block in row.session.blocks[:width] + [NULL_BLOCK] * (width - len(row.session.blocks[:width]))]
    # One row reads exactly its keys; several read whole blocks, their tails masked.
    keys = widest if batch == 1 else width * size
    run = None
    first = read_blocks[0]
    if batch == 1 and read_blocks == list(range(first, first + width)):
        run = (first * size, first * size + keys)
    allowed = None
    if not (batch == 1 and longest == 1):  # one query that sees every key it reads needs no mask
        key_pos = torch.arange(keys)
        query_pos = torch.tensor(starts)[:, None] + torch.arange(longest)  # [B, T]
        end_t = torch.tensor(ends)[:, None, None]  # [B, 1, 1]: keys each row holds after this forward
        allowed = ((key_pos <= query_pos[..., None]) & (key_pos < end_t)).unsqueeze(1).to(device)
    uniform = all(len(row.tokens) == longest for row in rows)
    cache = BatchCache(rows[0].session.pool, torch.tensor(write_slots, device=device),
                       torch.tensor(read_blocks, device=device), batch, keys, run, allowed,
                       None if uniform else torch.tensor(query_rows, device=device), longest)
    return BatchInputs(torch.tensor([ids], device=device), torch.tensor([positions], device=device), cache,
                       torch.tensor(kept, device=device), reads)


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    batch_cache: BatchCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a ragged batch through the pool, in a fixed number of operator calls.

    query: [1, heads, Σ T, head dim]; returns [1, Σ T, heads, head dim] as transformers'
    attention functions do. The queries are scattered into a padded [B, heads, T, D], every
    session's keys and values gathered through its block table (`BatchCache.update` has
    already stored the new ones), one SDPA call with the batch's mask, and the rows that
    are tokens gathered back. Without a batch cache (a plain forward of the same model)
    this is transformers' SDPA.
    """
    if batch_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer: int = module.layer_idx  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    cache = batch_cache
    _, heads, tokens, dim = query.shape
    batch, longest = cache.batch, cache.longest_feed
    if cache.query_rows is None:  # every row feeds `longest` tokens: a view, no copy
        padded = query[0].view(heads, batch, longest, dim).transpose(0, 1)
    else:
        padded = query.new_zeros(batch * longest, heads, dim)
        padded.index_copy_(0, cache.query_rows, query[0].transpose(0, 1))
        padded = padded.view(batch, longest, heads, dim).transpose(1, 2)
    if cache.run is not None:  # one row in consecutive blocks: a view of the pool
        start, stop = cache.run
        keys = cache.pool.keys[layer][start:stop].transpose(0, 1).unsqueeze(0)  # [1, KV heads, keys, D]
        values = cache.pool.values[layer][start:stop].transpose(0, 1).unsqueeze(0)
    else:
        keys, values = cache.pool.gather(layer, cache.read_blocks)  # [B × W, block, KV heads, D]
        kv_heads = keys.shape[2]
        keys = keys.view(batch, -1, kv_heads, dim)[:, :cache.keys].transpose(1, 2)  # [B, KV heads, keys, D]
        values = values.view(batch, -1, kv_heads, dim)[:, :cache.keys].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(padded, keys, values, attn_mask=cache.allowed,
                                                           scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch * longest, heads, dim)  # [B × T, heads, D]
    if cache.query_rows is not None:
        out = out.index_select(0, cache.query_rows)
    return out.unsqueeze(0), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention)


def use_paged_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through `paged_attention` (plain forwards stay SDPA)."""
    model.set_attn_implementation(PAGED_ATTENTION)


@torch.inference_mode()
def forward(model: torch.nn.Module, rows: Sequence[BatchRow], device: torch.device) -> tuple[torch.Tensor, list[slice]]:
    """One batched forward of `rows` (a model set up by `use_paged_attention`): the kept
    logits [Σ keep, V] in float32 on the model's device, and each row's slice of them."""
    inputs = prepare(rows, device)
    out = model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, cache=inputs.cache,
                use_cache=True, logits_to_keep=inputs.logits_to_keep, batch_cache=inputs.cache)
    for row in rows:  # every session now caches the tokens it fed
        row.session.length += len(row.tokens)
    # The math after the forward runs where the logits are (specd.jobs): only token ids, a
    # few probabilities and the rows a sampled step needs ever reach the host.
    return out.logits[0].float(), inputs.kept
