"""Prefix caching: a new session takes the cached blocks its prompt shares with earlier
ones, salted per tenant, and its output is a cold server's.

The pool's own rules first (reference counts, copy on write, eviction), on a real pool;
then through the three services: a repeated prefix is served from the cache in both
workers with greedy and seeded sampled output unchanged, and a different salt (another
tenant, or another cache_salt) never hits.
"""
from __future__ import annotations

import pytest
import torch

from conftest import request, start_stack
from gateway.settings import GatewaySettings
from gateway.validation import cache_salt
from specd.config import ServerSettings
from specd.worker.kvstore import KVPool, SessionKV


def pool(blocks: int = 12, caching: bool = True) -> KVPool:
    return KVPool(1, 1, 2, 2, torch.float32, torch.device("cpu"), 4, blocks, prefix_caching=caching)


def filled(kv: KVPool, tokens: list[int], salt: bytes = b"") -> SessionKV:
    """A session that took what the cache had of `tokens`, then 'computed' the rest: each
    position's key and value are its token id, so a test can read what a block holds."""
    session = SessionKV(kv)
    session.tokens = list(tokens)
    session.take_prefix(session.tokens, salt)
    assert session.reserve(len(tokens))
    session.own_from(session.length)
    for position in range(session.length, len(tokens)):
        slot = session.slots(position, position + 1)[0]
        kv.keys[:, slot] = kv.values[:, slot] = float(tokens[position])
    session.length = len(tokens)
    session.publish()
    return session


def held(kv: KVPool, session: SessionKV) -> list[float]:
    return [float(kv.keys[0, slot, 0, 0]) for slot in session.slots(0, session.length)]


def test_a_shared_prefix_is_taken_by_reference_and_copied_before_a_write():
    kv = pool()
    first = filled(kv, list(range(1, 11)))  # 10 tokens: two full blocks registered
    assert kv.cached_blocks == 2
    second = SessionKV(kv)
    second.tokens = list(range(1, 10)) + [99, 98]
    assert second.take_prefix(second.tokens, b"") == 8  # two blocks, by reference
    assert second.blocks == first.blocks[:2] and held(kv, second) == [float(t) for t in range(1, 9)]
    # The second session crops into its second (shared) block and writes: it copies it first.
    second.crop(6)
    assert second.reserve(8)
    second.own_from(6)
    assert second.blocks[1] != first.blocks[1] and second.blocks[0] == first.blocks[0]
    slot = second.slots(6, 7)[0]
    kv.keys[:, slot] = 77.0
    assert held(kv, first)[:8] == [float(t) for t in range(1, 9)]  # the first session's block is intact
    assert float(kv.keys[0, second.slots(5, 6)[0], 0, 0]) == 6.0  # the copy kept the positions before 6


def test_a_full_pool_refuses_a_write_into_a_shared_block_before_the_forward_not_during_it():
    """A verifier publishes blocks that hold proposed tokens; a rejection crops back into
    one. Held alone, it is unregistered and written in place, needing no block; held by
    another session too, its copy's block is taken by `reserve`, which fails cleanly when
    the pool is full (the caller evicts or answers RESOURCE_EXHAUSTED), so `own_from`
    never meets a full pool mid-forward."""
    kv = pool(blocks=4)  # 3 usable blocks
    first = filled(kv, list(range(1, 9)))  # two full blocks, registered
    assert kv.cached_blocks == 2 and first.reserve(12) and kv.free_blocks == 0
    block = first.blocks[1]
    first.crop(6)  # the proposal in positions 6 and 7 was rejected
    assert first.reserve(8)  # no block needed: the second block is the session's alone
    assert kv.cached_blocks == 1
    first.own_from(6)
    assert first.blocks[1] == block and held(kv, first)[:6] == [float(t) for t in range(1, 7)]

    kv = pool(blocks=4)
    first = filled(kv, list(range(1, 9)))
    second = SessionKV(kv)
    second.tokens = list(range(1, 9)) + [50]
    assert second.take_prefix(second.tokens, b"") == 8
    assert second.reserve(12) and kv.free_blocks == 0  # the third block: every block is held
    second.crop(6)
    assert not second.reserve(8)  # the shared second block needs a copy, and no block is left
    del first  # its session ends: the block is the second session's alone (still registered)
    assert second.reserve(8)
    second.own_from(6)
    assert held(kv, second)[:6] == [float(t) for t in range(1, 7)]


