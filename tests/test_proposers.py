"""Model-free proposers: prompt lookup and suffix matching, the hybrid choice, and the
suffix cache's budget, tenants and salts, alone and through the three services."""
from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoModelForCausalLM

from conftest import LoopThread, request, start_stack
from gateway.app import create_server as create_gateway
from gateway.edge.metrics import AcceptanceCollector
from gateway.proposers.base import Proposal, StepContext
from gateway.proposers.hybrid import HybridChoice
from gateway.proposers.modelfree import GatewayProposer, PromptLookup, SuffixCache, SuffixProposer, follow
from gateway.settings import GatewaySettings
from gateway.stats.costmodel import StepCosts
from specd.config import ServerSettings
from specd.contract import PROMPT_LOOKUP, SUFFIX
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from test_sampled_distribution import TRANSFORM, assert_follows_joint, target_joint

# -- the proposers alone ----------------------------------------------------------------------


def propose(proposer: GatewayProposer, committed: list[int], max_tokens: int) -> Proposal:
    """One proposal of `proposer` after `committed`, as a step asks for it."""
    return asyncio.run(proposer.propose(StepContext(0, committed, max_tokens, {}), max_tokens))


def choose(choice: HybridChoice, committed: list[int], max_tokens: int, model_gamma: int) -> Proposal | None:
    """The hybrid choice of a step after `committed`."""
    return asyncio.run(choice.choose(StepContext(0, committed, max_tokens, {}), max_tokens, model_gamma))


def test_prompt_lookup_takes_the_latest_occurrence_of_the_longest_ngram():
    lookup = PromptLookup(min_n=2, max_n=3)
    # "7 8" occurs twice; "1 7 8" only once, at the start: the longest n-gram wins.
    tokens = [1, 7, 8, 2, 3, 5, 7, 8, 4, 9, 1, 7, 8]
    assert propose(lookup, tokens, 3).tokens == [2, 3, 5]
    # Growing: "9 7 8" is new, so n = 2 decides: the latest earlier "7 8" (the old end,
    # followed now) goes on with 9 7.
    assert propose(lookup, tokens + [9, 7, 8], 2).tokens == [9, 7]
    # A suffix seen nowhere before proposes nothing; n = 1 is below min_n.
    assert propose(lookup, tokens + [9, 7, 8, 6], 4).tokens == []


def test_prompt_lookup_never_matches_its_own_end():
    lookup = PromptLookup(min_n=2, max_n=4)
    assert propose(lookup, [5, 6, 7, 8], 4).tokens == []
    # A run of one token repeats itself: the continuation is the run.
    assert propose(lookup, [5, 6, 7, 8, 1, 1, 1, 1], 3).tokens == [1]


def test_suffix_follows_the_most_frequent_continuation_while_confident():
    cache = SuffixCache(max_tokens=1000)
    for response in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6], [9, 2, 3, 4, 7, 7]):
        cache.add("t", b"", response)
    proposer = SuffixProposer(cache, "t", b"", min_token_prob=0.5, spec_factor=1.0)
    match = propose(proposer, [8, 2, 3, 4], 8)
    # Pattern "2 3 4" (3 tokens, so at most 3 proposed): 5 follows in 2 of 3 occurrences,
    # then the two that agree go on with 6.
    assert match.tokens == [5, 6]
    assert match.confidence == pytest.approx([2 / 3, 1.0])
    # A stricter running-probability floor stops before the 2-of-3 token.
    assert propose(SuffixProposer(cache, "t", b"", min_token_prob=0.7), [8, 2, 3, 4], 8).tokens == []


def test_suffix_draft_length_follows_the_pattern_length():
    occurrences = [(4, list(range(20)), 10)]
    tokens, _, pattern = follow(occurrences, max_tokens=16, min_token_prob=0.1, spec_factor=1.0)
    assert pattern == 4 and tokens == [10, 11, 12, 13]
    tokens, _, _ = follow(occurrences, max_tokens=16, min_token_prob=0.1, spec_factor=2.0)
    assert tokens == list(range(10, 18))


