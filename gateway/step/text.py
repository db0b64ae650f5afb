"""Turning generated token ids into text, incrementally, with stop strings.

The streamed text must concatenate to the final text, so a delta is released only when
it can no longer change: not while it ends in an incomplete UTF-8 character (decoded
as U+FFFD) and not while its tail could still grow into a stop string.

Each step decodes only a window of tokens, not the whole output (the incremental
detokenization of vLLM and TGI): the tokens decoded last time, for context, and the new
ones. The new text is what the window decodes to beyond what its first part decoded to.
The context matters: tokenizers that drop or merge spaces at the start of a decode
(SentencePiece's "▁") treat both decodes of the window alike, so the difference is what
the new tokens add to the text.

Known limit: a stop string is looked for in the text once its characters are whole. A
byte-fallback tokenizer's unfinished character can hide, for a step, a stop string that
a step completed just before it; the text is still cut before the stop string, but that
step's tokens were already kept. Decoding the whole output each step cost the gateway
0.28 ms per session and step at 2,000 tokens and grew with every token.
"""
from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Byte-level BPE (GPT-2's, Llama 3's, Qwen's) spells each byte as one printable character
# (GPT-2's alphabet); the tokenizers library's ByteLevel decoder maps them back.
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


def token_bytes(tokenizer: PreTrainedTokenizerBase, token: int, text: str) -> bytes:
    """A token's own bytes (OpenAI's logprob `bytes`), given `text`, what it decodes to alone.

    A token that holds part of a multi-byte character decodes to U+FFFD for that part,
    whose UTF-8 is not the token's bytes: its bytes are read from its piece instead, as
    the tokenizer's decoder reads them (a byte-fallback piece `<0xNN>` is the byte NN; a
    byte-level piece is one byte per character; any other piece is its text). The bytes
    of a character's tokens then join into the character's UTF-8.
    """
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    if not isinstance(piece, str):  # an id the tokenizer does not know: what it decoded to
        return text.encode("utf-8")
    if (byte := _BYTE_PIECE.fullmatch(piece)) is not None:
        return bytes([int(byte[1], 16)])
    if all(char in _BYTE_OF_CHAR for char in piece):
        return bytes(_BYTE_OF_CHAR[char] for char in piece)
    return text.encode("utf-8")


class TextAssembler:
    """Accumulates generated tokens; releases text deltas; detects stop strings."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        """min_tokens: a stop string counts only where it ends in the text of that many
        tokens or more, as vLLM holds stop strings back (and the workers hold EOS back).
        include_stop: the text ends after the stop string, not before it (vLLM's
        include_stop_str_in_output). skip_special_tokens: as the tokenizer's decode."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self._floor: int | None = 0 if min_tokens <= 1 else None  # characters a stop string must end past
        self.token_ids: list[int] = []
        self.text = ""  # the text of token_ids[:read_offset]: whole characters
        self.released = 0  # characters of text already handed out
        self.stopped = False
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        # The window: tokens from prefix_offset decode to text; those before read_offset
        # are in self.text already.
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces (" ." to "."), as vLLM's streaming: it rewrites text already
        # decoded, so streamed deltas would no longer add up to the final text.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _stop_index(self, text: str) -> int:
        """Where the text ends at the first stop string in `text` (before it, or after it
        with include_stop), among those that end past the text of the first
        min_tokens − 1 tokens; -1 for none."""
        if self._floor is None:
            if len(self.token_ids) < self.min_tokens:
                return -1
            self._floor = len(self._decode(self.token_ids[:self.min_tokens - 1]))
        hits = [(at, len(s)) for at, s in ((text.find(s, max(0, self._floor - len(s) + 1)), s) for s in self.stop)
                if at >= 0]
        if not hits:
            return -1
        at, length = min(hits)
        return at + length if self.include_stop else at

    def _read(self) -> str:
        """The text of every token so far, maybe ending in an incomplete character. Only
        whole characters join self.text (and move the window on): a character split over
        tokens waits there for its last byte."""
        window = self.token_ids[self._prefix_offset:]
        known = self._decode(window[:self._read_offset - self._prefix_offset])
        text = self._decode(window)
        tail = text[len(known):] if len(text) > len(known) else ""
        if tail and not text.endswith("\ufffd"):
            self.text += tail
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return self.text
        return self.text + tail

    def add(self, tokens: list[int]) -> tuple[str, list[int]]:
        """Add emitted tokens; return (text delta to release, tokens kept).

        When a stop string completes, only the tokens up to the one that completed it
        are kept, the text is cut before the stop string, and `stopped` becomes True.
        """
        assert not self.stopped, "no tokens after a stop string"
        before = len(self.token_ids)
        self.token_ids.extend(tokens)
        text = self._read()
        if self.stop and self._stop_index(text) >= 0:
            # Keep the fewest new tokens whose text already contains the stop string (rare:
            # whole decodes are affordable here).
            kept, cut = len(tokens), self._stop_index(text)
            for fewer in range(1, len(tokens)):
                prefix_text = self._decode(self.token_ids[:before + fewer])
                if (found := self._stop_index(prefix_text)) >= 0:
                    kept, text, cut = fewer, prefix_text, found
                    break
            self.token_ids = self.token_ids[:before + kept]
            self.stopped = True
            return self._release(text[:cut]), tokens[:kept]
        # An unfinished character (its U+FFFD placeholders) is held first, then the tail that
        # could still grow into a stop string: held together, the placeholders would use up
        # the hold and let a stop string's first characters out.
        whole = len(text)
        while whole > self.released and text[whole - 1] == "\ufffd":
            whole -= 1
        return self._release(text[:max(0, whole - self._hold)]), list(tokens)

    def finish(self) -> str:
        """The text not yet released, once generation is over."""
        if self.stopped:
            return ""
        return self._release(self._decode(self.token_ids))

    def _release(self, text: str) -> str:
        delta = text[self.released:]
        self.released += len(delta)
        return delta