def test_salts_and_the_last_token_are_never_hit():
    kv = pool()
    filled(kv, list(range(1, 9)), salt=b"tenant-a")
    other = SessionKV(kv)
    assert other.take_prefix(list(range(1, 9)), b"tenant-b") == 0
    same = SessionKV(kv)
    # 8 tokens: the second block holds the last token, whose logits the step needs: one block only.
    assert same.take_prefix(list(range(1, 9)), b"tenant-a") == 4
    assert kv.prefix_queries == 24 and kv.prefix_hits == 4  # the first session looked up too


def test_unheld_cached_blocks_are_evicted_rather_than_a_session_refused():
    kv = pool(blocks=6)  # 5 usable blocks
    for start in range(0, 100, 10):  # distinct prefixes, each let go at once
        session = filled(kv, list(range(start + 1, start + 9)))
        del session
    assert kv.free_blocks == 5 and kv.cached_blocks <= 5
    big = SessionKV(kv)
    assert big.reserve(20)  # every block, cached ones evicted
    assert kv.free_blocks == 0 and kv.cached_blocks == 0


def test_without_prefix_caching_nothing_is_looked_up():
    kv = pool(caching=False)
    filled(kv, list(range(1, 11)))
    assert kv.cached_blocks == 0 and SessionKV(kv).take_prefix(list(range(1, 11)), b"") == 0


def test_the_tenant_salts_the_cache_only_with_keys():
    keyed = GatewaySettings(ServerSettings("127.0.0.1", 0), api_keys_file="keys.txt")
    open_ = GatewaySettings(ServerSettings("127.0.0.1", 0))
    assert cache_salt(keyed, "alpha", "") != cache_salt(keyed, "beta", "")
    assert cache_salt(open_, "alpha", "") == cache_salt(open_, "beta", "")
    assert cache_salt(open_, "", "mine") != cache_salt(open_, "", "")
    assert cache_salt(keyed, "ab", "c") != cache_salt(keyed, "a", "bc")  # the tenant's end is marked


def test_the_router_keys_the_blocks_the_workers_cache():
    """The gateway places a new session where its prompt's leading blocks went, by their
    keys (`specd.prefixkeys.prompt_keys`); a worker caches those blocks under its KV
    store's keys, at its default block size. Same bytes, same blocks, same chain: a change
    to either side alone (its bytes or its block size) makes the router follow prefixes no
    worker holds, and fails here."""
    from specd.prefixkeys import prompt_keys
    from specd.worker.settings import BatchSettings

    size = BatchSettings().block_tokens  # what the runtime builds its pool with
    kv = KVPool(1, 1, 2, 2, torch.float32, torch.device("cpu"), size, 16, prefix_caching=True)
    tokens = [0, 5, 2 ** 31 - 1, 151_935, *range(300, 300 + 3 * size)]  # 3 full blocks and a part
    for salt in (b"", b"tenant"):
        cached = filled(kv, tokens, salt)  # registers every full block of `tokens`
        assert len(cached.keys) == len(tokens) // size == 3
        # A prompt that goes on after them: the router keys the blocks the worker registered.
        assert prompt_keys(salt, [*tokens, 7]) == cached.keys
        # A new session's prompt: the worker looks up (and hits) the keys the router placed it by.
        prompt = tokens[:2 * size + 1]
        opened = SessionKV(kv)
        assert opened.take_prefix(prompt, salt) == 2 * size
        assert opened.keys == prompt_keys(salt, prompt) == cached.keys[:2]
    assert prompt_keys(b"", tokens) != prompt_keys(b"tenant", tokens)