def test_suffix_cache_stays_within_its_budget_oldest_out():
    cache = SuffixCache(max_tokens=50)
    for i in range(10):
        cache.add("t", b"", [100 + i] + list(range(i * 20, i * 20 + 19)))
        assert cache.tokens <= 50
    # Only the last two responses fit; the first ones are gone, index entries and all.
    assert cache.occurrences("t", b"", [0, 1, 2]) == []
    assert cache.occurrences("t", b"", [180, 181, 182])


def test_suffix_cache_keeps_tenants_apart():
    cache = SuffixCache(max_tokens=1000)
    cache.add("alice", b"", [1, 2, 3, 4, 5, 6, 7])
    assert propose(SuffixProposer(cache, "alice", b""), [9, 1, 2, 3], 4).tokens == [4, 5, 6]
    assert propose(SuffixProposer(cache, "bob", b""), [9, 1, 2, 3], 4).tokens == []


def test_suffix_cache_keeps_salts_apart_within_a_tenant():
    cache = SuffixCache(max_tokens=1000)
    cache.add("acme", b"user-x", [1, 2, 3, 4, 5, 6, 7])
    assert propose(SuffixProposer(cache, "acme", b"user-x"), [9, 1, 2, 3], 4).tokens == [4, 5, 6]
    assert propose(SuffixProposer(cache, "acme", b"user-y"), [9, 1, 2, 3], 4).tokens == []
    assert propose(SuffixProposer(cache, "acme", b""), [9, 1, 2, 3], 4).tokens == []



def test_a_tenant_that_sends_a_lot_pushes_out_its_own_entries():
    cache = SuffixCache(max_tokens=40)
    cache.add("alice", b"", list(range(100, 110)))
    for i in range(5):  # bob floods: 50 tokens into a 40-token budget shared with alice
        cache.add("bob", b"", list(range(i * 10, i * 10 + 10)))
        assert cache.tokens <= 40
    assert cache.occurrences("alice", b"", [100, 101, 102])  # alice's one response stays
    assert cache.occurrences("bob", b"", [0, 1, 2]) == [] and cache.occurrences("bob", b"", [40, 41, 42])


def test_a_tenant_spreading_over_salts_still_pushes_out_its_own_entries():
    cache = SuffixCache(max_tokens=40)
    cache.add("alice", b"", list(range(100, 115)))
    # bob floods under a new salt each time: each partition is smaller than alice's, but
    # bob as a tenant holds the most.
    for i in range(5):
        cache.add("bob", f"salt-{i}".encode(), list(range(i * 10, i * 10 + 10)))
        assert cache.tokens <= 40
    assert cache.occurrences("alice", b"", [100, 101, 102])
    assert cache.occurrences("bob", b"salt-0", [0, 1, 2]) == []
    assert cache.occurrences("bob", b"salt-4", [40, 41, 42])


def test_within_a_tenant_the_largest_salt_gives_up_its_oldest():
    cache = SuffixCache(max_tokens=40)
    cache.add("acme", b"quiet", list(range(100, 110)))
    for i in range(4):  # a loud salt of the same tenant: 40 tokens beside the quiet one's 10
        cache.add("acme", b"loud", list(range(i * 10, i * 10 + 10)))
        assert cache.tokens <= 40
    assert cache.occurrences("acme", b"quiet", [100, 101, 102])
    assert cache.occurrences("acme", b"loud", [0, 1, 2]) == []
    assert cache.occurrences("acme", b"loud", [30, 31, 32])


# -- the hybrid choice --------------------------------------------------------------------------


class Fixed(GatewayProposer):
    """A proposer that always proposes the same match (the choice is what is tested)."""

    def __init__(self, name: str, tokens: list[int], confidence: list[float] | None) -> None:
        self.name, self.tokens, self.confidence = name, tokens, confidence

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        confidence = None if self.confidence is None else tuple(self.confidence[:max_tokens])
        return self.proposal(self.tokens[:max_tokens], confidence)

    def index(self, committed) -> None:
        pass


