"""Model runtime shared by the draft and verifier services.

Loads any transformers causal LM and its tokenizer from a local directory, keeps one
KV cache per session (cropped to the committed length each step) and runs every
forward on one executor thread per model, never on the event loop. No gRPC here.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from specd.identity import weights_digest
from specd.sampling import Transform, probs_from_logits

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SessionNotFound(KeyError):
    """The worker does not hold this session (evicted, restarted, or out of sync)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway needs to know about a hosted model."""

    name: str
    vocab_size: int
    max_context: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]
    weights_digest: str = ""  # specd.identity.weights_digest of the model directory


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of the tokenizer's id→token map.

    Speculative decoding exchanges token ids, so draft and target agree exactly when
    every id means the same token; this hash says whether they do.
    """
    vocab = sorted((idx, tok) for tok, idx in tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def _eos_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


@dataclass
class KVSession:
    """One session's KV cache and the tokens it knows.

    `tokens` is the sequence as this worker knows it; the cache covers the first
    `cache.get_seq_length()` of them (a draft's last proposal is known but not cached).
    """

    cache: DynamicCache
    tokens: list[int] = field(default_factory=list)
    stream: str = ""  # the worker stream that opened it; only that stream's end drops it

    @property
    def cached(self) -> int:
        return self.cache.get_seq_length()


class SessionStore:
    """The sessions of one model, least recently used first; the only owner of them.

    Steps take a session out (`take`) and put it back when they succeed (`put`), so a
    step that fails leaves nothing stale behind: the gateway re-opens the session.
    """

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, KVSession] = OrderedDict()

    def take(self, session_id: str) -> KVSession:
        try:
            return self._sessions.pop(session_id)
        except KeyError:
            raise SessionNotFound(session_id) from None

    def put(self, session_id: str, session: KVSession) -> None:
        self._sessions[session_id] = session
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)  # evict the least recently used

    def drop(self, session_id: str, stream: str | None = None) -> None:
        """Forget a session; with `stream`, only if that stream opened it (a request that
        re-opened its session on a new stream must not lose it to the old one's end)."""
        session = self._sessions.get(session_id)
        if session is not None and (stream is None or session.stream == stream):
            del self._sessions[session_id]

    def __len__(self) -> int:
        return len(self._sessions)


@dataclass(frozen=True)
class Proposal:
    """x₁..x_γ and, unless greedy, q₁..q_γ [γ, V]."""

    tokens: list[int]
    probs: torch.Tensor | None
    forward_ms: float
    # q_i(x_i): the draft's probability of each proposed token (untempered when greedy);
    # the draft service reports them on its trace spans.
    token_probs: tuple[float, ...] = ()


@dataclass(frozen=True)
class Scores:
    """The target's view of γ+1 positions: argmax [γ+1] when greedy, else p [γ+1, V]."""

    argmax: list[int] | None
    probs: torch.Tensor | None
    forward_ms: float


