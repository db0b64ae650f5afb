"""An HTTP body's JSON, read and bounded, apart from the rest of the HTTP edge.

A body is parsed before anything else is done with it, and parsing costs the whole body:
json.loads of 889 KB takes about 30 ms and holds the GIL all along, so a flood of large
bodies parsed on a thread of the gateway's process makes the event loop, which every
request's steps run on, wait for each one. Bodies over LARGE_BODY_BYTES are therefore
parsed in a process of their own (`BodyParser`), and the gateway receives either the
checked object or the HttpError that refused it, never the objects a refused body would
have built. This module imports nothing heavy, so that process starts in a fraction of a
second and holds a few MB.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

# The most entries any JSON object in a body may hold: the largest a field may take, a JSON
# schema's properties (OpenAI's structured outputs allow 5,000 in a schema; `logit_bias`
# takes at most MAX_LOGIT_BIAS). json.loads hands each object's pairs to `_bounded_object`
# before it builds the object, so a larger one is refused before its dict is built and
# before the rest of the body is read.
MAX_OBJECT_ENTRIES = 5000
# The most values `structured_outputs.choice` may list: OpenAI's bound on a schema's enum
# values, which a choice is. llguidance compiles 1,000 in about 6 ms, 16,000 in 210 ms.
MAX_CHOICE_VALUES = 1000
# The most functions `tools` may list: OpenAI's bound.
MAX_TOOLS = 128

class HttpError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

    def __reduce__(self):
        # Raised in the body process and re-raised here: rebuilt from all its fields.
        return HttpError, (self.status, self.message, self.kind, self.param, self.headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _check_text(value: Any) -> None:
    """400 unless every string in the parsed body (keys too) is Unicode text: JSON's
    `\\ud800` escapes decode to lone surrogates, which no UTF-8 encoder (the tokenizer's,
    protobuf's, the log's) accepts."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise HttpError(400, f"the body holds a lone UTF-16 surrogate ({item[exc.start]!r}): JSON text "
                                         f"must be Unicode; escape a character outside the BMP as a surrogate "
                                         f"pair, or send it as UTF-8") from None
        elif isinstance(item, dict):
            pending.extend(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)


# Where a lone surrogate can come from in a body: JSON's escapes of one (\\ud800-\\udfff),
# or its UTF-8-like bytes, which json.loads lets through ("surrogatepass"). A body with
# neither (nearly every body) skips the walk over its strings.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def _bounded_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object of the body, built only when it holds at most MAX_OBJECT_ENTRIES."""
    if len(pairs) > MAX_OBJECT_ENTRIES:
        raise HttpError(400, f"the body holds an object of {len(pairs)} entries; this gateway reads at most "
                             f"{MAX_OBJECT_ENTRIES} in one ('logit_bias' takes at most a few thousand token ids, "
                             f"a JSON schema {MAX_OBJECT_ENTRIES} properties)")
    return dict(pairs)


def _check_counts(body: dict[str, Any], limits: BodyLimits) -> None:
    """400 for a field with more entries than this gateway takes, before anything is built
    from it (rendered, converted, sorted, compiled) and before the request is admitted."""
    structured = body.get("structured_outputs")
    counted = (("logit_bias", body.get("logit_bias"), limits.logit_bias, "token ids", ""),
               ("messages", body.get("messages"), limits.messages, "messages", " (--max-chat-messages)"),
               ("stop", body.get("stop"), limits.stop, "stop strings", ""),
               ("tools", body.get("tools"), MAX_TOOLS, "functions", ""),
               ("structured_outputs.choice", structured.get("choice") if isinstance(structured, dict) else None,
                MAX_CHOICE_VALUES, "values", ""))
    for name, value, limit, what, flag in counted:
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise HttpError(400, f"'{name}' holds {len(value)} {what}, over this gateway's limit of {limit}{flag}; "
                                 f"send fewer", param=name.split(".")[0])


def parse_body(raw: bytes, limits: BodyLimits) -> dict[str, Any]:
    """The body's JSON object, bounded and its text checked. An object past
    MAX_OBJECT_ENTRIES is refused while parsing, a field past its limit (`_check_counts`)
    once parsed: before its strings are walked or rendered."""
    try:
        value = json.loads(raw, object_pairs_hook=_bounded_object)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to read
        raise HttpError(400, f"the body is not valid JSON, or nests too deep: {str(exc)[:200]}") from exc
    if not isinstance(value, dict):
        raise HttpError(400, "the body must be a JSON object")
    _check_counts(value, limits)
    if _MAYBE_SURROGATE.search(raw):
        _check_text(value)
    return value


@dataclass(frozen=True)
class BodyLimits:
    """How many entries a body's counted fields may hold (`_check_counts`)."""

    messages: int
    stop: int
    logit_bias: int


# Smaller bodies are parsed on the body thread: 64 KB parse in about 2 ms, and a process
# hop would cost about as much.
LARGE_BODY_BYTES = 64 * 1024


class BodyParser:
    """Where bodies are parsed: small ones on the edge's body thread, large ones in one
    process of their own, started at the first large body ("spawn": a fork would copy a
    process of many threads). One at a time each: a flood of large bodies queues there."""

    def __init__(self, limits: BodyLimits, thread: Executor) -> None:
        self.limits = limits
        self._thread = thread
        self._process: ProcessPoolExecutor | None = None

    async def parse(self, raw: bytes) -> dict[str, Any]:
        where: Executor = self._thread
        if len(raw) > LARGE_BODY_BYTES:
            if self._process is None:
                self._process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
            where = self._process
        return await asyncio.get_running_loop().run_in_executor(where, parse_body, raw, self.limits)

    def close(self) -> None:
        if self._process is not None:
            self._process.shutdown(wait=False, cancel_futures=True)
