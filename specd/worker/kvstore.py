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
the gather's copy costs memory bandwidth: docs/serving-path.md has the measurements
against a loop over sessions on views of their own storage.

Models whose attention goes through `cache.update` and transformers' attention interface
work: full attention, sliding windows and hybrids of the two (Llama, Mistral, Qwen,
Gemma 2 and 3, OPT, ...), and multi-head latent attention (DeepSeek-V2/V3), whose
compressed latents are what the pool holds. A model that computes attention itself on
what `cache.update` returns (Falcon, BLOOM) is found at load; its update then returns
every session's whole context, concatenated, and it gets a mask that keeps each
session's queries to their own keys: more memory traffic per forward, but exact. What the store
cannot serve exactly is found when the model loads (`kv_shape`, `batching_problem`) and
refused there with the reason. No gRPC here.
"""
from __future__ import annotations

import array
import hashlib
import heapq
import inspect
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specd.errors import UnsupportedModel

PAGED_ATTENTION = "specd_paged"  # the attention implementation `use_paged_attention` sets
NULL_BLOCK = 0  # a block never handed out: a block table's padding points at it


class KVPool:
    """Every session's keys and values for one model, in fixed blocks allocated up front.

    `keys`/`values`: [layers, blocks × block_tokens, KV heads, key dim / value dim] (the
    two dims differ under multi-head latent attention). Every block is
    zeroed when it is handed out, and block 0 is never handed out (table padding points
    at it): a gather reads whole blocks, and the masked positions it reads are then
    finite, never uninitialised memory (in SDPA, weight 0 × NaN would poison a row).
    Blocks are handed out and taken back under a lock: on the event loop and, for plain
    steps scored ahead and copies on write, on the model's thread; sessions are let go on
    either.

    Prefix caching (vLLM's automatic prefix caching, in this pool's blocks): a full block
    whose tokens a session has cached is registered under a key chained over every token
    before it and the session's salt (`SessionKV.publish`). A new session takes the blocks
    its prompt shares with the index by reference (`SessionKV.take_prefix`), and computes
    only the rest. Blocks are counted by reference; a registered block no session holds
    stays cached, and the pool evicts those least recently let go first when it needs a
    block. A fork (`SessionKV.fork`) shares the same way: it takes the kept full blocks by
    reference. A block that is shared or registered is never written: a session about to
    write into one copies it first (`SessionKV.own_from`).
    """

    def __init__(self, layers: int, kv_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, block_tokens: int, blocks: int, prefix_caching: bool = False) -> None:
        if blocks < 2:
            raise ValueError("a KV pool needs at least 2 blocks (block 0 is reserved)")
        self.block_tokens = block_tokens
        self.blocks = blocks
        # torch.empty: on a CPU the pages are committed as sessions first write them.
        self.keys = torch.empty((layers, blocks * block_tokens, kv_heads, key_dim), dtype=dtype, device=device)
        self.values = torch.empty((layers, blocks * block_tokens, kv_heads, value_dim), dtype=dtype, device=device)
        self.keys[:, :block_tokens].zero_()
        self.values[:, :block_tokens].zero_()
        # A heap: the lowest free block is handed out first, so a session that grows alone
        # gets consecutive blocks, which attention reads as one view of the pool, with no
        # gather (`prepare`'s run).
        self._free = list(range(NULL_BLOCK + 1, blocks))
        self._lock = threading.Lock()
        self._refs = [0] * blocks  # sessions holding each block
        self._key_of: dict[int, bytes] = {}  # a registered block's prefix key
        self._block_of: dict[bytes, int] = {}  # prefix key → the block holding its keys and values
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered, held by none: least recent first
        self.prefix_caching = prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up in the index (vLLM's prefix_cache_queries)
        self.prefix_hits = 0  # of them, tokens found (prefix_cache_hits)
        self.block_bytes = layers * block_tokens * kv_heads * (key_dim + value_dim) * self.keys.element_size()
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # see `gather`

    @property
    def free_blocks(self) -> int:
        """Blocks a session may take: free ones, and cached ones no session holds."""
        return len(self._free) + len(self._cached)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks, held or not: what the prefix index can hit."""
        return len(self._key_of)

    def allocate(self) -> int | None:
        """One block of its own for a session, zeroed: a free one, else the cached block let
        go longest ago, unregistered (None: the pool is full)."""
        with self._lock:
            if self._free:
                block = heapq.heappop(self._free)
            elif self._cached:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            else:
                return None
            self._refs[block] = 1
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
        key_shape = (self.blocks, self.block_tokens, *self.keys.shape[2:])
        value_shape = (self.blocks, self.block_tokens, *self.values.shape[2:])
        needed = blocks.shape[0]
        if self._scratch is None or self._scratch[0].shape[0] < needed:
            self._scratch = (self.keys.new_empty((needed, *key_shape[1:])),
                             self.values.new_empty((needed, *value_shape[1:])))
        keys, values = self._scratch[0][:needed], self._scratch[1][:needed]
        torch.index_select(self.keys[layer].view(key_shape), 0, blocks, out=keys)
        torch.index_select(self.values[layer].view(value_shape), 0, blocks, out=values)
        return keys, values

    def release(self, blocks: list[int]) -> None:
        """A session lets go of its blocks. One no session holds any more goes back to the free
        ones, or, when registered, to the cached ones: last block first, so a chain's tail is
        evicted before its head (a tail hits only after its head)."""
        with self._lock:
            for block in reversed(blocks):
                self._refs[block] -= 1
                if self._refs[block]:
                    continue
                if block in self._key_of:
                    self._cached[block] = None
                else:
                    heapq.heappush(self._free, block)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of `keys` (a prompt's chain of full blocks) the index
        holds, each now held once more by the caller."""
        found = []
        with self._lock:
            for key in keys:
                block = self._block_of.get(key)
                if block is None:
                    break
                self._refs[block] += 1
                self._cached.pop(block, None)
                found.append(block)
        return found

    def share(self, blocks: list[int]) -> list[int]:
        """`blocks`, each now held once more by the caller (a fork's by reference)."""
        with self._lock:
            for block in blocks:
                self._refs[block] += 1
        return blocks

    def register(self, block: int, key: bytes) -> None:
        """Index a full block under its prefix key (a key already held keeps its block)."""
        with self._lock:
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key

    def writable(self, block: int) -> bool:
        """Whether a session holding `block` may write into it: it alone holds it, unregistered."""
        return self._refs[block] == 1 and block not in self._key_of


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
        # Prefix caching: the root of the session's key chain (its salt; None: it neither
        # hits nor registers), and the keys of its first blocks, registered or hit.
        self.root: bytes | None = None
        self.keys: list[bytes] = []
        self.hit = 0  # positions taken from the cache when the session opened, until a step reports them
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

    def _chain(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The prefix keys of the first `blocks` full blocks of `tokens`, after self.keys."""
        assert self.root is not None
        size, keys = self.pool.block_tokens, list(self.keys)
        for i in range(len(keys), blocks):
            before = keys[-1] if keys else self.root
            block = array.array("q", tokens[i * size:(i + 1) * size]).tobytes()
            keys.append(hashlib.blake2b(before + block, digest_size=16).digest())
        return keys[len(self.keys):]

    def take_prefix(self, tokens: list[int], salt: bytes) -> int:
        """A new session: take by reference the cached blocks `tokens` starts with (never
        the last token's: its logits are the step's result), and register its own as they
        fill (under `salt`). The positions taken, now cached."""
        if not self.pool.prefix_caching:
            return 0
        assert not self.blocks and not self.length, "a prefix is taken by a new session"
        self.root = hashlib.blake2b(salt, digest_size=16).digest()
        keys = self._chain(tokens, (len(tokens) - 1) // self.pool.block_tokens)
        found = self.pool.lookup(keys)
        self.blocks.extend(found)
        self.keys = keys[:len(found)]
        self.length = len(found) * self.pool.block_tokens
        self.pool.prefix_queries += len(tokens)
        self.pool.prefix_hits += self.length
        return self.length

    def own_from(self, start: int) -> None:
        """Before writing positions from `start` on: each block there that is shared or
        registered is swapped for one of the session's own, with the positions before
        `start` copied (model's thread). RuntimeError when the pool has no block left."""
        size = self.pool.block_tokens
        del self.keys[start // size:]  # those blocks' tokens change from here: their keys go
        for i in range(start // size, len(self.blocks)):
            block = self.blocks[i]
            if self.pool.writable(block):
                continue
            own = self.pool.allocate()
            if own is None:
                raise RuntimeError("the KV pool has no block left to copy a shared block into")
            kept = min(start - i * size, size)
            if kept > 0:
                source = slice(block * size, block * size + kept)
                target = slice(own * size, own * size + kept)
                self.pool.keys[:, target] = self.pool.keys[:, source]
                self.pool.values[:, target] = self.pool.values[:, source]
            self.blocks[i] = own
            self.pool.release([block])

    def publish(self) -> None:
        """Register every full block of cached tokens not registered yet (after a forward)."""
        if self.root is None:
            return
        full = min(self.length, len(self.tokens)) // self.pool.block_tokens
        if full <= len(self.keys):
            return
        for i, key in enumerate(self._chain(self.tokens, full), start=len(self.keys)):
            self.pool.register(self.blocks[i], key)
            self.keys.append(key)

    def slots(self, start: int, stop: int) -> list[int]:
        """Slot numbers of positions [start, stop) (all reserved)."""
        size, blocks = self.pool.block_tokens, self.blocks
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def fork(self, keep: int, needed: int) -> SessionKV | None:
        """A new session holding this one's first `keep` cached positions and tokens, with
        room for `needed` positions (None: the pool is full). Copy on write: the full blocks
        of those positions are shared by reference, and only the last, partial one is
        copied; whichever session later writes into a shared block copies it first
        (`own_from`)."""
        size = self.pool.block_tokens
        full = keep // size
        fork = SessionKV(self.pool)
        fork.blocks.extend(self.pool.share(self.blocks[:full]))
        if not fork.reserve(max(needed, keep)):
            return None
        if keep > full * size:
            source, target = self.blocks[full] * size, fork.blocks[full] * size
            count = keep - full * size
            self.pool.keys[:, target:target + count] = self.pool.keys[:, source:source + count]
            self.pool.values[:, target:target + count] = self.pool.values[:, source:source + count]
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
    # A model that attends on its own (`attends_itself`): the slots of every row's whole
    # context, concatenated, which `update` hands back as the keys and values, and the
    # additive mask [1, 1, Σ T, Σ context] that keeps each query to its own row's past.
    dense_slots: torch.Tensor | None = None
    dense_mask: torch.Tensor | None = None
    attended: bool = False  # paged_attention read this forward (the model uses the interface)

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


def prepare(rows: Sequence[BatchRow], device: torch.device, dense: bool = False) -> BatchInputs:
    """Lay the rows out for one forward; every session has reserved room for its feed.

    Per-token indices and block tables are made in Python (a decoding step feeds a few
    tokens per row); the mask [B, 1, T, keys] in a few tensor operations. dense: also the
    whole-context read of a model that attends on its own (`attends_itself`).
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
    uniform = all(len(row.tokens) == longest for row in rows)
    # Every index the forward needs crosses to the device in one copy, each a view of it
    # after (on a GPU, from pinned memory without a wait: the caching host allocator keeps
    # the buffer until the copy is done). The mask is built there, from the rows' ends.
    parts = [ids, positions, write_slots, read_blocks, kept, starts, ends, [] if uniform else query_rows]
    flat = upload([value for part in parts for value in part], device)
    (ids_t, positions_t, write_t, read_t, kept_t, starts_t, ends_t, rows_t) = flat.split([len(p) for p in parts])
    query_pos = starts_t[:, None] + torch.arange(longest, device=device)  # [B, T]
    allowed = None
    if not (batch == 1 and longest == 1):  # one query that sees every key it reads needs no mask
        key_pos = torch.arange(keys, device=device)
        end_t = ends_t[:, None, None]  # [B, 1, 1]: keys each row holds after this forward
        allowed = ((key_pos <= query_pos[..., None]) & (key_pos < end_t)).unsqueeze(1)
    cache = BatchCache(rows[0].session.pool, write_t, read_t, batch, keys, run, allowed, query_pos,
                       None if uniform else rows_t, longest)
    if dense:
        cache.dense_slots, cache.dense_mask = _dense_read(rows, starts, ends, cache.pool.keys.dtype, device)
    return BatchInputs(ids_t[None], positions_t[None], cache, kept_t, reads)


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """Python ints as one int64 tensor on `device`: one copy to it, from pinned memory on
    a GPU (`non_blocking`: the host goes on preparing while it runs)."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    batch_cache: BatchCache | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a ragged batch through the pool, in a fixed number of operator calls.

    query: [1, heads, Σ T, head dim]; returns [1, Σ T, heads, head dim] as transformers'
    attention functions do. The queries are scattered into a padded [B, heads, T, D], every
    session's keys and values gathered through its block table (`BatchCache.update` has
    already stored the new ones), one SDPA call with the batch's mask, and the rows that
    are tokens gathered back. Multi-head latent attention (DeepSeek-V2/V3) stores its
    compressed latents, which the layer's own `expand_kv` turns into keys and values
    after the gather, so the pool holds the compressed cache. A sliding-window layer
    (Mistral, Gemma, Qwen2 with windows) masks what lies outside its window; a layer that
    soft-caps its scores (Gemma 2), which SDPA cannot, computes them in three matrix
    operations instead. Without a batch cache
    (a plain forward of the same model) this is transformers' SDPA, or its eager
    attention where scores are soft-capped.
    """
    if batch_cache is None:
        if softcap is not None:
            causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                                device=query.device).tril(key.shape[-2] - query.shape[-2])
            return _eager(query, key, value, causal if attention_mask is None else attention_mask, scaling, softcap)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    layer: int = module.layer_idx  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    cache = batch_cache
    cache.attended = True
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
        keys = keys.view(batch, -1, kv_heads, keys.shape[-1])[:, :cache.keys].transpose(1, 2)  # [B, KV heads, keys, D]
        values = values.view(batch, -1, kv_heads, values.shape[-1])[:, :cache.keys].transpose(1, 2)
    expand = getattr(module, "expand_kv", None)
    if expand is not None:  # multi-head latent attention caches its compressed latents: expand them here
        keys, values = expand(keys, values)
    mask = cache.allowed if sliding_window is None else cache.window(sliding_window)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(padded, keys, values, attn_mask=mask, scale=scaling,
                                                               enable_gqa=True)
    else:
        out = _eager(padded, keys, values, mask, scaling, softcap)[0].transpose(1, 2)
    out = out.transpose(1, 2).reshape(batch * longest, heads, out.shape[-1])  # [B × T, heads, D]
    if cache.query_rows is not None:
        out = out.index_select(0, cache.query_rows)
    return out.unsqueeze(0), None


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float | None, softcap: float) -> tuple[torch.Tensor, None]:
    """Attention with soft-capped scores (softcap · tanh(scores / softcap)), as Gemma 2's
    eager attention computes it; `mask` is boolean (True: seen) or additive. Returns
    [B, T, heads, D] like the attention interface."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(PAGED_ATTENTION, paged_attention)


def use_paged_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through `paged_attention` (plain forwards stay SDPA)."""
    model.set_attn_implementation(PAGED_ATTENTION)


# Models that attend on their own, never through the attention interface (Falcon, BLOOM):
# found at load (`batching_problem`). Their cache update hands back every session's whole
# context, concatenated, and they get the mask that keeps each session to its own, in one
# of two ways, whichever the trial finds exact: as the model's `attention_mask` (MODEL_MASK:
# most take a prepared 4-D mask as it is), or handed to each layer (LAYER_MASK: BLOOM,
# whose ALiBi needs the model called without one).
MODEL_MASK, LAYER_MASK = "model", "layer"
_ATTENDS_ITSELF: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def _trial_handing_whole_contexts(model: PreTrainedModel, pool: KVPool, vocab_size: int,
                                  device: torch.device) -> str | None:
    """`batching_problem` for a model that attends on its own: the mask as its
    `attention_mask`, else handed to each layer; the reason when neither is exact."""
    _ATTENDS_ITSELF[model] = MODEL_MASK
    problem = batching_problem(model, pool, vocab_size, device)
    if problem is not None:
        _ATTENDS_ITSELF[model] = LAYER_MASK
        _hand_masks(model)
        problem = batching_problem(model, pool, vocab_size, device)
    return problem


_CACHE_ARGUMENTS = ("layer_past", "cache", "past_key_values", "past_key_value")


def _hand_masks(model: torch.nn.Module) -> None:
    """Give every layer of a model that attends on its own the batch's mask: each
    submodule called with a cache and an `attention_mask` gets `BatchCache.dense_mask`
    in place of the mask the model made (which knows nothing of the sessions). The model
    itself is called without a mask, so what it derives from the key length (BLOOM's
    ALiBi) covers the whole concatenated context."""
    def hand_mask(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if name in kwargs), None)
        if isinstance(cache, BatchCache) and cache.dense_mask is not None and "attention_mask" in kwargs:
            kwargs["attention_mask"] = cache.dense_mask
        return args, kwargs

    for module in model.modules():
        if module is model or isinstance(module, PreTrainedModel):
            continue
        parameters = inspect.signature(module.forward).parameters
        if "attention_mask" in parameters and any(name in parameters for name in _CACHE_ARGUMENTS):
            module.register_forward_pre_hook(hand_mask, with_kwargs=True)


# Forwards that stand in for a model's own (`use_forward`; specd.worker.lean).
_FORWARDS: weakref.WeakKeyDictionary[torch.nn.Module, Callable[[BatchInputs], torch.Tensor]] = \
    weakref.WeakKeyDictionary()


def use_forward(model: torch.nn.Module, forward: Callable[[BatchInputs], torch.Tensor]) -> None:
    """Run `model`'s batched forwards through `forward` (kept logits [1, Σ keep, V] from
    `BatchInputs`, as `own_forward` gives) from now on."""
    _FORWARDS[model] = forward


def own_forward(model: torch.nn.Module, inputs: BatchInputs) -> torch.Tensor:
    """The kept logits [1, Σ keep, V] of the model's own forward over `inputs`."""
    mask = {"attention_mask": inputs.cache.dense_mask} if _ATTENDS_ITSELF.get(model) == MODEL_MASK else {}
    return model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, cache=inputs.cache, use_cache=True,
                 logits_to_keep=inputs.logits_to_keep, batch_cache=inputs.cache, **mask).logits


@torch.inference_mode()
def forward(model: torch.nn.Module, rows: Sequence[BatchRow], device: torch.device) -> tuple[torch.Tensor, list[slice]]:
    """One batched forward of `rows` (a model set up by `use_paged_attention`): the kept
    logits [Σ keep, V] in float32 on the model's device, and each row's slice of them."""
    logits, kept, _ = _forward(model, rows, device)
    return logits, kept


@torch.inference_mode()
def _forward(model: torch.nn.Module, rows: Sequence[BatchRow],
             device: torch.device) -> tuple[torch.Tensor, list[slice], bool]:
    """`forward`, and whether the model's attention read through `paged_attention`."""
    caching = rows[0].session.pool.prefix_caching
    for row in rows:  # no session writes into a block another holds (a fork, a prefix hit), or the index does
        row.session.own_from(row.session.length)
    inputs = prepare(rows, device, model in _ATTENDS_ITSELF)
    stand_in = _FORWARDS.get(model)
    logits = own_forward(model, inputs) if stand_in is None else stand_in(inputs)
    for row in rows:  # every session now caches the tokens it fed
        row.session.length += len(row.tokens)
        if caching:
            row.session.publish()
    # The math after the forward runs where the logits are (the roles' jobs: draft_service.jobs,
    # verifier_service.jobs): only token ids, a few probabilities and the rows a sampled step
    # needs ever reach the host.
    return logits[0].float(), inputs.kept, inputs.cache.attended


# Attention layers the store serves: full causal attention, and a sliding window over it.
LAYER_TYPES = {"full_attention", "sliding_attention"}


@torch.inference_mode()
def kv_shape(model: PreTrainedModel, device: torch.device) -> tuple[int, int, int, int]:
    """(layers, KV heads, key dim, value dim) of a decoder, read from the cache of a
    two-token forward rather than guessed from its config: families name these fields
    differently, and what a layer caches need not be its keys and values (multi-head
    latent attention caches one head of compressed latent and one of rotary key, of
    different sizes).
    UnsupportedModel for layers the store cannot hold, or layers of different shapes."""
    config = model.config
    other = sorted(set(getattr(config, "layer_types", None) or ()) - LAYER_TYPES)
    if other:
        raise UnsupportedModel(f"{config.model_type}: layers of type {other} keep no key/value cache the batched "
                               f"store can hold (it serves {sorted(LAYER_TYPES)})")
    cache = DynamicCache(config=config)
    try:
        model(input_ids=torch.tensor([[1, 2]], device=device), cache=cache, use_cache=True)
        shapes = {(layer.keys.shape[1], layer.keys.shape[-1], layer.values.shape[-1]) for layer in cache.layers}
    except Exception as exc:  # whatever the model's code raises is the reason it cannot be served
        raise UnsupportedModel(f"{config.model_type}: a forward with transformers' own cache fails or keeps no "
                               f"keys and values: {type(exc).__name__}: {exc}") from exc
    if len(shapes) != 1:
        raise UnsupportedModel(f"{config.model_type}: its layers cache keys and values of different shapes "
                               f"{sorted(shapes)}; the store keeps one shape for all layers")
    (heads, key_dim, value_dim), = shapes
    return len(cache.layers), heads, key_dim, value_dim


# How far a batched forward's logits may stray from the plain forward's, as a share of the
# largest logit: float32 differs in rounding only; half precision in more than that.
_AGREEMENT = {torch.float32: 1e-3, torch.float64: 1e-6}
_HALF_AGREEMENT = 3e-2


def _trial_sequences(vocab_size: int) -> list[list[int]]:
    """The two sessions of the load trials, of different lengths."""
    return [[(7 * i + 3) % vocab_size for i in range(1, 21)], [(11 * i + 5) % vocab_size for i in range(1, 14)]]


class NoRoomForTrial(Exception):
    """The KV pool cannot hold the load trials' two sessions."""


def trial_batches(pool: KVPool, vocab_size: int) -> Iterator[list[BatchRow]]:
    """The rows of the load trials' three batched forwards, in order: both sessions of
    `_trial_sequences` prefill, then take a verification-sized step of 5 tokens, then a
    decoding step of 1, as serving runs them. NoRoomForTrial when the pool cannot hold them."""
    sessions = []
    for tokens in _trial_sequences(vocab_size):
        session = SessionKV(pool)
        if not session.reserve(len(tokens)):
            raise NoRoomForTrial("the KV pool has no room for a two-session trial forward")
        session.tokens = tokens
        sessions.append(session)
    for phase in range(3):
        rows = []
        for session in sessions:
            cuts = (0, len(session.tokens) - 6, len(session.tokens) - 1, len(session.tokens))  # 5 tokens | 1 token
            rows.append(BatchRow(session, session.tokens[cuts[phase]:cuts[phase + 1]], cuts[phase + 1] - cuts[phase]))
        yield rows


@torch.inference_mode()
def trial_logits(stand_in: Callable[[BatchInputs], torch.Tensor], pool: KVPool, vocab_size: int,
                 device: torch.device) -> list[torch.Tensor] | str:
    """The kept logits of each of `trial_batches`' forwards run through `stand_in` (a
    forward as `use_forward` takes, for a model that attends through `paged_attention`);
    the reason instead when the pool has no room."""
    logits = []
    try:
        for rows in trial_batches(pool, vocab_size):
            logits.append(stand_in(prepare(rows, device)))
            for row in rows:
                row.session.length += len(row.tokens)
    except NoRoomForTrial as exc:
        return str(exc)
    return logits


@torch.inference_mode()
def batching_problem(model: PreTrainedModel, pool: KVPool, vocab_size: int, device: torch.device) -> str | None:
    """Why the store cannot serve `model` exactly (None: it can), found by trying it at load.

    Two sessions of different lengths go through three batched forwards together
    (`trial_batches`). Every logit must match the model's own eager forward over the same
    sequences. An exception (a cache method the model needs and `BatchCache` lacks, keys
    and values of shapes the pool cannot hold) or a disagreement (a model that reads
    positions or masks some other way) is the reason; a model refused here never fails at
    a request instead.
    """
    batched: list[list[torch.Tensor]] = [[], []]
    attends_itself = False  # the first forward never reached paged_attention
    try:
        for rows in trial_batches(pool, vocab_size):
            logits, kept, attended = _forward(model, rows, device)
            if not attended and model not in _ATTENDS_ITSELF:
                attends_itself = True
                break
            for row, rows_kept in enumerate(kept):
                batched[row].append(logits[rows_kept])
    except NoRoomForTrial as exc:
        return str(exc)
    except Exception as exc:  # whatever the model's code raises is the reason it cannot be served
        return f"a batched forward fails: {type(exc).__name__}: {exc}"
    if attends_itself:
        del rows  # the last of the trial's sessions: their blocks go back to the pool
        return _trial_handing_whole_contexts(model, pool, vocab_size, device)
    # The reference: the model's own eager attention over each whole sequence.
    try:
        model.set_attn_implementation("eager")
        plains = [model(input_ids=torch.tensor([tokens], device=device), use_cache=False).logits[0].float()
                  for tokens in _trial_sequences(vocab_size)]
    except Exception as exc:  # a model whose own forward fails cannot be checked, so is not served
        return f"its own forward fails: {type(exc).__name__}: {exc}"
    finally:
        use_paged_attention(model)
    for row, plain in enumerate(plains):
        got, want = torch.cat(batched[row]), plain
        scale = want.abs().max().item() or 1.0
        error = (got - want).abs().max().item() / scale
        if not error <= _AGREEMENT.get(pool.keys.dtype, _HALF_AGREEMENT):
            return (f"its batched forward disagrees with its plain forward (largest difference "
                    f"{error:.2g} of the largest logit): it reads positions or masks in a way the store "
                    f"does not reproduce")
    return None
