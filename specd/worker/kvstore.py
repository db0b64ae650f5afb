"""The paged KV pool: one preallocated pool of blocks per model, and a block table per
session.

The pool (`KVPool`) holds every layer's keys and values in tensors [layers, slots, KV
heads, head dim], cut into blocks of `block_tokens` slots, allocated once when the model
loads (as vLLM's paged attention does): a session never grows by `torch.cat`. A session
(`SessionKV`) owns a list of blocks (its block table); rolling back rejected draft
positions is a change of one integer (`SessionKV.crop`), and a session's blocks go back
to the pool when the session is let go (its store evicts it, a failed step drops it, a
pre-drafted branch is not taken).

How one batched forward lays its sessions out over the pool is `specd.worker.layout`'s,
how its attention reads them `specd.worker.attention`'s, which forward runs
`specd.worker.forwards`', and what the pool can serve, found when a model loads,
`specd.worker.trials`'. No gRPC here.
"""
from __future__ import annotations

import heapq
import threading
import weakref
from collections import OrderedDict

import torch

from specd import prefixkeys

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
    before it and the session's salt (`SessionKV.publish`; `specd.prefixkeys`, whose keys
    the gateway's router follows too). A new session takes the blocks its prompt shares
    with the index by reference (`SessionKV.take_prefix`), and computes only the rest.
    Blocks are counted by reference; a registered block no session holds stays cached,
    and the pool evicts those least recently let go first when it needs a block. A fork
    (`SessionKV.fork`) shares the same way: it takes the kept blocks by reference. A block
    that is shared or registered is never written: a session about to write into one
    copies it first (`SessionKV.own_from`).
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
        # gather (`specd.worker.layout.prepare`'s run).
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

    def allocate(self, zeroed: bool = True) -> int | None:
        """One block of its own for a session, zeroed (unless the caller overwrites it whole):
        a free one, else the cached block let go longest ago, unregistered (None: the pool is
        full)."""
        with self._lock:
            if self._free:
                block = heapq.heappop(self._free)
            elif self._cached:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of.pop(block)]
            else:
                return None
            self._refs[block] = 1
        if zeroed:
            slots = slice(block * self.block_tokens, (block + 1) * self.block_tokens)
            self.keys[:, slots].zero_()
            self.values[:, slots].zero_()
        return block

    def gather(self, layer: int, blocks: torch.Tensor, scratch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values of `blocks` (a flat list of block tables), in order:
        two [len(blocks), block_tokens, KV heads, head dim] tensors.

        They are views of two scratch buffers the pool keeps and grows (on the model's
        thread, the only caller): a fresh output per call would cost the page faults of
        megabytes of new memory on every layer of every forward. Not for a forward a CUDA
        graph captures (`scratch=False`): a graph keeps the addresses it ran on, which
        the next growth would free; its fresh outputs come from the graph's own memory.
        """
        key_shape = (self.blocks, self.block_tokens, *self.keys.shape[2:])
        value_shape = (self.blocks, self.block_tokens, *self.values.shape[2:])
        if not scratch:
            return (self.keys[layer].view(key_shape).index_select(0, blocks),
                    self.values[layer].view(value_shape).index_select(0, blocks))
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

    def claim(self, block: int) -> bool:
        """Make `block` writable for the one session holding it, unregistering it (a write
        is about to change its tokens, so its key would no longer name them); False when
        another session holds it too, and a writer must copy it."""
        with self._lock:
            if self._refs[block] != 1:
                return False
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
            return True


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
        # Blocks held for the copies on write of the next forward (`reserve`, `fork`), so
        # that a copy never finds the pool full in the middle of a batched forward.
        self.spare: list[int] = []
        # The blocks go back when the session is garbage, whoever let go of it last.
        weakref.finalize(self, pool.release, self.blocks)
        weakref.finalize(self, pool.release, self.spare)

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_tokens

    def crop(self, keep: int) -> None:
        """Forget cached positions from `keep` on (rejected draft tokens): O(1)."""
        self.length = min(self.length, keep)

    def reserve(self, needed: int) -> bool:
        """Before a forward writes from `length` on: hold blocks for `needed` positions, and
        make every block the write may reach writable, unregistered if the session alone
        holds it (a rejected proposal's block the session published), or else with a spare
        for its copy (`own_from`). False when the pool ran out first: here the caller can
        evict idle sessions or refuse the step, which it cannot mid-forward."""
        while self.capacity < needed:
            block = self.pool.allocate()
            if block is None:
                return False
            self.blocks.append(block)
        shared = sum(not self.pool.claim(block) for block in self.blocks[self.length // self.pool.block_tokens:])
        while len(self.spare) < shared:
            block = self.pool.allocate(zeroed=False)  # `own_from` copies a whole block into it
            if block is None:
                return False
            self.spare.append(block)
        return True

    def _chain(self, tokens: list[int], blocks: int) -> list[bytes]:
        """The prefix keys of the first `blocks` full blocks of `tokens`, after self.keys
        (`specd.prefixkeys`: the keys the gateway's router gives the same blocks)."""
        assert self.root is not None
        before = self.keys[-1] if self.keys else self.root
        return prefixkeys.chain(before, tokens, len(self.keys), blocks, self.pool.block_tokens)

    def take_prefix(self, tokens: list[int], salt: bytes) -> int:
        """A new session: take by reference the cached blocks `tokens` starts with (never
        the last token's: its logits are the step's result), and register its own as they
        fill (under `salt`). The positions taken, now cached."""
        if not self.pool.prefix_caching:
            return 0
        assert not self.blocks and not self.length, "a prefix is taken by a new session"
        self.root = prefixkeys.root(salt)
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
        registered is made the session's own: unregistered if it alone holds it, else swapped
        for a copy in a spare `reserve` held (model's thread). RuntimeError when the pool has
        no block left: a step that wrote without `reserve` first."""
        size = self.pool.block_tokens
        del self.keys[start // size:]  # those blocks' tokens change from here: their keys go
        for i in range(start // size, len(self.blocks)):
            block = self.blocks[i]
            if self.pool.claim(block):
                continue
            # The whole block is copied: its positions from `start` on are written by this
            # forward or masked, and the copy leaves them finite, as a zeroed block would be.
            own = self.spare.pop() if self.spare else self.pool.allocate(zeroed=False)
            if own is None:
                raise RuntimeError("the KV pool has no block left to copy a shared block into")
            source, target = slice(block * size, (block + 1) * size), slice(own * size, (own + 1) * size)
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
        room for `needed` positions (None: the pool is full). Copy on write: every block
        of those positions is shared by reference, and whichever session later writes into
        a shared block copies it first (`own_from`). The fork does at its first forward, on
        the model's thread, for the last, partial block: a fork is made on the event loop,
        which so launches no copy, and holds a spare block for that copy."""
        fork = SessionKV(self.pool)
        fork.blocks.extend(self.pool.share(self.blocks[:-(-keep // self.pool.block_tokens)]))
        fork.length = keep
        if not fork.reserve(max(needed, keep)):  # and a spare for the last block, when partial
            return None
        fork.tokens = self.tokens[:keep]
        return fork

    def nbytes(self) -> int:
        """Bytes of the pool this session holds (whole blocks, not just its length)."""
        return (len(self.blocks) + len(self.spare)) * self.pool.block_bytes

