"""The draft's side of structured output: proposing under the request's grammar.

The gateway owns the grammar that decides the output (`gateway.grammar`): it cuts every
proposal to what the grammar allows and has the verifier restrict the target to it. A
draft that proposed without the grammar would see most of its tokens cut (a small model
rarely writes JSON unprompted), so the draft samples from its q restricted to the same
grammar, at every position it drafts. Its tokens then follow the structure, and q is the
distribution they were drawn from, as rejection sampling needs.

One `GrammarCursor` per session: llguidance's matcher kept at the session's output, moved
by rolling back and consuming only what changed since the last step, so a step costs
the tokens it adds, not the whole output. A pre-drafted branch takes a copy. The draft's
grammar is only a guide: a cursor that cannot follow its tokens stops constraining, and
the gateway's cut keeps the output exact all the same.
"""
from __future__ import annotations

from collections import OrderedDict

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from specd.sampling import allowed_from_words


class GrammarCursor:
    """A grammar's matcher kept at the output of one token sequence."""

    def __init__(self, matcher: llguidance.LLMatcher, grammar: str, vocab_size: int, output_start: int,
                 eos_token_ids: frozenset[int], consumed: list[int] | None = None) -> None:
        self.matcher = matcher
        self.grammar = grammar
        self.vocab_size = vocab_size
        self.output_start = output_start
        self.eos_token_ids = eos_token_ids
        self.consumed = consumed or []  # the output tokens the matcher has taken
        self.lost = matcher.is_error()  # it could not follow the tokens: no constraint any more

    def copy(self) -> GrammarCursor:
        """An independent cursor at the same place (for a pre-drafted branch)."""
        return GrammarCursor(self.matcher.deep_copy(), self.grammar, self.vocab_size, self.output_start,
                             self.eos_token_ids, list(self.consumed))

    def allowed(self, tokens: list[int]) -> torch.Tensor | None:
        """The tokens the grammar allows after `tokens` (a session's, prompt first), bool
        [1, V]; None when the cursor is lost, or after an EOS (nothing there is committed,
        and the matcher is not made to take an EOS it may have to roll back)."""
        output = tokens[self.output_start:]
        if not self.eos_token_ids.isdisjoint(output):
            return None
        if self.lost or not self._follow(output):
            self.lost = True
            return None
        words = llguidance.torch.allocate_token_bitmask(1, self.vocab_size)
        llguidance.torch.fill_next_token_bitmask(self.matcher, words, 0)
        return allowed_from_words(words, self.vocab_size)

    def _follow(self, output: list[int]) -> bool:
        """Move the matcher to `output`: roll back past where it parts from what was taken,
        then take the rest."""
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
    """Each session's cursor, for the sessions seen last (at most `capacity`); the LLTokenizer
    they share, built at the first structured request."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], capacity: int) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cursors: OrderedDict[str, GrammarCursor] = OrderedDict()

    def cursor(self, session_id: str, grammar: str, output_start: int) -> GrammarCursor:
        held = self._cursors.pop(session_id, None)
        if held is None or held.grammar != grammar or held.output_start != output_start:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=list(self.eos_token_ids))
            held = GrammarCursor(llguidance.LLMatcher(self._tokenizer, grammar, log_level=0), grammar,
                                 self.vocab_size, output_start, frozenset(self.eos_token_ids))
        self._cursors[session_id] = held
        while len(self._cursors) > self.capacity:
            self._cursors.popitem(last=False)
        return held

    def drop(self, session_id: str) -> None:
        self._cursors.pop(session_id, None)
