"""The OpenAI-compatible HTTP front end: `/v1/completions`, `/v1/chat/completions`,
`/v1/models` and `/health`, on Starlette, served by uvicorn in the gateway's own process
and event loop.

A thin adapter over `gateway.core.GatewayCore`, as the gRPC servicer is: the JSON body
becomes `ClientRequest`, the API key (`Authorization: Bearer KEY`, from the same
`--api-keys` file and with the same per-tenant share as gRPC) becomes the request's user
segment, and chunks become OpenAI's objects, streamed as server-sent events ending in
`data: [DONE]`. Errors are OpenAI error objects: 400 bad input, 401 no or wrong key, 404
unknown model, 413 body over --max-request-bytes, 429 busy (with Retry-After), 503 no
verifier reachable, 500 only for a fault of specd's own (an error object too). A
parameter specd does not support (`echo`, ...) is refused by name, never ignored.
`presence_penalty`, `frequency_penalty`, `logit_bias` (OpenAI's) and `repetition_penalty`,
`min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos` (vLLM's) are applied exactly under
speculation (`specd.sampling`), as are `logprobs` (and chat's `top_logprobs`),
`response_format` and vLLM's `structured_outputs` (docs/sampling.md). Function calling
(`tools`, `tool_choice`, `parallel_tool_calls`, tool calls and results in the history) is
OpenAI's (`gateway.edge.tools`): a forced call is generated under its schema's grammar, as
structured output is. `n` > 1 runs that many generations, choice i seeded with the seed
plus i (`gateway.edge.choices`); `cache_salt` (vLLM's) narrows who shares the prefix cache. A
client that disconnects stops its request at the next step, and the workers' sessions
are freed.

The edge is hardened as a public one (docs/http.md, "Limits"): a connection must finish
its request's headers within --http-header-timeout; at most --http-max-connections are
open, a new one displacing the oldest that has not sent a request; the API key is checked
before the body is read; the body is parsed (`gateway.edge.bodies`: no object past a bound is
built, fields with a count limit are counted before anything is built from them, a large
body is parsed in a process of its own), checked for text that is not Unicode and, for
chat, rendered on a thread of its own, never on the event loop the steps run on; then it
is weighed against the tenant's share. Streams
still running when the gateway drains end with an error event and `[DONE]`.

Extensions in the body, as vLLM's extra parameters: `top_k`, and `speculation` with the
gRPC API's fields (`mode`, `draft_length`, `min_draft_length`, `max_draft_length`,
`draft_model`, `policy`, `min_draft_confidence`, `overlap`). Each response's `usage`
carries the request's speculative figures under vLLM's names (`speculation`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.core import Chunk, GatewayCore
from gateway.edge.auth import AmbiguousCredentials, KeyRing, TenantQuota, bearer_token, request_weight
from gateway.edge.bodies import BodyLimits, BodyParser, HttpError
from gateway.edge.choices import choice_requests, merged
from gateway.edge.fields import (
    CHAT_FIELDS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    COMPLETIONS_FIELDS,
    read_integer,
    read_logprobs,
    read_prompts,
    read_sampling,
    read_template_kwargs,
    read_typed,
    refuse_unsupported,
)
from gateway.edge.replies import (
    EventStream,
    Logprobs,
    Outcome,
    Reply,
    busy,
    error_response,
    from_core,
    until_disconnect,
)
from gateway.edge.tools import (
    FORMATS,
    ToolCalling,
    chat_messages,
    renders_tools,
    tool_calling,
    tools_as_text,
    with_preamble,
)
from gateway.errors import Busy, InvalidRequest, WorkerError
from gateway.request import ClientRequest
from gateway.step.engine import TokenLogprob
from specd.sampling import MAX_LOGIT_BIAS

log = logging.getLogger(__name__)

# -- the app ----------------------------------------------------------------------------------

# A refused body is read on and dropped, up to this many bytes, before the 413 goes out. A
# server that answers and closes while the client is still sending resets the connection,
# and the reset discards the answer in the client's socket: the client sees a broken pipe
# or a reset, not the 413 (nginx reads on for the same reason, its lingering close). Past
# this the 413 goes out at once and closes the connection: uvicorn would otherwise keep it
# open after the answer, reading and dropping whatever the client goes on sending.
DRAIN_BYTES = 16 << 20


async def _drain(request: Request, length: int, received: int) -> bool:
    """Read and drop the rest of a refused body (`received` bytes read so far, `length` its
    announced size, 0 when unknown), unless it is over `DRAIN_BYTES`; nothing is kept.
    Whether the body was read to its end."""
    if length > DRAIN_BYTES:
        return False
    async for piece in request.stream():
        received += len(piece)
        if received > DRAIN_BYTES:
            return False
    return True


def _too_large(message: str, drained: bool) -> HttpError:
    """The 413 of a refused body: closing the connection unless the body was read to its end."""
    return HttpError(413, message, headers=None if drained else {"Connection": "close"})


class OpenAIApp:
    """The routes, over one gateway core. keys/quota: the gateway's API keys and per-tenant
    share (None: no keys); chat_template: Jinja text overriding the tokenizer's;
    serving(): whether a verifier answers (what /health reports)."""

    def __init__(self, core: GatewayCore, keys: KeyRing | None, quota: TenantQuota | None,
                 chat_template: str | None, serving: Callable[[], bool]) -> None:
        self.core, self.keys, self.quota = core, keys, quota
        self.chat_template = chat_template
        self.serving = serving
        self.max_body = core.settings.max_request_bytes
        # Small bodies are parsed and chats rendered here, one at a time: a flood of them
        # queues on this thread, not on the event loop every request's steps run on. Large
        # bodies are parsed in a process (`gateway.edge.bodies`).
        self._body_thread = ThreadPoolExecutor(1, thread_name_prefix="specd-http-body")
        self.bodies = BodyParser(BodyLimits(core.settings.max_chat_messages, core.settings.max_stop_strings,
                                            MAX_LOGIT_BIAS), self._body_thread)
        self.closing = asyncio.Event()  # set as the gateway drains: streams still running end now
        self._renders_tools: dict[str, bool] = {}  # template → whether it writes `tools` (`gateway.edge.tools`)
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ], exception_handlers={HttpError: lambda request, exc: error_response(exc),
                               404: lambda request, exc: error_response(HttpError(404, f"no route {request.url.path}")),
                               405: lambda request, exc: error_response(HttpError(405, "method not allowed")),
                               Exception: _internal_error})

    def close(self) -> None:
        self._body_thread.shutdown(wait=False, cancel_futures=True)
        self.bodies.close()

    async def _off_loop(self, work: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._body_thread, work, *args)

    @property
    def model_name(self) -> str:
        return self.core.backend.target.name

    async def health(self, request: Request) -> Response:
        if self.serving():
            return JSONResponse({"status": "ok"})
        return error_response(HttpError(503, "no verifier answers its health checks", "server_error"))

    async def models(self, request: Request) -> Response:
        self._tenant(request)
        target = self.core.backend.target
        return JSONResponse({"object": "list", "data": [{
            "id": target.name, "object": "model", "created": 0, "owned_by": "specd",
            "max_model_len": target.max_context}]})

    def _tenant(self, request: Request) -> str | None:
        """The segment of the caller's API key (401 without a valid one); None when the
        gateway has no keys. Checked from the headers, before the body is read."""
        if self.keys is None:
            return None
        try:
            token = bearer_token(list(request.headers.items()))
        except AmbiguousCredentials as exc:
            raise HttpError(401, str(exc), "authentication_error") from exc
        key = self.keys.find(token) if token is not None else None
        if key is None:
            message = ("an API key is required: send the header 'Authorization: Bearer KEY'" if token is None
                       else "the API key is not valid for this gateway")
            raise HttpError(401, message, "authentication_error")
        return key.segment

    @staticmethod
    def _segment(tenant: str | None, body: dict[str, Any]) -> str:
        """The request's user segment: the key's when the gateway has keys, else the
        body's `user` (which callers without keys choose freely: docs/http.md). With keys,
        `user` is what OpenAI's clients make of it, the application's id of its end user:
        accepted and not used, as vLLM does, since the key decides the segment."""
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise HttpError(400, "'user' must be a string", param="user")
        if tenant is None:
            return user or ""
        return tenant

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object of the body, read up to --max-request-bytes (413 past it), parsed
        and checked off the event loop (`gateway.edge.bodies`)."""
        length = request.headers.get("content-length", "")
        message = f"the body is over this gateway's limit of {self.max_body} bytes"
        if length.isdigit() and int(length) > self.max_body:
            raise _too_large(message, await _drain(request, int(length), 0))
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.max_body:
                raise _too_large(message, await _drain(request, int(length) if length.isdigit() else 0, len(body)))
        return await self.bodies.parse(bytes(body))

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise HttpError(400, f"'model' is required: this gateway serves {self.model_name!r}", param="model")
        if model != self.model_name:
            raise HttpError(404, f"the model {model[:80]!r} does not exist here; this gateway serves "
                                 f"{self.model_name!r}", param="model")

    async def completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request)
        segment = self._segment(tenant, body)
        refuse_unsupported(body, COMPLETIONS_FIELDS)
        self._check_model(body)
        sampling = read_sampling(body, read_integer(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS),
                             self.core.backend.sampling_defaults)
        asked = [ClientRequest(**source, user_segment=segment, logprobs=read_logprobs(body, chat=False), **sampling)
                 for source in read_prompts(body.get("prompt"))]
        return await self._respond(request, asked, body, "text_completion", "cmpl", segment)

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request)
        segment = self._segment(tenant, body)
        refuse_unsupported(body, CHAT_FIELDS)
        self._check_model(body)
        calling = tool_calling(body, self.core.settings.tool_call_parser)
        prompt = await self._off_loop(self._render, body.get("messages"), calling, read_template_kwargs(body))
        max_tokens = read_integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = read_integer(body, "max_tokens", None)
        sampling = read_sampling(body, max_tokens, self.core.backend.sampling_defaults)
        if calling is not None and calling.choice != "none":
            if sampling["structure"] is not None:
                raise HttpError(400, "'response_format' or 'structured_outputs' cannot be combined with tools the "
                                     "model may call: specd cannot let the model choose between a call and an "
                                     "answer in that format; use tool_choice 'none', or leave the format out",
                                param="tool_choice")
            sampling["structure"] = calling.structure()
        asked = ClientRequest(prompt=prompt, add_special_tokens=False, user_segment=segment,
                              logprobs=read_logprobs(body, chat=True), **sampling)
        return await self._respond(request, [asked], body, "chat.completion", "chatcmpl", segment, calling)

    def _render(self, messages: Any, calling: ToolCalling | None, extra: dict[str, Any]) -> str:
        """The conversation as the prompt text, through the chat template (on the body thread),
        with the request's `chat_template_kwargs` (`extra`: a thinking switch, say).
        A template that does not write `tools` gets the hermes format instead: the tools in a
        system preamble, the history's calls and results as text (`gateway.edge.tools`)."""
        plain = chat_messages(messages)
        tokenizer = self.core.backend.tokenizer
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise HttpError(400, f"the model {self.model_name!r} has no chat template, so chat messages cannot be "
                                 f"turned into a prompt: start the gateway with --chat-template FILE (a Jinja "
                                 f"template), or use /v1/completions")

        def render(conversation: list[dict[str, Any]], **kwargs: Any) -> str:
            return str(tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True, **kwargs))

        if template not in self._renders_tools:
            self._renders_tools[template] = renders_tools(render)
        tools: dict[str, Any] = {}
        if self._renders_tools[template]:
            if calling is not None:
                tools["tools"] = [tool.spec for tool in calling.tools]
        else:
            parser = self.core.settings.tool_call_parser
            plain = tools_as_text(plain, parser)
            if calling is not None:
                plain = with_preamble(plain, FORMATS[parser].preamble(calling.tools, calling.parallel))
        try:
            text = render(plain, **extra, **tools)
        except Exception as exc:  # the template's own checks (roles, order) raise anything
            raise HttpError(400, f"the chat template refused these messages: {exc}", param="messages") from exc
        return text

    async def _respond(self, request: Request, prompts: list[ClientRequest], body: dict[str, Any], kind: str,
                       prefix: str, segment: str, calling: ToolCalling | None = None) -> Response:
        """Every prompt's n choices, indexed as OpenAI does (prompt p's choice i is p × n + i),
        whole or streamed."""
        stream = read_typed(body, "stream", (bool,), False, "true or false")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise HttpError(400, "'stream_options' is {include_usage: bool}, with stream: true",
                            param="stream_options")
        include_usage = bool(options and options.get("include_usage"))
        asked = prompts[0]  # the prompts differ in their text alone
        try:
            n = read_integer(body, "n", 1, low=1) or 1
            choices = [choice for prompt in prompts for choice in choice_requests(prompt, n)]
        except InvalidRequest as exc:
            raise HttpError(400, str(exc), param="n") from exc
        chat = kind == "chat.completion"
        logprobs = None if asked.logprobs is None else Logprobs(self.core.backend.tokenizer, chat)
        reply = Reply(kind, f"{prefix}-{uuid.uuid4().hex}", self.model_name, len(choices), logprobs, calling)

        leave = self._admit(segment, asked, len(choices))
        streaming = False  # once the stream is handed out, it gives the tenant's slots back
        try:
            chunks = merged([self.core.generate(choice) for choice in choices])
            if stream:
                first = await _first(chunks)  # errors before any text still get a status
                streaming = True
                return EventStream(reply.events(first, chunks, include_usage, self.closing), chunks, leave)
            outcome = await until_disconnect(request.receive, _collect(chunks, len(choices)))
        except (InvalidRequest, Busy, WorkerError) as exc:
            raise from_core(exc) from exc
        finally:
            if not streaming:
                leave()
        if outcome is None:  # the client left; nobody reads a reply
            return Response(status_code=499)
        return JSONResponse(reply.whole(outcome))

    def _admit(self, segment: str, asked: ClientRequest, n: int) -> Callable[[], None]:
        """Hold the request's weight in its tenant's share (`gateway.edge.auth.request_weight`;
        with keys): 400 when no share could hold it, 429 when the tenant's requests in flight
        leave no room. The function that gives it back."""
        quota = self.quota
        if quota is None or self.keys is None:
            return lambda: None
        # A max_tokens over the cap weighs as the cap: the core refuses it, saying so.
        max_tokens = min(asked.max_new_tokens or 0, self.core.settings.max_new_tokens_cap) or None
        weight = request_weight(n, max_tokens, asked.logprobs is not None)
        if (heavy := quota.too_heavy(weight)) is not None:
            raise HttpError(400, heavy, param="n")
        if (refusal := quota.admit(segment, weight)) is not None:
            raise busy(refusal)
        return lambda: quota.leave(segment, weight)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A fault of specd's own is still an OpenAI error object (the traceback is logged)."""
    return error_response(HttpError(500, f"the gateway failed this request: {type(exc).__name__}", "server_error"))


async def _first(chunks: AsyncGenerator[tuple[int, Chunk], None]) -> tuple[int, Chunk]:
    try:
        return await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise


async def _collect(chunks: AsyncGenerator[tuple[int, Chunk], None], n: int) -> list[Outcome]:
    """Each choice's whole text, last chunk and token log-probabilities, in index order."""
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    lasts: list[Chunk | None] = [None] * n
    async with contextlib.aclosing(chunks):
        async for index, chunk in chunks:
            parts[index].append(chunk.text)
            logprobs[index].extend(chunk.logprobs)
            if chunk.finish is not None:
                lasts[index] = chunk
    if any(last is None for last in lasts):
        raise RuntimeError("a generation ended without a last chunk")
    return [("".join(texts), last, tuple(entries)) for texts, last, entries in zip(parts, lasts, logprobs)
            if last is not None]


