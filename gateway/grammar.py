"""Structured output: the grammar a request's output must match, held by the gateway.

llguidance (the guidance project's matcher, also a backend of vLLM and llama.cpp)
compiles a JSON Schema, a regular expression, a list of choices or a Lark grammar, and
tells, token by token, what may come next. The gateway owns one matcher per request and
keeps it at the committed tokens; each step:

- the proposal, a draft model's or a model-free one, is checked against the grammar
  (`Grammar.follow`): it is kept up to its first token the grammar forbids, and that token
  with it. The target gives such a token probability 0, so it is rejected for certain, and
  the step draws its token from the residual of that position, as for any rejection: the
  exact law, whatever q the proposer drew it from;
- the verifier gets, for each of the γ + 1 positions, the tokens the grammar allows there
  (the matcher walks the proposal, then rolls back), and forbids the rest after the
  penalties, greedy or sampled. So the output is the target's own under the grammar,
  whatever proposed it;
- the committed tokens advance the matcher (`Grammar.commit`, taken at the next check).

All of it runs on the gateway's grammar threads (`GrammarWork`), never on the event loop,
under llguidance's limits and a time budget per step (`specd.grammars` says why both):
a grammar that overruns them ends its request with an error, and the other requests'
steps go on. Compiled grammars are cached by their text, so a repeated schema compiles
once.

The draft model proposes under the same grammar (`draft_service.grammar`: the compiled
grammar travels with each proposal request), so its tokens are mostly allowed; where its
mask differs from the gateway's (another EOS, a cursor that gave up), the forbidden tokens
it proposes are rejections like any other. docs/sampling.md has the design and figures.
No gRPC here.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from gateway.errors import InvalidRequest
from specd.grammars import CompiledGrammars, GrammarError, matcher_error

BUDGET_STEPS = 4  # the steps whose mean grammar time the step budget bounds
BUDGET_CEILING = 5  # a single step may take this many budgets, no more

# vLLM's structured_outputs kinds, and OpenAI's response_format ones mapped onto them.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 256 * 1024
# JSON as `json.dumps` writes it, with no whitespace of the model's choosing: flexible
# whitespace lets a model write blanks forever, and JSON's meaning does not depend on it
# (vLLM's --structured-outputs-config.disable_any_whitespace, xgrammar's any_whitespace=False).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructureSpec:
    """What a request's output must match: a kind of KINDS and its text (the schema as JSON,
    the regex, the choices as a JSON list, the grammar)."""

    kind: str
    source: str

    def grammar(self) -> str:
        """llguidance's grammar for the structure; ValueError naming what is wrong with it."""
        if self.kind == "json":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                  defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not isinstance(choices, list):
                raise ValueError("choice needs a list of one or more non-empty strings")
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice needs a list of one or more non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if self.kind == "grammar":
            # vLLM users send GBNF (xgrammar's EBNF, "::="); llguidance reads Lark.
            lark = gbnf_to_lark(self.source) if "::=" in self.source else self.source
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise ValueError(f"unknown structure kind {self.kind!r}; use one of {list(KINDS)}")


def tokenizer_for(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the target's tokenizer, over the target's whole vocabulary (its
    logits may have more rows than the tokenizer has tokens: those are never allowed)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))


