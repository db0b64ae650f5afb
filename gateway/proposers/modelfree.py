"""Model-free proposers: drafts the gateway makes from tokens it has already seen.

No model, no hop: a proposal costs microseconds of the gateway's time, so whenever the
text ahead repeats text seen before, these propose long drafts almost for free.

- `prompt-lookup` (`PromptLookup`), as vLLM's `ngram` method and transformers'
  `prompt_lookup_num_tokens`: the longest n-gram (min_n ≤ n ≤ max_n) at the end of the
  request's tokens is looked up in the request's own earlier tokens (prompt and output
  so far); the tokens that followed its latest occurrence are the proposal.
- `suffix` (`SuffixProposer`), after SuffixDecoding (Oliaro et al., NeurIPS 2025;
  vLLM's `suffix` method): the end of the request's tokens is matched against the
  request's own tokens and against previous responses of the same tenant and
  `cache_salt` (`SuffixCache`). Among every occurrence of the longest matching pattern
  it follows the most frequent continuation, token by token; each token's confidence is
  the share of the occurrences still in agreement. The draft stops where the running
  product of confidences falls below `min_token_prob`, or past `spec_factor` × the
  pattern length: a weak match proposes little.

Instead of a suffix tree, `TokenIndex` keeps, for every `ANCHOR`-gram, where it occurred.
Matching walks back from those occurrences, which gives the same longest pattern and the
same continuation counts as a suffix tree for patterns of at least `ANCHOR` tokens, with
memory linear in the tokens held (a suffix trie of depth D holds up to D nodes a token).

Both are proposers as the engine knows them (`gateway.proposers.base.Proposer`, through
`GatewayProposer`): their proposals are deterministic, so q is one-hot, and rejection
sampling keeps the target's distribution for sampled requests as for greedy ones (the
proposer draws the recovered token from p with the rejected token removed). Which
proposal a step takes is `gateway.proposers.hybrid`'s choice.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence

import torch

from gateway.proposers.base import Proposal, Recovered, StepContext
from specd.contract import PROMPT_LOOKUP, SUFFIX
from specd.rejection import Draws, TargetVerdict, finish_verdict

ANCHOR = 3  # tokens of the n-gram an occurrence is indexed by: the shortest suffix match
MAX_PATTERN = 32  # how far back a match is measured
MAX_OCCURRENCES = 32  # most recent occurrences kept per anchor (older ones are the likeliest stale)


class TokenIndex:
    """Token sequences, and where each `ANCHOR`-gram occurs in them.

    A sequence may grow (`extend`) and may be dropped (`drop`). Positions are indexed once
    a token follows them, so an occurrence always has a continuation to propose.
    """

    def __init__(self) -> None:
        self.sequences: dict[int, list[int]] = {}
        self._anchors: dict[tuple[int, ...], deque[tuple[int, int]]] = {}
        self._indexed: dict[int, int] = {}  # sequence → positions indexed so far
        self.tokens = 0

    def extend(self, sequence: int, tokens: Sequence[int]) -> None:
        """Append tokens to a sequence (a new id starts one)."""
        held = self.sequences.setdefault(sequence, [])
        held.extend(tokens)
        self.tokens += len(tokens)
        start = self._indexed.get(sequence, ANCHOR)
        # The anchor ending at position p-1 is indexed at p: once token p follows it.
        for end in range(start, len(held)):
            key = tuple(held[end - ANCHOR:end])
            slots = self._anchors.get(key)
            if slots is None:
                slots = self._anchors[key] = deque(maxlen=MAX_OCCURRENCES)
            slots.append((sequence, end))
        self._indexed[sequence] = max(start, len(held))

    def drop(self, sequence: int) -> int:
        """Forget a sequence; returns its length."""
        held = self.sequences.pop(sequence, [])
        self._indexed.pop(sequence, None)
        self.tokens -= len(held)
        for end in range(ANCHOR, len(held)):
            key = tuple(held[end - ANCHOR:end])
            slots = self._anchors.get(key)
            if slots is None:
                continue
            kept = [slot for slot in slots if slot[0] != sequence]
            if kept:
                self._anchors[key] = deque(kept, maxlen=MAX_OCCURRENCES)
            else:
                del self._anchors[key]
        return len(held)

    def occurrences(self, context: Sequence[int]) -> list[tuple[int, list[int], int]]:
        """Every indexed occurrence of the context's last ANCHOR tokens, each as (pattern
        length matched backwards, its sequence, the position after it)."""
        if len(context) < ANCHOR:
            return []
        slots = self._anchors.get(tuple(context[-ANCHOR:]))
        if not slots:
            return []
        found = []
        for sequence, end in slots:
            held = self.sequences[sequence]
            length = ANCHOR
            limit = min(MAX_PATTERN, end, len(context))
            while length < limit and held[end - length - 1] == context[-length - 1]:
                length += 1
            found.append((length, held, end))
        return found


def follow(occurrences: list[tuple[int, list[int], int]], max_tokens: int, min_token_prob: float,
           spec_factor: float) -> tuple[list[int], list[float], int]:
    """SuffixDecoding's walk: from the occurrences of the longest pattern, take the most
    frequent next token while the running product of shares stays ≥ min_token_prob.

    Returns (tokens, each token's share of the occurrences still agreeing, pattern length)."""
    if not occurrences:
        return [], [], 0
    pattern = max(length for length, _, _ in occurrences)
    alive = [(held, end) for length, held, end in occurrences if length == pattern]
    limit = min(max_tokens, max(1, int(spec_factor * pattern)))
    tokens: list[int] = []
    shares: list[float] = []
    running = 1.0
    while len(tokens) < limit and alive:
        counts: dict[int, int] = {}
        for held, end in alive:
            if end < len(held):
                counts[held[end]] = counts.get(held[end], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda item: item[1])
        share = count / len(alive)
        running *= share
        if running < min_token_prob:
            break
        tokens.append(token)
        shares.append(share)
        alive = [(held, end + 1) for held, end in alive if end < len(held) and held[end] == token]
    return tokens, shares, pattern


class SuffixCache:
    """Previous responses, per tenant and salt, within a budget of tokens across tenants.

    Partitioned by tenant (the request's user segment, which an API key decides) and,
    within a tenant, by the request's prefix cache salt (`ParsedRequest.cache_salt`,
    which carries the client's own `cache_salt`): one partition's outputs are never
    proposed to another's requests. The target decides every token, so output would not
    change; but how fast a request runs, and the steps its statistics report, would tell
    what others had generated. Once the budget is spent, the tenant holding the most
    tokens gives up the oldest response of its largest partition: a tenant that sends a
    lot pushes out its own entries, not the others', however many salts it spreads them
    over, and within a tenant a salt that sends a lot pushes out its own. Shared by the
    gateway's requests (which run on its event loop; a lock keeps the metrics thread's
    reads whole).
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._partitions: dict[str, dict[bytes, TokenIndex]] = {}  # tenant → salt → its responses
        self._held: dict[str, int] = {}  # tenant → tokens over its partitions
        self._next = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens held now, over every tenant."""
        with self._lock:
            return sum(self._held.values())

    def add(self, tenant: str, salt: bytes, tokens: Sequence[int]) -> None:
        """Keep one response (with the end of its prompt before it, so that the same prompt
        again matches into the response), evicting past the budget (see the class)."""
        tokens = list(tokens)[-self.max_tokens:] if self.max_tokens > 0 else []
        if len(tokens) <= ANCHOR:
            return
        with self._lock:
            index = self._partitions.setdefault(tenant, {}).setdefault(salt, TokenIndex())
            index.extend(self._next, tokens)
            self._next += 1
            self._held[tenant] = self._held.get(tenant, 0) + len(tokens)
            held = sum(self._held.values())
            while held > self.max_tokens:
                held -= self._evict()

    def _evict(self) -> int:
        """Drop the oldest response of the largest partition of the tenant holding the most
        tokens; returns its length (called with the lock held). Kept per tenant, the totals
        make this one pass over the tenants and that tenant's salts, however many responses
        they hold."""
        tenant = max(self._held, key=self._held.__getitem__)
        salts = self._partitions[tenant]
        salt = max(salts, key=lambda name: salts[name].tokens)
        largest = salts[salt]
        dropped = largest.drop(next(iter(largest.sequences)))  # its oldest response
        self._held[tenant] -= dropped
        if not largest.tokens:
            del salts[salt]
        if not salts:
            del self._partitions[tenant], self._held[tenant]
        return dropped

    def occurrences(self, tenant: str, salt: bytes, context: Sequence[int]) -> list[tuple[int, list[int], int]]:
        """The occurrences of the context's end (`TokenIndex.occurrences`) in the responses
        kept under this tenant and salt only."""
        with self._lock:
            index = self._partitions.get(tenant, {}).get(salt)
            return index.occurrences(context) if index is not None else []


class GatewayProposer(ABC):
    """A proposer running in the gateway (`gateway.proposers.base.Proposer`): each kind makes
    its proposals its own way, and does alike what follows.

    Its proposal is deterministic, so q is one-hot and the gateway holds it: the recovered
    token is drawn here. It holds no session anywhere and reads the committed tokens afresh
    at each lookup, so a commit leaves it nothing to settle.
    """

    name: str

    @abstractmethod
    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        """Up to `max_tokens` tokens that follow `context.committed` somewhere this proposer looks."""

    @abstractmethod
    def index(self, committed: Sequence[int]) -> None:
        """Take in the tokens of `committed` not seen yet, proposing nothing."""

    async def recover(self, proposal: Proposal, verdict: TargetVerdict, draws: Draws,
                      context: StepContext, next_gamma: int) -> Recovered:
        """Drawn here from norm(max(0, p − q)) with q one-hot on the rejected token."""
        assert verdict.rejected_row is not None  # a rejection carries p's row
        vocab_size = len(verdict.rejected_row)

        def one_hot(i: int) -> torch.Tensor:
            # Made only for the rejected position: a whole q would be a vocabulary per token.
            q = torch.zeros(vocab_size)
            q[proposal.tokens[i]] = 1.0
            return q

        return Recovered(finish_verdict(verdict, one_hot, draws).token)

    def settle(self, proposal: Proposal, position: int) -> None:
        """Nothing to settle."""
        return None

    def proposal(self, tokens: list[int], confidence: tuple[float, ...] | None = None) -> Proposal:
        """A match as a proposal: q(x) = 1 for each token, since the match is deterministic
        (`recover` builds the one-hot row a rejection needs). What the lookups cost is the
        hybrid choice's to time, over all the request's proposers."""
        return Proposal(tokens, (1.0,) * len(tokens), proposer=self, confidence=confidence)


class PromptLookup(GatewayProposer):
    """One request's n-gram lookup over its own tokens (vLLM's `ngram`)."""

    name = PROMPT_LOOKUP

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._after: dict[tuple[int, ...], int] = {}  # n-gram → the position after its latest occurrence
        self._tokens: list[int] = []

    def index(self, committed: Sequence[int]) -> None:
        """Index the tokens not indexed yet (the engine calls this with the prompt off the
        event loop, so a long prompt's first step does not stall other requests)."""
        tokens = self._tokens
        start = len(tokens)
        tokens.extend(committed[start:])
        # An n-gram is indexed once a token follows it: its own last occurrence is never a match.
        for end in range(max(start, 1), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._after[tuple(tokens[end - n:end])] = end

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        self.index(context.committed)
        tokens = self._tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            after = self._after.get(tuple(tokens[-n:]))
            if after is not None:
                return self.proposal(tokens[after:after + max_tokens])
        return self.proposal([])


class SuffixProposer(GatewayProposer):
    """One request's suffix matching: over its own tokens, then the responses cached under
    its tenant and salt (see SuffixCache)."""

    name = SUFFIX

    def __init__(self, cache: SuffixCache | None, tenant: str, salt: bytes, min_token_prob: float = 0.1,
                 spec_factor: float = 1.0) -> None:
        self.cache, self.tenant, self.salt = cache, tenant, salt
        self.min_token_prob, self.spec_factor = min_token_prob, spec_factor
        self._own = TokenIndex()

    def index(self, committed: Sequence[int]) -> None:
        """Index the request's tokens not indexed yet (see PromptLookup.index)."""
        own = self._own.sequences.get(0, [])
        self._own.extend(0, committed[len(own):])

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        committed = context.committed
        self.index(committed)
        found = self._own.occurrences(committed)
        if self.cache is not None:
            found += self.cache.occurrences(self.tenant, self.salt, committed)
        tokens, shares, _ = follow(found, max_tokens, self.min_token_prob, self.spec_factor)
        return self.proposal(tokens, tuple(shares))