def measured_costs() -> StepCosts:
    """A pair whose plain step costs 10 ms, a verified token 0.5 ms more, a draft token 2 ms."""
    costs = StepCosts()
    for gamma in (0, 2, 4, 8):
        for _ in range(5):
            costs.observe(gamma, 2.0 * gamma, 10.0 + 0.5 * gamma)
    return costs


def test_a_confident_match_beats_the_model_draft_and_a_weak_one_does_not():
    costs = measured_costs()
    free = StepCosts()
    confident = Fixed(SUFFIX, list(range(8)), [1.0] * 8)
    choice = HybridChoice([confident], costs, lambda name: free, model_alpha=lambda: 0.6)
    assert choose(choice, [1, 2, 3], 8, model_gamma=4).tokens == list(range(8))
    weak = Fixed(SUFFIX, list(range(8)), [0.3] + [0.5] * 7)
    choice = HybridChoice([weak], costs, lambda name: free, model_alpha=lambda: 0.8)
    assert choose(choice, [1, 2, 3], 8, model_gamma=4) is None
    # Against a plain step (no model draft) the weak match pays, cut where tokens per ms
    # peak: E = 1.3, 1.45, 1.525, 1.5625 over 10.5, 11, 11.5, 12 ms → 3 tokens.
    choice = HybridChoice([weak], costs, lambda name: free, model_alpha=lambda: 0.0)
    assert choose(choice, [1, 2, 3], 8, model_gamma=0).tokens == [0, 1, 2]


def test_prompt_lookup_confidence_is_learned_from_its_own_steps():
    costs = measured_costs()
    lookup = Fixed(PROMPT_LOOKUP, list(range(8)), None)
    choice = HybridChoice([lookup], costs, lambda name: StepCosts(), model_alpha=lambda: 0.9)
    # The prior (0.5): 1.875 tokens in 11.5 ms at best, against the draft's 4.1 in 20 ms.
    assert choose(choice, [1], 8, model_gamma=4) is None
    for _ in range(10):
        choice.observe(PROMPT_LOOKUP, 8, 8)  # ...until its matches keep being accepted
    assert choose(choice, [1], 8, model_gamma=4).tokens == list(range(8))


def test_a_forced_proposer_under_fixed_proposes_gamma_tokens():
    choice = HybridChoice([Fixed(SUFFIX, list(range(8)), [0.2] * 8)], StepCosts(), lambda name: StepCosts(),
                          model_alpha=lambda: 0.9, fixed=3)
    assert choose(choice, [1], 8, model_gamma=0).tokens == [0, 1, 2]


# -- through the services -----------------------------------------------------------------------

PROMPT = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b"


@pytest.fixture(scope="module")
def hybrid_stack(model_dirs):
    running = start_stack(model_dirs, model_free=(SUFFIX, PROMPT_LOOKUP), suffix_cache_tokens=4096)
    yield running
    running.close()


