"""The draft's side of structured output: proposing under the request's grammar.

The gateway owns the grammar that decides the output (`gateway.grammar`): a proposed
token the grammar forbids is rejected there, and the verifier restricts the target to the
grammar. A draft that proposed without the grammar would see most of its tokens rejected
(a small model rarely writes JSON unprompted), so the draft samples from its q restricted to the same
grammar, at every position it drafts. Its tokens then follow the structure, and q is the
distribution they were drawn from, as rejection sampling needs.

One `GrammarCursor` per session: llguidance's matcher kept at the session's output, moved
by rolling back and consuming only what changed since the last step, so a step costs
the tokens it adds, not the whole output. A pre-drafted branch takes a copy. The draft's
grammar is only a guide: a cursor that cannot follow its tokens, or whose mask takes
longer than the mask budget (it runs on the model's thread, between every session's
forwards), stops constraining; the forbidden tokens it then proposes are rejections at
the gateway, and the output is exact all the same. Matchers come from `specd.grammars`,
compiled once per grammar on a thread of their own, not on the event loop.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from specd.grammars import CompiledGrammars, GrammarError
from specd.sampling import allowed_from_words


class GrammarCursor:
    """A grammar's matcher kept at the output of one token sequence."""

    def __init__(self, matcher: llguidance.LLMatcher | None, grammar: str, vocab_size: int, output_start: int,
                 eos_token_ids: frozenset[int], mask_budget_ms: float, consumed: list[int] | None = None) -> None:
        """matcher: None when the grammar did not compile here (the cursor starts lost)."""
        self.matcher = matcher
        self.grammar = grammar
        self.mask_budget_ms = mask_budget_ms
        self.vocab_size = vocab_size
        self.output_start = output_start
        self.eos_token_ids = eos_token_ids
        self.consumed = consumed or []  # the output tokens the matcher has taken
        self.lost = matcher is None or matcher.is_error()  # it gave up: no constraint any more

    def copy(self) -> GrammarCursor:
        """An independent cursor at the same place (for a pre-drafted branch)."""
        return GrammarCursor(None if self.lost or self.matcher is None else self.matcher.deep_copy(), self.grammar,
                             self.vocab_size, self.output_start, self.eos_token_ids, self.mask_budget_ms,
                             list(self.consumed))

    def allowed(self, tokens: list[int]) -> torch.Tensor | None:
        """The tokens the grammar allows after `tokens` (a session's, prompt first), bool
        [1, V]; None when the cursor is lost, or after an EOS (nothing there is committed,
        and the matcher is not made to take an EOS it may have to roll back)."""
        output = tokens[self.output_start:]
        if self.lost or not self.eos_token_ids.isdisjoint(output):
            return None
        assert self.matcher is not None  # a cursor with no matcher is lost
        began = time.thread_time()  # the mask's own CPU time, not the waits beside it
        words = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        followed = self._follow(output)
        if followed:
            llguidance.torch.fill_next_token_bitmask(self.matcher, words, 0)
        # Not followed, the words would allow everything while the cursor stays where it failed.
        if not followed or self.matcher.is_error() or (time.thread_time() - began) * 1e3 > self.mask_budget_ms:
            self.lost = True
            return None
        return allowed_from_words(words, self.vocab_size)

    def _follow(self, output: list[int]) -> bool:
        """Move the matcher to `output`: roll back past where it parts from what was taken,
        then take the rest."""
        assert self.matcher is not None
        same = 0
        limit = min(len(output), len(self.consumed))
        while same < limit and output[same] == self.consumed[same]:
            same += 1
        if same < len(self.consumed):
            if not self.matcher.rollback(len(self.consumed) - same):
                return False
            del self.consumed[same:]
        added = output[same:]
        if added:
            if not self.matcher.consume_tokens(added):
                return False
            self.consumed.extend(added)
        return True


class GrammarCursors:
    """Each session's cursor, for the sessions seen last (at most `capacity`), and the
    compiled grammars they start from (the LLTokenizer built at the first structured
    request)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], capacity: int,
                 mask_budget_ms: float) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self.mask_budget_ms = mask_budget_ms
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.compiled = CompiledGrammars(self._llguidance_tokenizer, vocab_size)
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="draft-grammar")
        self._cursors: OrderedDict[str, GrammarCursor] = OrderedDict()

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=list(self.eos_token_ids))
        return self._tokenizer

    async def cursor(self, session_id: str, grammar: str, output_start: int) -> GrammarCursor:
        held = self._cursors.pop(session_id, None)
        if held is None or held.grammar != grammar or held.output_start != output_start:
            try:
                matcher = await asyncio.get_running_loop().run_in_executor(self._compiler, self.compiled.matcher,
                                                                           grammar)
            except GrammarError:  # the gateway's own compile decides the request; here it only guides
                matcher = None
            held = GrammarCursor(matcher, grammar, self.vocab_size, output_start, frozenset(self.eos_token_ids),
                                 self.mask_budget_ms)
        self._cursors[session_id] = held
        while len(self._cursors) > self.capacity:
            self._cursors.popitem(last=False)
        return held

    def drop(self, session_id: str) -> None:
        self._cursors.pop(session_id, None)
