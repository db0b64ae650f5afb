"""The corpus proposer: drafts from what the target itself wrote before, with no model.

A *corpus* is the target's own greedy answers to a set of requests, each with the end of
its prompt before it (`specd corpus` writes one). The gateway turns it into an n-gram
table (`NGramTable`): for every context of 1 to `MAX_ORDER` tokens seen at least
`MIN_SUPPORT` times, the token that most often followed it and how often. A proposal
follows the table from the request's last tokens, the longest context it holds first,
token by token, each token's confidence the share of the context's occurrences that the
token followed (with one unseen occurrence added, so two of two is 2/3, not certain).

This is REST's datastore (He et al., "REST: Retrieval-Based Speculative Decoding", NAACL
2024) built from the target's own outputs rather than from a dataset: a small model's
answers repeat their own phrasing ("Here are some", the markdown of a list, the way a
step-by-step answer closes), which an n-gram table of a few hundred thousand tokens
predicts where the request's own tokens (`prompt-lookup`, `suffix`) have nothing to match.

The corpus is the operator's, shared by every tenant: it holds the target's answers to
requests the operator chose, never a tenant's. A corpus made with another tokenizer is
refused at start-up (`check_corpus`), since its ids would mean other tokens.

A proposal is deterministic (q one-hot), so rejection sampling keeps the target's
distribution, as for every model-free proposer (`gateway.proposers.modelfree`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.proposers.base import Proposal, StepContext
from gateway.proposers.modelfree import GatewayProposer
from specd.contract import CORPUS

FORMAT = "specd-corpus/1"
MAX_ORDER = 6  # the longest context the table keys
MIN_SUPPORT = 2  # a context seen once says nothing about what usually follows it
# The hash's multiplier: 2^64 / φ (Fibonacci hashing), odd, so multiplying by it mixes
# every bit of a token into the key and never maps two keys of one step to one.
_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
# An entry is one int, token | count | total, rather than a tuple of three: a third of the
# memory. Counts are clipped at 2^20 (a context seen more often than that keeps its share);
# the token keeps the top 24 bits of 64, any vocabulary up to 16M.
_COUNT_BITS = 20


@dataclass(frozen=True)
class Corpus:
    """Token sequences written by a target, and which tokenizer their ids belong to."""

    sequences: list[np.ndarray]  # each a 1-D array of token ids
    tokenizer_fingerprint: str
    source: str  # what it was made from, for people reading the file

    @property
    def tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def write_corpus(path: Path, corpus: Corpus) -> None:
    """Save a corpus as safetensors: every sequence's tokens end to end, and where each starts."""
    from safetensors.numpy import save_file

    lengths = np.array([len(s) for s in corpus.sequences], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.concatenate(corpus.sequences).astype(np.int32) if corpus.sequences else np.zeros(0, np.int32)
    save_file({"tokens": tokens, "starts": starts}, str(path),
              metadata={"format": FORMAT, "tokenizer_fingerprint": corpus.tokenizer_fingerprint,
                        "source": corpus.source})


def read_corpus(path: Path) -> Corpus:
    """A corpus file `write_corpus` wrote; ValueError, saying why, for anything else."""
    from safetensors import SafetensorError, safe_open

    remake = "write it again with `specd corpus`"
    try:
        with safe_open(str(path), framework="numpy") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"{path} is not a specd corpus (format {metadata.get('format')!r}, "
                                 f"expected {FORMAT!r}); `specd corpus` writes one")
            if set(file.keys()) != {"tokens", "starts"}:
                raise ValueError(f"{path} holds the tensors {sorted(file.keys())}, where a corpus holds "
                                 f"'tokens' and 'starts': {remake}")
            tokens, starts = file.get_tensor("tokens"), file.get_tensor("starts")
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"cannot read the corpus {path}: {exc}") from None
    integers = all(a.ndim == 1 and np.issubdtype(a.dtype, np.integer) for a in (tokens, starts))
    if not integers or len(starts) < 1 or starts[0] != 0 or starts[-1] != len(tokens) \
            or np.any(np.diff(starts) < 0) or (len(tokens) and tokens.min() < 0):
        raise ValueError(f"{path} is damaged (its tokens are not one row of ids that its starts cover): {remake}")
    sequences = [tokens[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
    return Corpus(sequences, metadata.get("tokenizer_fingerprint", ""), metadata.get("source", ""))


def check_corpus(corpus: Corpus, path: Path, tokenizer_fingerprint: str, vocab_size: int) -> str | None:
    """Why the target cannot be drafted from this corpus, or None when it can."""
    remake = "make one for this target with `specd corpus --target MODEL --questions FILE --out FILE`"
    if corpus.tokenizer_fingerprint != tokenizer_fingerprint:
        return (f"the corpus {path} was written with tokenizer {corpus.tokenizer_fingerprint[:12]}, the target "
                f"has {tokenizer_fingerprint[:12]}: its token ids would mean other tokens; {remake}")
    if not corpus.tokens:
        return f"the corpus {path} holds no answers; {remake}"
    largest = max(int(s.max()) for s in corpus.sequences if len(s))
    if largest >= vocab_size:
        return f"the corpus {path} holds token id {largest}, past the target's vocabulary of {vocab_size}; {remake}"
    return None


def _context_key(context: Sequence[int]) -> int:
    """The table's key of a context (its length mixed in, so orders never share a key)."""
    key = len(context)
    for token in context:
        key = (key * _MIX + token + 1) & _MASK
    return key


class NGramTable:
    """For each context of 1..`MAX_ORDER` tokens seen `MIN_SUPPORT` times or more in the
    corpus, the token that most often followed it, with that token's count and the
    context's. Built with numpy, one array operation per sequence and order; held as one
    packed int per context in a dict (about 100–150 bytes an entry), looked up by a hash of
    the context. Token ids must be below 2^24. Two contexts whose hashes collide (64 bits)
    would share an entry: a worse proposal, never a wrong output."""

    def __init__(self, sequences: Sequence[np.ndarray], max_order: int = MAX_ORDER,
                 min_support: int = MIN_SUPPORT) -> None:
        self.max_order = max_order
        keys, nexts = [], []
        for sequence in sequences:
            tokens = np.asarray(sequence, dtype=np.uint64)
            for order in range(1, min(max_order, len(tokens) - 1) + 1):
                count = len(tokens) - order  # windows with a token after them
                key = np.full(count, order, dtype=np.uint64)
                for k in range(order):
                    key = key * np.uint64(_MIX) + tokens[k:k + count] + np.uint64(1)
                keys.append(key)
                nexts.append(tokens[order:order + count])
        self._entries: dict[int, int] = {}
        if keys:
            self._entries = _most_frequent(np.concatenate(keys), np.concatenate(nexts), min_support)

    def __len__(self) -> int:
        return len(self._entries)

    def follow(self, context: Sequence[int], max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Up to `max_tokens` tokens the table predicts after `context`, each with its share
        (count / (context count + 1)); stops where the running product of shares falls
        below `min_prob` or where no context of the table matches."""
        context = list(context[-self.max_order:])
        tokens: list[int] = []
        shares: list[float] = []
        running = 1.0
        while len(tokens) < max_tokens:
            found = self._longest(context)
            if found is None:
                break
            token, share = found
            running *= share
            if running < min_prob:
                break
            tokens.append(token)
            shares.append(share)
            context = (context + [token])[-self.max_order:]
        return tokens, shares

    def _longest(self, context: list[int]) -> tuple[int, float] | None:
        for order in range(min(self.max_order, len(context)), 0, -1):
            packed = self._entries.get(_context_key(context[-order:]))
            if packed is not None:
                total = packed & ((1 << _COUNT_BITS) - 1)
                count = (packed >> _COUNT_BITS) & ((1 << _COUNT_BITS) - 1)
                return packed >> (2 * _COUNT_BITS), count / (total + 1)
        return None


def _most_frequent(keys: np.ndarray, nexts: np.ndarray, min_support: int) -> dict[int, int]:
    """Per key seen `min_support` times or more: its most frequent next token, packed with
    that token's count and the key's (counts clipped to `_COUNT_BITS`)."""
    order = np.lexsort((nexts, keys))
    keys, nexts = keys[order], nexts[order]
    pair_starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (nexts[1:] != nexts[:-1])])
    pair_counts = np.diff(np.r_[pair_starts, len(keys)])
    pair_keys, pair_nexts = keys[pair_starts], nexts[pair_starts]
    # Within each key, its pairs by count, highest first: a key's first pair is its most frequent.
    ranked = np.lexsort((-pair_counts, pair_keys))
    pair_keys, pair_nexts, pair_counts = pair_keys[ranked], pair_nexts[ranked], pair_counts[ranked]
    key_starts = np.flatnonzero(np.r_[True, pair_keys[1:] != pair_keys[:-1]])
    totals = np.add.reduceat(pair_counts, key_starts)
    kept = totals >= min_support
    limit = (1 << _COUNT_BITS) - 1
    starts = key_starts[kept]
    # Unsigned: a token id of 2^15 or more shifted into a signed int64 would turn negative.
    packed = ((pair_nexts[starts].astype(np.uint64) << np.uint64(2 * _COUNT_BITS))
              | (np.minimum(pair_counts[starts], limit).astype(np.uint64) << np.uint64(_COUNT_BITS))
              | np.minimum(totals[kept], limit).astype(np.uint64))
    return dict(zip(pair_keys[starts].tolist(), packed.tolist()))


class CorpusProposer(GatewayProposer):
    """One request's view of the shared table: it holds nothing of the request, and reads
    the committed tokens afresh at each lookup."""

    name = CORPUS

    def __init__(self, table: NGramTable, min_token_prob: float = 0.1) -> None:
        self.table = table
        self.min_token_prob = min_token_prob

    def index(self, committed: Sequence[int]) -> None:
        """Nothing to index: the table is the corpus's, built at start-up."""
        return None

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        tokens, shares = self.table.follow(context.committed, max_tokens, self.min_token_prob)
        return self.proposal(tokens, tuple(shares))
