"""What the HTTP app answers: the gateway's chunks as OpenAI's objects (a completion or chat
completion, whole or streamed as server-sent events, with each choice's log-probabilities
and tool calls, and a `usage` that carries the request's speculative figures under vLLM's
names), the core's errors as OpenAI error objects, and a stream's end when its client
goes away or the gateway drains."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import struct
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from gateway.core import Chunk
from gateway.edge.bodies import HttpError
from gateway.edge.tools import (
    ToolCalling,
    ToolReader,
    chunk_delta,
    reply_message,
)
from gateway.errors import RETRY_PUSHBACK_MS, Busy, InvalidRequest, WorkerError
from gateway.step.engine import TokenLogprob
from gateway.step.records import Finish
from gateway.step.text import token_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

_FINISH = {Finish.LENGTH: "length", Finish.EOS: "stop", Finish.STOP: "stop"}
_WORKER_STATUS = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                  grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.INVALID_ARGUMENT: 400}



def error_response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


def busy(message: str) -> HttpError:
    return HttpError(429, message, "rate_limit_error",
                     headers={"Retry-After": str(max(1, math.ceil(RETRY_PUSHBACK_MS / 1000)))})


def from_core(exc: Exception) -> HttpError:
    """The HTTP error of what the core raised."""
    if isinstance(exc, InvalidRequest):
        return HttpError(400, str(exc))
    # A worker's RESOURCE_EXHAUSTED (its KV pool full) is the same "come back soon" as admission's.
    if isinstance(exc, Busy) or isinstance(exc, WorkerError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return busy(str(exc))
    if isinstance(exc, WorkerError):
        status = _WORKER_STATUS.get(exc.code, 502)
        return HttpError(status, str(exc), "server_error" if status >= 500 else "invalid_request_error")
    raise exc


async def until_disconnect(receive: Receive, work: Coroutine[Any, Any, Any]) -> Any:
    """Run `work` unless the client disconnects first; then cancel it and return None.
    Cancelled itself, it cancels `work` and waits for it to end before it goes: the caller's
    cleanup must not find `work` still running (an event generator cannot be closed then)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        gone.cancel()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    gone.cancel()
    if task.done():
        try:
            return task.result()
        finally:
            # The task holds its exception, whose traceback holds this frame, which holds the
            # task: a cycle only a full collection frees, and with it every object of the
            # request (a refused body's included). Breaking it frees them at once.
            del task
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


class _Closing(Exception):
    """The gateway is draining and this stream's time is up."""


