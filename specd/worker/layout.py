"""How the rows of one batched forward are laid out over the KV pool
(`specd.worker.kvstore`).

A batched forward runs all rows' new tokens as ONE row of Σ T tokens, so the projections
and MLPs see no padding. The model calls `BatchCache.update(...)` once per layer
(transformers' Cache interface), which writes every session's new keys and values into
their slots with one indexed copy; attention (`specd.worker.attention`) then reads every
session's blocks back through its block table. Each layer costs the same few operator
calls whatever the number of sessions: the per-session work (slot numbers, block tables,
the mask) is done once per forward in `prepare`, and crosses to the device in one copy
(`specd.devices.upload`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specd.devices import upload
from specd.worker.kvstore import NULL_BLOCK, KVPool, SessionKV


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
    - query_positions [B, T]: the position of each padded query, from which a sliding
      window's narrower mask is made the first time a layer asks (`window`).
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
    query_positions: torch.Tensor
    query_rows: torch.Tensor | None
    longest_feed: int  # T
    windows: dict[int, torch.Tensor] = field(default_factory=dict)  # sliding window → its mask
    # A model that attends on its own (`forwards.attends_itself`): the slots of every row's
    # whole context, concatenated, which `update` hands back as the keys and values, and the
    # additive mask [1, 1, Σ T, Σ context] that keeps each query to its own row's past.
    dense_slots: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    attended: bool = False  # paged_attention read this forward (the model uses the interface)
    # Gathers into the pool's scratch buffers (False: into fresh tensors, as a forward a
    # CUDA graph captures must; `KVPool.gather`).
    gather_scratch: bool = True
    # The paged kernel reads the pool through `read_blocks` itself (`specd.worker.pagedkernel`),
    # each row up to its end [B]; no gather, no mask (`allowed` is None), no run.
    row_ends: torch.Tensor | None = None

    def window(self, sliding_window: int) -> torch.Tensor:
        """The mask of a sliding-window layer: `allowed`, and only the last `sliding_window`
        positions up to each query (transformers' rule: key > query − window)."""
        if sliding_window not in self.windows:
            key_pos = torch.arange(self.keys, device=self.query_positions.device)
            recent = (key_pos > self.query_positions[..., None] - sliding_window).unsqueeze(1)  # [B, 1, T, keys]
            self.windows[sliding_window] = recent if self.allowed is None else recent & self.allowed
        return self.windows[sliding_window]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values [1, KV heads, Σ T, D] of every session (one copy each);
        `paged_attention` reads them back from the pool."""
        self.pool.keys[layer_idx].index_copy_(0, self.write_slots, key_states[0].transpose(0, 1))
        self.pool.values[layer_idx].index_copy_(0, self.write_slots, value_states[0].transpose(0, 1))
        if self.dense_slots is not None:  # a model that attends on its own reads what it is handed
            keys = self.pool.keys[layer_idx].index_select(0, self.dense_slots).transpose(0, 1).unsqueeze(0)
            values = self.pool.values[layer_idx].index_select(0, self.dense_slots).transpose(0, 1).unsqueeze(0)
            return keys, values
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: the rows of a batch hold different lengths, so no one length is right. Models
        ask for it to infer positions, which `prepare` always passes (OPT), or to size a
        mask that `paged_attention` does not read. For a model that attends on its own,
        how many of the keys it is handed precede the new tokens."""
        if self.dense_slots is not None:
            return self.dense_slots.shape[0] - self.write_slots.shape[0]
        return 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """As `get_seq_length`: the positions are explicit."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """(key length, key offset) of the mask a model builds and `paged_attention` ignores;
        for a model that attends on its own, the length of the keys it is handed (BLOOM
        builds its ALiBi bias from it: positions counted across the concatenated contexts
        differ from each session's own by a constant per session, which softmax ignores)."""
        if self.dense_slots is not None:
            return self.dense_slots.shape[0], 0
        return query_length, 0


@dataclass
class BatchInputs:
    """What `prepare` hands to the model, and how to read each row's logits back."""

    input_ids: torch.Tensor  # [1, Σ T]
    position_ids: torch.Tensor  # [1, Σ T]
    cache: BatchCache
    logits_to_keep: torch.Tensor  # indices into Σ T
    kept: list[slice]  # for each row: its slice of the kept logits


def prepare(rows: Sequence[BatchRow], device: torch.device, dense: bool = False,
            paged_kernel: bool = False) -> BatchInputs:
    """Lay the rows out for one forward; every session has reserved room for its feed.

    Per-token indices and block tables are made in Python (a decoding step feeds a few
    tokens per row); the mask [B, 1, T, keys] in a few tensor operations. dense: also the
    whole-context read of a model that attends on its own (`forwards.attends_itself`).
    paged_kernel: the model's attention reads the pool through the block tables
    (`specd.worker.pagedkernel`), so the rows' ends replace the mask.
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
    if batch == 1 and not paged_kernel and read_blocks == list(range(first, first + width)):
        run = (first * size, first * size + keys)
    uniform = all(len(row.tokens) == longest for row in rows)
    # Every index the forward needs crosses to the device in one copy, each a view of it
    # after (on a GPU, from pinned memory without a wait: the caching host allocator keeps
    # the buffer until the copy is done). The mask is built there, from the rows' ends.
    parts = [ids, positions, write_slots, read_blocks, kept, starts, ends, [] if uniform else query_rows]
    flat = upload([value for part in parts for value in part], device)
    (ids_t, positions_t, write_t, read_t, kept_t, starts_t, ends_t, rows_t) = flat.split([len(p) for p in parts])
    query_pos = starts_t[:, None] + torch.arange(longest, device=device)  # [B, T]
    allowed = None
    if not (batch == 1 and longest == 1 or paged_kernel):  # one query that sees every key it reads needs no mask
        key_pos = torch.arange(keys, device=device)
        end_t = ends_t[:, None, None]  # [B, 1, 1]: keys each row holds after this forward
        allowed = ((key_pos <= query_pos[..., None]) & (key_pos < end_t)).unsqueeze(1)
    cache = BatchCache(rows[0].session.pool, write_t, read_t, batch, keys, run, allowed, query_pos,
                       None if uniform else rows_t, longest, row_ends=ends_t if paged_kernel else None)
    if dense:
        cache.dense_slots, cache.dense_mask = _dense_read(rows, starts, ends, cache.pool.keys.dtype, device)
    return BatchInputs(ids_t[None], positions_t[None], cache, kept_t, reads)


def _dense_read(rows: Sequence[BatchRow], starts: list[int], ends: list[int], dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's whole context as one run of slots, and the additive mask that lets each
    new token see only its own row's keys up to its position."""
    slots: list[int] = []
    for row, end in zip(rows, ends):
        slots += row.session.slots(0, end)
    key_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(ends))
    key_pos = torch.cat([torch.arange(end) for end in ends])
    query_row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(row.tokens) for row in rows]))
    query_pos = torch.cat([torch.arange(start, start + len(row.tokens)) for start, row in zip(starts, rows)])
    seen = (key_row[None, :] == query_row[:, None]) & (key_pos[None, :] <= query_pos[:, None])
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    return torch.tensor(slots, device=device), mask[None, None].to(device)