@functools.lru_cache(maxsize=64)
def structure_grammar(spec: StructureSpec) -> str:
    """The grammar text of a request's structure; ValueError with what a person can fix.
    Kept for the structures seen last: converting a 200 KB schema takes about 8 ms on the
    parse thread, which every request's prompt waits for. The matcher is built on a
    grammar thread (`GrammarWork.start`)."""
    if len(spec.source.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {spec.kind} is over {MAX_GRAMMAR_BYTES} bytes")
    try:
        return spec.grammar()
    except ValueError:
        raise
    except Exception as exc:  # the converters' own complaints, of any type: a bad structure, not a fault
        raise ValueError(f"the {spec.kind} does not compile: {exc}") from exc


class Grammar:
    """One request's matcher, kept at its committed output. Its work runs on the gateway's
    grammar threads, and each step's is timed against the step budget."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int],
                 step_budget_ms: float, threads: Executor) -> None:
        self.matcher = matcher
        self.threads = threads
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.step_budget_ms = step_budget_ms
        # The last steps' grammar times, in this thread's CPU time: their mean is held to the
        # budget. One step alone may pass it (up to BUDGET_CEILING times): the first mask in a
        # new part of a large schema builds lexer states, 125 ms once for 3,000 property names.
        # Wall time would count the waits for the GIL and the cores, which a busy gateway
        # has plenty of (a 3-token regex step once took 138 ms of it).
        self.recent_ms: deque[float] = deque(maxlen=BUDGET_STEPS)
        self.uncommitted: list[int] = []  # emitted by the last step, taken at the start of the next

    async def check(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """`follow` on a grammar thread."""
        return await asyncio.get_running_loop().run_in_executor(self.threads, self.follow, tokens)

    def follow(self, tokens: list[int]) -> tuple[int, torch.Tensor]:
        """How many leading tokens of a proposal the step verifies, and the allowed tokens at
        each position after the committed ones: int32 bitmask words [kept + 1, ceil(V / 32)].

        Every allowed token is kept, up to and with the first EOS (nothing after it is ever
        committed). So is the first token the grammar forbids: the target gives it
        probability 0, so it is rejected for certain, and the step draws its token from
        the residual norm(max(0, p − q)) of that position, the exact law whatever q the
        proposer drew it from. (Ending the step before it and drawing from p instead is
        exact only where q is a point mass: greedy, or a model-free proposal.) The rows
        after a forbidden token or an EOS are never read and allow everything.

        GrammarError when the grammar fails one of llguidance's limits or its work overruns
        the budget (`recent_ms`): the request ends with that error, never with output cut
        short."""
        began = time.thread_time()  # this thread's CPU: a wait for the GIL or a core is not the grammar's
        if self.uncommitted:
            committed, self.uncommitted = self.uncommitted, []
            if not self.matcher.consume_tokens(committed):
                self._fail("the grammar refused the committed tokens")
        allowed = self.matcher.validate_tokens(tokens) if tokens else 0
        ended = next((i + 1 for i, t in enumerate(tokens[:allowed]) if t in self.eos_token_ids), None)
        kept = ended or min(allowed + 1, len(tokens))
        words = llguidance.torch.allocate_token_bitmask(kept + 1, self.vocab_size)
        taken = 0
        for i, token in enumerate(tokens[:kept]):
            llguidance.torch.fill_next_token_bitmask(self.matcher, words, i)
            if i == allowed or token in self.eos_token_ids:
                # An EOS is not taken: rolling back over it leaves the matcher unable to take it again.
                break
            if not self.matcher.consume_token(token):
                self._fail(f"the grammar refused token {token} it allowed")
            taken += 1
        else:
            llguidance.torch.fill_next_token_bitmask(self.matcher, words, kept)
        if taken:
            self.matcher.rollback(taken)
        if self.matcher.is_error():
            self._fail("the grammar passed one of its limits")
        self.recent_ms.append((time.thread_time() - began) * 1e3)
        mean_ms = sum(self.recent_ms) / len(self.recent_ms)
        full = len(self.recent_ms) == BUDGET_STEPS
        if full and mean_ms > self.step_budget_ms or self.recent_ms[-1] > BUDGET_CEILING * self.step_budget_ms:
            raise GrammarError(f"the grammar took {mean_ms:.0f} ms a step over its last {len(self.recent_ms)} steps "
                               f"(the last: {self.recent_ms[-1]:.0f} ms for {kept} tokens), over this gateway's budget "
                               f"of {self.step_budget_ms:g} ms (--grammar-step-budget-ms): an ambiguous grammar (a "
                               f"rule like `s: s s`) costs more at every token; make it unambiguous")
        return kept, words

    def commit(self, tokens: list[int]) -> None:
        """The step's emitted tokens (each one allowed where it was chosen), taken by the next
        `follow`, on its thread. An EOS ends the output: the matcher is not made to take it."""
        self.uncommitted.extend(t for t in tokens if t not in self.eos_token_ids)

    def _fail(self, what: str) -> None:
        raise GrammarError(f"{what}: {matcher_error(self.matcher)}")


class GrammarWork:
    """The gateway's grammar threads and compiled grammars: every compile, mask and commit of
    structured output runs here, never on the event loop, which every request's steps share."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int,
                 eos_token_ids: tuple[int, ...], *, threads: int, step_budget_ms: float,
                 compile_budget_s: float) -> None:
        self.compiled = CompiledGrammars(tokenizer, vocab_size, compile_budget_s=compile_budget_s)
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.step_budget_ms = step_budget_ms
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="grammar")

    async def start(self, grammar: str) -> Grammar:
        """A request's matcher of `grammar`; InvalidRequest when it cannot be served."""
        try:
            matcher = await asyncio.get_running_loop().run_in_executor(self._threads, self.compiled.matcher, grammar)
        except GrammarError as exc:
            raise InvalidRequest(f"structured output: {str(exc)[:600]}") from None
        return Grammar(matcher, self.vocab_size, self.eos_token_ids, self.step_budget_ms, self._threads)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
