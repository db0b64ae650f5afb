"""Turning generated token ids into text, incrementally, with stop strings.

The streamed text must concatenate to the final text, so a delta is released only when
it can no longer change: not while it ends in an incomplete UTF-8 character (decoded
as U+FFFD) and not while its tail could still grow into a stop string.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextAssembler:
    """Accumulates generated tokens; releases text deltas; detects stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids: list[int] = []
        self.released = 0  # characters of text already handed out
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop_index(self, text: str) -> int:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """Add emitted tokens; return (text delta to release, tokens kept).

        When a stop string completes, only the tokens up to the one that completed it
        are kept, the text is cut before the stop string, and `stopped` becomes True.
        """
        assert not self.stopped, "no tokens after a stop string"
        before = len(self.token_ids)
        self.token_ids.extend(tokens)
        text = self._decode(self.token_ids)
        if self.stop and self._stop_index(text) >= 0:
            # Keep the fewest new tokens whose text already contains the stop string.
            for kept in range(1, len(tokens) + 1):
                text = self._decode(self.token_ids[:before + kept])
                cut = self._stop_index(text)
                if cut >= 0:
                    break
            self.token_ids = self.token_ids[:before + kept]
            self.stopped = True
            return self._release(text[:cut]), tokens[:kept]
        safe = len(text) - self._hold
        while safe > self.released and text[safe - 1] == "\ufffd":
            safe -= 1
        return self._release(text[:safe]), list(tokens)

    def finish(self) -> str:
        """The text not yet released, once generation is over."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.token_ids))

    def _release(self, text: str) -> str:
        delta = text[self.released:]
        self.released += len(delta)
        return delta