async def _unless_closing(step: Coroutine[Any, Any, T], closing: asyncio.Event) -> T:
    """The next item, or _Closing once `closing` is set (the step in progress cancelled)."""
    if closing.is_set():
        step.close()
        raise _Closing
    task = asyncio.ensure_future(step)
    closed = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait({task, closed}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise _Closing
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _float32(value: float) -> float:
    """`value` at float32 precision: the gRPC API's `acceptance_rate` is a float32 field,
    and both APIs report the same figure."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _figures(chunk: Chunk) -> dict[str, Any]:
    """One generation's speculative figures, under vLLM's names."""
    summary = chunk.summary
    assert summary is not None  # the last chunk
    drafts = sum(1 for g in summary.draft_lengths if g)
    return {
        "num_drafts": drafts, "num_draft_tokens": summary.proposed_tokens,
        "num_accepted_tokens": summary.accepted_tokens,
        "draft_acceptance_rate": _float32(summary.acceptance_rate),
        "mean_acceptance_length": 1 + summary.accepted_tokens / drafts if drafts else 1.0,
        "drafted_per_step": list(summary.draft_lengths), "accepted_per_step": list(summary.accepted_lengths),
        "proposers": list(summary.proposers), "draft_model": summary.draft_model, "policy": summary.policy,
        "seed": summary.seed, "trace_id": chunk.trace_id,
    }


def _usage(lasts: list[Chunk]) -> dict[str, Any]:
    """OpenAI's usage, with the speculative figures: one generation's, or with n > 1 the
    counts over every choice and each choice's figures under `choices`."""
    summaries = [last.summary for last in lasts if last.summary is not None]  # last chunks: all have them
    prompt, generated = summaries[0].prompt_tokens, sum(s.generated_tokens for s in summaries)
    figures = [_figures(last) for last in lasts]
    if len(figures) == 1:
        speculation = figures[0]
    else:
        drafts, proposed, accepted = (sum(f[k] for f in figures)
                                      for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        speculation = {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
                       "draft_acceptance_rate": accepted / proposed if proposed else 0.0,
                       "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0, "choices": figures}
    # The prompt is counted once, as are its cached tokens (the most any choice found).
    cached = max(s.cached_tokens for s in summaries)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}, "speculation": speculation}


# A choice's whole text, its last chunk and its tokens' log-probabilities.
Outcome = tuple[str, Chunk, tuple[TokenLogprob, ...]]
# What JSON cannot carry: a log-probability of -inf is written as vLLM writes it.
_NO_LOGPROB = -9999.0


class Logprobs:
    """Tokens' log-probabilities in OpenAI's shapes: chat's `content` entries, or the legacy
    completions object (tokens, token_logprobs, top_logprobs, text_offset).

    Each token is decoded once per response, however often it comes back as a token or
    an alternative: rendering runs on the event loop, and a response of 1,000 tokens with
    20 alternatives each names 21,000 tokens but only a few thousand distinct ones."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.offsets: dict[int, int] = {}  # each choice's text offset so far (completions)
        self._pieces: dict[int, tuple[str, list[int]]] = {}  # token → its text and its bytes

    def _piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text, decoded alone, and its own bytes (`gateway.step.text.token_bytes`)."""
        piece = self._pieces.get(token)
        if piece is None:
            text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self._pieces[token] = (text, list(token_bytes(self.tokenizer, token, text)))
        return piece

    def _text(self, token: int) -> str:
        return self._piece(token)[0]

    @staticmethod
    def _value(logprob: float) -> float:
        return logprob if math.isfinite(logprob) else _NO_LOGPROB

    def render(self, index: int, entries: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        if self.chat:
            return {"content": [{**self._entry(e.token, e.logprob),
                                 "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries]}
        texts = [self._text(e.token) for e in entries]
        offset = self.offsets.get(index, 0)
        offsets = []
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        self.offsets[index] = offset
        return {"tokens": texts, "token_logprobs": [self._value(e.logprob) for e in entries],
                "top_logprobs": [{self._text(t): self._value(v) for t, v in e.top} for e in entries],
                "text_offset": offsets}

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        # The token's own bytes, not its text's: a token holding part of a character
        # decodes to U+FFFD, and a client joins the bytes of consecutive tokens to read it.
        text, raw = self._piece(token)
        return {"token": text, "logprob": self._value(logprob), "bytes": raw}


class Reply:
    """One response's OpenAI objects (completion or chat completion, whole or streamed), of
    `n` choices; with `logprobs` (when the request asks), each choice's log-probabilities;
    with `calling` (a chat with tools), each choice's text read as tool calls."""

    def __init__(self, kind: str, ident: str, model: str, n: int = 1, logprobs: Logprobs | None = None,
                 calling: ToolCalling | None = None) -> None:
        self.kind, self.id, self.model, self.n = kind, ident, model, n
        self.created = int(time.time())
        self.chat = kind == "chat.completion"
        self.logprobs = logprobs
        self.calling = calling
        readers = [calling.reader() for _ in range(n)] if calling is not None else []
        # Each choice's reader, for a chat whose text is read as tool calls.
        self.readers: dict[int, ToolReader] = {i: r for i, r in enumerate(readers) if r is not None}

    def _object(self, choices: list[dict[str, Any]], chunk: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": self.kind + (".chunk" if chunk and self.chat else ""),
                "created": self.created, "model": self.model, "choices": choices}

    def _rendered(self, index: int, entries: tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        return None if self.logprobs is None else self.logprobs.render(index, entries)

    def whole(self, outcomes: list[Outcome]) -> dict[str, Any]:
        choices = []
        for index, (text, last, entries) in enumerate(outcomes):
            assert last.finish is not None
            reason = _FINISH[last.finish]
            reader = self.readers.get(index)
            if reader is not None:
                assert self.calling is not None  # a reader is the calling's
                message = reply_message(reader.feed(text) + reader.end())
                reason = self.calling.finish_reason(reason, reader.calls)
            choice: dict[str, Any] = {"index": index, "finish_reason": reason,
                                      "logprobs": self._rendered(index, entries)}
            if reader is not None:
                choice["message"] = message
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {**self._object(choices), "usage": _usage([last for _, last, _ in outcomes])}

    def _delta(self, index: int, chunk: Chunk, first: bool = False) -> bytes:
        """A choice's chunk object; empty when it has nothing to say (its text held back by
        the tool-call reader)."""
        reason = _FINISH[chunk.finish] if chunk.finish is not None else None
        text, logprobs = chunk.text, self._rendered(index, chunk.logprobs)
        reader = self.readers.get(index)
        if reader is not None:
            assert self.calling is not None  # a reader is the calling's
            pieces = reader.feed(text) + (reader.end() if reason is not None else [])
            said = chunk_delta(pieces)
            if reason is not None:
                reason = self.calling.finish_reason(reason, reader.calls)
            if not (said or first or reason or chunk.logprobs):
                return b""
            choice = {"index": index, "delta": {"role": "assistant", **said} if first else said,
                      "finish_reason": reason, "logprobs": logprobs}
        elif self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
        return _event(self._object([choice], chunk=True))

    async def events(self, first: tuple[int, Chunk], chunks: AsyncGenerator[tuple[int, Chunk], None],
                     include_usage: bool, closing: asyncio.Event) -> AsyncGenerator[bytes, None]:
        """Server-sent events: a chunk object per chunk of text of any choice, the usage when
        asked, [DONE]. Every way a stream can end after its first chunk ends with [DONE]: a
        failure or the gateway draining (`closing`) sends an error event first."""
        lasts: dict[int, Chunk] = {}
        async with contextlib.aclosing(chunks):
            index, chunk = first
            started = {index}
            yield self._delta(index, chunk, first=True)  # never empty: it gives the role
            if chunk.finish is not None:
                lasts[index] = chunk
            try:
                while len(lasts) < self.n:
                    index, chunk = await _unless_closing(anext(chunks), closing)
                    if event := self._delta(index, chunk, first=index not in started):
                        yield event
                    started.add(index)
                    if chunk.finish is not None:
                        lasts[index] = chunk
            except (InvalidRequest, Busy, WorkerError) as exc:  # after the status line: an error event
                yield _event(from_core(exc).body())
                yield b"data: [DONE]\n\n"
                return
            except _Closing:
                yield _event(HttpError(503, "the gateway is shutting down and ended this stream before its last "
                                            "token; retry the request", "server_error").body())
                yield b"data: [DONE]\n\n"
                return
            except Exception as exc:  # never a silent end: a client would take it for a whole answer
                log.exception("a stream failed after its first chunk")
                yield _event(HttpError(500, f"the request failed: {type(exc).__name__}", "server_error").body())
                yield b"data: [DONE]\n\n"
                return
        if include_usage:
            yield _event({**self._object([], chunk=True), "usage": _usage([lasts[i] for i in range(self.n)])})
        yield b"data: [DONE]\n\n"


def _event(value: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


class EventStream(Response):
    """A text/event-stream response whose generation stops as soon as the client disconnects.

    The events are sent by a task; another waits for `http.disconnect`. Whichever ends
    first cancels the other, so a client that goes away cancels its request at the step
    in progress, and closing the event generator closes the request's worker sessions."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], chunks: AsyncGenerator[tuple[int, Chunk], None],
                 on_close: Callable[[], None]) -> None:
        # No body, so no Content-Length: the events are sent as they come.
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.events, self.chunks, self.on_close = events, chunks, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with contextlib.aclosing(self.events):
                async for event in self.events:
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            with contextlib.suppress(OSError):  # the client went away mid-send
                await until_disconnect(receive, stream())
        finally:
            # Closed here too: cancelled before the events began, closing them would not
            # reach the request's chunks, and its worker sessions would wait for the GC.
            # The tenant's slot is given back whatever the closing raises.
            try:
                await self.events.aclose()
                await self.chunks.aclose()
            finally:
                self.on_close()