class ModelRunner:
    """One causal LM with its tokenizer, its sessions and the one thread its forwards use."""

    def __init__(self, path: str | Path, *, name: str | None = None, dtype: str = "float32",
                 max_sessions: int = 64, device: str = "cpu") -> None:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(self.device).eval()
        config = self.model.config
        self.info = ModelInfo(
            name=name or path.name,
            vocab_size=int(config.vocab_size),
            max_context=int(getattr(config, "max_position_embeddings", 0) or 2048),
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
            eos_token_ids=_eos_ids(self.model, self.tokenizer),
            weights_digest=weights_digest(path),
        )
        self.sessions = SessionStore(max_sessions)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"model-{self.info.name}")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on this model's thread and await it."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def end_session(self, session_id: str, stream: str) -> None:
        """Forget a session once the stream that opened it ends (on the model's thread, its owner)."""
        try:
            self._executor.submit(self.sessions.drop, session_id, stream)
        except RuntimeError:  # the executor is shut down: the sessions go with it
            pass

    def tokenizer_files(self) -> list[str]:
        """Names of the tokenizer files in the model directory (what the gateway needs)."""
        names = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json"}
        return sorted(p.name for p in self.path.iterdir() if p.name in names)

    # -- session bookkeeping ------------------------------------------------------------

    def _sync(self, session_id: str, start: int, tokens: list[int], stream: str) -> tuple[KVSession, list[int]]:
        """Take the session, crop it to `start` known tokens, and return what to feed next.

        start == 0 (re)opens the session from `tokens`. The returned feed is the known
        tokens the cache lacks up to `start`, then `tokens`.
        """
        if start == 0:
            self.sessions.drop(session_id)
            session = KVSession(DynamicCache(config=self.model.config), stream=stream)
        else:
            session = self.sessions.take(session_id)
            if start > len(session.tokens):
                raise SessionNotFound(
                    f"{session_id}: asked to keep {start} tokens but only {len(session.tokens)} are known")
        keep = min(start, session.cached)
        if session.cached > keep:
            session.cache.crop(keep - session.cached)  # negative: drop that many from the end
        feed = session.tokens[keep:start] + list(tokens)
        session.tokens = session.tokens[:start] + list(tokens)
        return session, feed

    @torch.inference_mode()
    def _forward(self, session: KVSession, feed: list[int], keep: int) -> torch.Tensor:
        """Append `feed` to the session's cache; return logits [keep, V] of its last positions."""
        if max(feed) >= self.info.vocab_size or min(feed) < 0:
            raise ValueError(f"token id {max(feed) if max(feed) >= self.info.vocab_size else min(feed)} is "
                             f"outside {self.info.name}'s vocabulary of {self.info.vocab_size}")
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=session.cache, use_cache=True, logits_to_keep=keep)
        # The math after the forward is a few small vectors: it runs on the CPU.
        return out.logits[0, -keep:].float().cpu()

    # -- the two operations the services expose -----------------------------------------

    def propose(self, session_id: str, start: int, tokens: list[int], draft_length: int,
                transform: Transform, seed: int, min_confidence: float = 0.0, stream: str = "",
                vocab_limit: int = 0) -> Proposal:
        """Draft side: bring the session up to date and propose up to `draft_length` tokens.

        The last proposal is sampled but not fed to the model (nothing needs its
        logits yet); it stays known, so the next step feeds it if it was accepted.
        With min_confidence, proposing stops early (after at least one token) when the
        draft's top probability for the next token falls below it. vocab_limit > 0 keeps
        proposals below that id (the target's vocabulary).
        """
        if draft_length < 1:
            raise ValueError("draft_length must be >= 1")
        began = time.perf_counter()
        session, feed = self._sync(session_id, start, tokens, stream)
        if not feed:
            raise ValueError("nothing to feed: a step must carry at least one new committed token")
        generator = torch.Generator().manual_seed(seed)
        drafted: list[int] = []
        probs = []
        token_probs: list[float] = []
        for _ in range(draft_length):
            logits = self._forward(session, feed, 1)
            if vocab_limit:
                logits = logits[:, :vocab_limit]
            q = torch.softmax(logits[0], -1) if transform.greedy else probs_from_logits(logits, transform)[0]
            if drafted and float(q.max()) < min_confidence:
                break
            if transform.greedy:
                token = int(logits[0].argmax())
            else:
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            drafted.append(token)
            token_probs.append(float(q[token]))
            feed = [token]
        session.tokens.extend(drafted)
        self.sessions.put(session_id, session)
        return Proposal(drafted, torch.stack(probs) if probs else None,
                        (time.perf_counter() - began) * 1e3, tuple(token_probs))

    def score(self, session_id: str, start: int, tokens: list[int], draft_tokens: list[int],
              transform: Transform, stream: str = "") -> Scores:
        """Target side: bring the session up to date and score γ+1 positions in one forward.

        With no draft tokens this is one plain decoding step (one position).
        """
        began = time.perf_counter()
        session, feed = self._sync(session_id, start, tokens, stream)
        if not feed:
            raise ValueError("nothing to score: a step must carry at least one new committed token")
        feed = feed + list(draft_tokens)
        session.tokens.extend(draft_tokens)
        logits = self._forward(session, feed, len(draft_tokens) + 1)
        self.sessions.put(session_id, session)
        elapsed = (time.perf_counter() - began) * 1e3
        if transform.greedy:
            return Scores(logits.argmax(dim=-1).tolist(), None, elapsed)
        return Scores(None, probs_from_logits(logits, transform), elapsed)
