"""Prefix-cache keys: the one chain of block keys both the workers' KV store and the
gateway's router compute, so the blocks the router follows are the blocks the workers cache.

A sequence is cut into full blocks of `block_tokens` tokens; block i's key is a digest of
block i-1's key (the root, a digest of the tenant's salt, for block 0) and block i's
tokens, so a key names its block's tokens and everything before them, under one salt.
`specd.worker.kvstore` registers and looks up its pool's blocks under these keys;
`gateway.workers.router` remembers them per endpoint, to place a new session where its
prompt's longest prefix went.

The bytes: each token as a little-endian signed 64-bit integer (fixed width, so no two
blocks share bytes), hashed with BLAKE2b to 16 bytes. A key is a cache key, not a
signature: 128 bits keep accidental collisions out of reach, and BLAKE2b over packed
integers is about twice as fast in CPython as hashing the tokens' decimal text.
"""
from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

# Tokens per block: the workers' KV block size (`specd.worker.settings.BatchSettings`) and
# the router's, from this one place.
BLOCK_TOKENS = 16
DIGEST_BYTES = 16


def root(salt: bytes) -> bytes:
    """The chain's start under `salt` (the key before block 0)."""
    return hashlib.blake2b(salt, digest_size=DIGEST_BYTES).digest()


def chain(before: bytes, tokens: Sequence[int], start: int, stop: int,
          block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of the full blocks `start` to `stop` (exclusive) of `tokens`, chained after
    `before`: the key of block `start` - 1, or `root(salt)` when `start` is 0."""
    keys = []
    for i in range(start, stop):
        block = array.array("q", tokens[i * block_tokens:(i + 1) * block_tokens])
        if len(block) != block_tokens:
            raise ValueError(f"block {i} of {len(tokens)} tokens is not full ({block_tokens} tokens a block)")
        if sys.byteorder == "big":
            block.byteswap()
        before = hashlib.blake2b(before + block.tobytes(), digest_size=DIGEST_BYTES).digest()
        keys.append(before)
    return keys


def prompt_keys(salt: bytes, tokens: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """Keys of a prompt's full blocks before its last token: the blocks a worker can take
    from its cache for a new session (the last token's logits are the step's result)."""
    return chain(root(salt), tokens, 0, max(0, (len(tokens) - 1) // block_tokens), block_tokens)