def test_a_session_growing_alone_gets_consecutive_blocks_read_without_a_gather():
    """After sessions of different lengths let go in any order, the next session alone gets
    the lowest free blocks in order, which attention reads as one view of the pool."""
    from specd.worker.layout import BatchRow, prepare

    kv = pool(caching=False)
    first, second = SessionKV(kv), SessionKV(kv)
    assert first.reserve(8) and second.reserve(4)  # blocks 1, 2 and 3
    for gone in (first, second):
        kv.release(gone.blocks)
        gone.blocks.clear()
    alone = SessionKV(kv)
    assert alone.reserve(12) and alone.blocks == [1, 2, 3]
    alone.length = 11
    assert prepare([BatchRow(alone, [5], 1)], torch.device("cpu")).cache.run == (4, 16)

LONG = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
        "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n")


@pytest.fixture(scope="module")
def cold_stack(model_dirs):
    from specd.worker.settings import BatchSettings

    running = start_stack(model_dirs, batching=BatchSettings(no_prefix_caching=True))
    yield running
    running.close()


@pytest.mark.parametrize("mode,temperature", [("FIXED", 0.0), ("AUTO", 0.0), ("FIXED", 1.0), ("OFF", 0.0)])
def test_a_hit_gives_a_cold_servers_output(stack, cold_stack, mode, temperature):
    salt = f"{mode}-{temperature}"  # a cache of this test's own
    outputs = []
    for question in ("What does it return?", "What is the cache's size?"):
        req = request(LONG + question, temperature=temperature, seed=7, max_new_tokens=24, mode=mode,
                      draft_length=4, draft_model="close")
        req.cache_salt = salt
        cold = cold_stack.stub.Generate(req)
        warm = [stack.stub.Generate(req) for _ in range(2)]
        assert cold.stats.cached_tokens == 0
        outputs.append([list(r.token_ids) for r in (cold, *warm)])
        assert warm[1].stats.cached_tokens >= 64  # the whole long prefix, in blocks of 16
    for cold, *warm in outputs:
        assert all(tokens == cold for tokens in warm)


def test_n_completions_prefill_the_prompt_once(stack, cold_stack):
    """n=3: the first completion prefills the long prompt; the other two start after its
    first step and take its blocks, and every completion is the one its seed gives alone."""
    req = request(LONG + "Which one is faster?", temperature=1.0, seed=21, max_new_tokens=8, mode="FIXED",
                  draft_length=4, draft_model="close")
    req.cache_salt = "n-completions"
    req.n = 3
    response = stack.stub.Generate(req)
    first, others = response, list(response.choices)
    assert first.stats.cached_tokens == 0
    assert all(choice.stats.cached_tokens >= 64 for choice in others)  # the whole long prefix, in blocks of 16
    cold = cold_stack.stub.Generate(req)
    assert [list(first.token_ids)] + [list(c.token_ids) for c in others] == \
        [list(cold.token_ids)] + [list(c.token_ids) for c in cold.choices]


def test_another_salt_never_hits(stack):
    req = request(LONG + "Once more.", max_new_tokens=4, mode="OFF")
    req.cache_salt = "alpha"
    stack.stub.Generate(req)
    assert stack.stub.Generate(req).stats.cached_tokens > 0
    req.cache_salt = "beta"
    assert stack.stub.Generate(req).stats.cached_tokens == 0


def test_cached_prefixes_are_counted_for_prometheus(model_dirs):
    import urllib.request

    from test_cli import free_port

    port = free_port()
    running = start_stack(model_dirs, verifier_metrics_port=port)
    try:
        for _ in range(2):
            running.stub.Generate(request(LONG, max_new_tokens=2, mode="OFF"))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        hits = [line for line in text.splitlines() if line.startswith("specd_worker_prefix_cache_hits_total")]
        assert hits and float(hits[0].split()[-1]) > 0 and 'role="verifier"' in hits[0]
        assert "specd_worker_prefix_cache_queries_total" in text and "specd_worker_prefix_cache_blocks" in text
    finally:
        running.close()
