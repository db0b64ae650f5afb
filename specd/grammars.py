"""Compiled grammars, shared by the gateway and the draft: llguidance's limits, set on every
matcher made, and a cache of compiled matchers by grammar text.

Compiling is the costly part of structured output: llguidance's matcher for a 250 KB JSON
schema takes about 2 s to build on a 2-core CPU, and the first mask of that matcher
another 50 ms, while its lexer states are built. `CompiledGrammars` builds each grammar once,
computes its first mask, and hands out deep copies (0.07 ms each), which start with the
lexer states the first mask built. It is called from grammar threads, never from an event
loop (llguidance releases the GIL for most of its work), and compiles one grammar at a
time, so a stream of new grammars takes one core at most.

The limits bound what one mask may cost; no limit of llguidance's bounds the cost that
grows with the output, as an ambiguous grammar's does (`s: s s | "a"`: each token's mask
costs more than the last, 150 ms at 250 tokens). The callers time that themselves: the
gateway ends a request whose grammar overruns its step budget, the draft stops guiding a
proposal by a grammar that overruns its mask budget. No gRPC here.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.torch

# llguidance's documented defaults, written out so that an upgrade cannot loosen them
# unseen (its docstrings give each one's speed): lexer fuel at compile (~20 ms) and per mask
# (~14 ms); Earley items per mask (~2.5 ms); lexer states (1–2 kB each: ~500 MB at most);
# grammar symbols. One is raised: a row's items, from 2,000 to 25,000, because a JSON
# object's row holds about 4 items a property and OpenAI's structured outputs allow 5,000
# properties (3,000 made a row of 12,007, which the default refused after the first `{`).
# verbose_errors off: a refusal names the limit without dumping the parser's state into
# the client's error message.
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=25_000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
    max_lexer_states=250_000, max_grammar_size=500_000, precompute_large_lexemes=True, verbose_errors=False)


class GrammarError(ValueError):
    """A grammar that cannot be served: it does not compile, it passes one of llguidance's
    limits, or it overran a time budget. The message says which, for the client."""


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A failed matcher's reason, as one line a client can read."""
    return matcher.get_error().strip().splitlines()[0] if matcher.get_error().strip() else "no reason given"


class CompiledGrammars:
    """Compiled matchers by grammar text, the `capacity` used last, and the grammars that
    failed (a repeated bad grammar costs a lookup, not a compile). Thread-safe."""

    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int, *,
                 capacity: int = 64, compile_budget_s: float = 10.0) -> None:
        """tokenizer: llguidance's view of the model's tokenizer, built at the first compile.
        compile_budget_s: a grammar that took longer to compile is refused, and stays refused:
        the compile has been paid once, a repeat would pay it again."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.compile_budget_s = compile_budget_s
        self._held: OrderedDict[str, llguidance.LLMatcher | str] = OrderedDict()  # a matcher, or why it failed
        self._lock = threading.Lock()  # guards _held
        self._compiling = threading.Lock()  # one compile at a time

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher of `grammar`, at its start, compiled at most once while held;
        GrammarError when it cannot be served. Blocks for a compile: call it on a grammar
        thread."""
        held = self._lookup(grammar)
        if held is None:
            with self._compiling:
                held = self._lookup(grammar)  # another thread may have compiled it meanwhile
                if held is None:
                    held = self._compile(grammar)
                    with self._lock:
                        self._held[grammar] = held
                        while len(self._held) > self.capacity:
                            self._held.popitem(last=False)
        if isinstance(held, str):
            raise GrammarError(held)
        return held.deep_copy()

    def _lookup(self, grammar: str) -> llguidance.LLMatcher | str | None:
        with self._lock:
            held = self._held.get(grammar)
            if held is not None:
                self._held.move_to_end(grammar)
            return held

    def _compile(self, grammar: str) -> llguidance.LLMatcher | str:
        # This thread's CPU time, as the step budgets count: a compile that waited for a busy
        # machine's cores is not refused for good for it.
        began = time.thread_time()
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=LIMITS)
        if not matcher.is_error():
            # The first mask builds the lexer states every copy starts from.
            words = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
            llguidance.torch.fill_next_token_bitmask(matcher, words, 0)
        if matcher.is_error():
            return f"the grammar does not compile: {matcher_error(matcher)}"
        took = time.thread_time() - began
        if took > self.compile_budget_s:
            return (f"the grammar took {took:.1f} s to compile, over this server's budget of "
                    f"{self.compile_budget_s:g} s; send a smaller schema or grammar")
        return matcher