@pytest.fixture(scope="module")
def target_generate(model_dirs, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()

    def generate(prompt: str, max_new_tokens: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        return out[0, ids["input_ids"].shape[1]:].tolist()
    return generate


@pytest.mark.parametrize("mode,draft_model", [("AUTO", ""), ("AUTO", SUFFIX), ("AUTO", PROMPT_LOOKUP),
                                              ("FIXED", SUFFIX), ("FIXED", PROMPT_LOOKUP)])
def test_each_proposer_gives_the_targets_greedy_output(hybrid_stack, target_generate, mode, draft_model):
    expected = target_generate(PROMPT, 40)
    for segment in ("first", "again"):  # the second pass meets its own response in the cache
        req = request(PROMPT, max_new_tokens=40, mode=mode, draft_model=draft_model)
        req.user_segment = f"{mode}-{draft_model}-{segment}"[:60]
        response = hybrid_stack.stub.Generate(req)
        assert list(response.token_ids) == expected[: len(response.token_ids)]
        assert len(response.token_ids) == 40 or response.finish_reason == gateway_pb2.FINISH_REASON_EOS
        stats = response.stats
        assert len(stats.proposers) == stats.steps
        assert set(stats.proposers) <= {"", "close", SUFFIX, PROMPT_LOOKUP}
        if draft_model:
            assert set(stats.proposers) <= {"", draft_model} and stats.draft_model == draft_model


def test_a_repeated_request_is_drafted_from_the_cache(hybrid_stack):
    req = request(PROMPT, max_new_tokens=48, mode="AUTO")
    req.user_segment = "repeat"
    first = hybrid_stack.stub.Generate(req)
    second = hybrid_stack.stub.Generate(req)
    assert list(second.token_ids) == list(first.token_ids)
    stats = second.stats
    # The whole response is in the cache: the first step already proposes from it, and
    # every suffix token proposed is accepted (greedy: the same continuation). How many
    # tokens a match proposes is priced with measured step costs (gateway.proposers.hybrid), which a
    # loaded machine inflates: at least one, and fewer steps than the first time.
    assert stats.proposers[0] == SUFFIX and stats.accepted_lengths[0] == stats.draft_lengths[0] >= 1
    suffix_steps = [i for i, p in enumerate(stats.proposers) if p == SUFFIX]
    assert all(stats.accepted_lengths[i] == stats.draft_lengths[i] for i in suffix_steps)
    assert stats.steps < first.stats.steps


def test_another_tenant_is_not_drafted_from_the_cache(hybrid_stack):
    prompt = "class Cache:\n    def __init__(self, size):\n        self.size = size"
    owner = request(prompt, max_new_tokens=32, mode="AUTO", draft_model=SUFFIX)
    owner.user_segment = "owner"
    hybrid_stack.stub.Generate(owner)
    assert hybrid_stack.stub.Generate(owner).stats.proposers[0] == SUFFIX
    other = request(prompt, max_new_tokens=32, mode="AUTO", draft_model=SUFFIX)
    other.user_segment = "someone-else"
    # The prompt repeats no 3 tokens, so only the owner's cached response could match.
    assert hybrid_stack.stub.Generate(other).stats.proposers[0] == ""


def assert_another_salt_is_drafted_no_better(generate: Callable[[str, str], gateway_pb2.GenerationStats]) -> None:
    """generate(tenant, salt): the statistics of one request, forcing the suffix proposer,
    on a prompt that repeats no 3 tokens (only a cached response could match it)."""
    generate("acme", "user-x")
    stranger = generate("another-tenant", "")
    other_salt = generate("acme", "user-y")
    # Greedy, untimed (a forced proposer prices nothing by timings): with nothing cached
    # for it, a request's steps are a function of its tokens alone, so user Y's steps are
    # the stranger's, token for token, and neither starts from the cache.
    assert stranger.proposers[0] == other_salt.proposers[0] == ""
    assert (list(other_salt.proposers), list(other_salt.accepted_lengths)) == \
        (list(stranger.proposers), list(stranger.accepted_lengths))
    again = generate("acme", "user-x")  # user X's own repeat still meets its response
    assert again.proposers[0] == SUFFIX and again.accepted_lengths[0] == again.draft_lengths[0] >= 1
    assert sum(again.accepted_lengths) > sum(other_salt.accepted_lengths)


SALTED_PROMPT = "class Cache:\n    def __init__(self, size):\n        self.size = size"  # repeats no 3 tokens
TENANT_KEYS = {"acme": "acme-key-0123456789", "another-tenant": "another-key-9876543210"}


def test_another_salt_of_the_same_segment_is_drafted_no_better_than_another_segment(hybrid_stack):
    def generate(segment: str, salt: str) -> gateway_pb2.GenerationStats:
        req = request(SALTED_PROMPT, max_new_tokens=32, mode="AUTO", draft_model=SUFFIX)
        req.user_segment, req.cache_salt = segment, salt
        return hybrid_stack.stub.Generate(req).stats

    assert_another_salt_is_drafted_no_better(generate)


@pytest.fixture(scope="module")
def keyed_hybrid(hybrid_stack, tmp_path_factory):
    """A second gateway on the same workers, with API keys: the key decides the tenant."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{tenant} {key}\n" for tenant, key in TENANT_KEYS.items()))
    loop = LoopThread()
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                               verifier_address=f"127.0.0.1:{hybrid_stack.verifier.port}",
                               draft_address=f"127.0.0.1:{hybrid_stack.draft.port}", api_keys_file=keys,
                               model_free=(SUFFIX, PROMPT_LOOKUP), suffix_cache_tokens=4096)
    server = loop.run(create_gateway(settings))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    loop.run(server.stop(0))
    loop.close()


def test_with_keys_another_salt_of_the_same_tenant_is_drafted_no_better_than_another_tenant(keyed_hybrid):
    def generate(tenant: str, salt: str) -> gateway_pb2.GenerationStats:
        req = request(SALTED_PROMPT, max_new_tokens=32, mode="AUTO", draft_model=SUFFIX)
        req.cache_salt = salt
        return keyed_hybrid.Generate(req, metadata=[("authorization", f"Bearer {TENANT_KEYS[tenant]}")]).stats

    assert_another_salt_is_drafted_no_better(generate)


def test_gateway_info_lists_the_model_free_proposers(hybrid_stack):
    info = hybrid_stack.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
    free = {d.name for d in info.drafts if d.model_free}
    assert free == {SUFFIX, PROMPT_LOOKUP}
    assert all(d.usable and d.vocab_size == info.target.vocab_size for d in info.drafts if d.model_free)


def test_a_model_free_name_is_refused_where_it_is_not_hosted(stack):
    with pytest.raises(grpc.RpcError) as caught:
        stack.stub.Generate(request(PROMPT, mode="AUTO", draft_model=SUFFIX))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not host the model-free proposer 'suffix'" in caught.value.details()



@pytest.mark.parametrize("proposer,prompt", [
    (SUFFIX, "def fibonacci(n):"),
    # The prompt repeats itself, so prompt lookup matches from the first step.
    (PROMPT_LOOKUP, "def fibonacci(n):\n    return n\ndef fibonacci(n):"),
])
def test_sampled_output_with_a_model_free_proposer_follows_the_target(hybrid_stack, target_model, tokenizer,
                                                                      proposer, prompt):
    """q is one-hot for a model-free proposal: rejection sampling must still give the
    target's law. The suffix proposer drafts from the earlier requests' responses (the
    same tenant's), so after the first request every step is drafted."""
    joint = target_joint(target_model, tokenizer, prompt)
    trials = 1500
    drafted: list[int] = []

    def sample(seed: int) -> tuple[int, int]:
        req = request(prompt, temperature=TRANSFORM.temperature, top_k=TRANSFORM.top_k, seed=seed,
                      max_new_tokens=3, mode="FIXED", draft_length=2, draft_model=proposer)
        req.user_segment = f"chi-{proposer}"
        response = hybrid_stack.stub.Generate(req)
        drafted.append(response.stats.draft_lengths[0])
        return tuple(response.token_ids[:2])

    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    # Nearly every first step verified a proposal, so the recovered and the accepted paths
    # both carry the test.
    assert sum(d > 0 for d in drafted) > 0.9 * trials
    assert_follows_joint(counts, joint, trials)


def test_the_suffix_cache_gauge_reads_what_the_cache_holds(hybrid_stack):
    servicer = hybrid_stack.gateway.servicer.core
    cache = servicer.suffix_cache
    req = request(PROMPT, max_new_tokens=16, mode="AUTO")
    req.user_segment = "gauge"
    hybrid_stack.stub.Generate(req)
    families = {f.name: f for f in AcceptanceCollector(servicer.stats, servicer.costs, None, cache).collect()}
    held = families["specd_suffix_cache_tokens"].samples[0].value
    assert held == cache.tokens and 0 < held <= cache.max_tokens == 4096
    assert families["specd_suffix_cache_max_tokens"].samples[0].value == 4096


def test_specd_generate_says_which_proposers_drafted(hybrid_stack):
    from test_cli import specd

    args = ("generate", PROMPT, "--gateway", f"127.0.0.1:{hybrid_stack.gateway.port}", "--mode", "auto",
            "--max-new-tokens", "24")
    first = specd(*args)
    assert first.returncode == 0, first.stderr
    again = specd(*args)  # the same prompt again meets its response in the cache
    assert again.returncode == 0 and "steps drafted by" in again.stderr and "suffix ×" in again.stderr
