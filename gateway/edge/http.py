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
import json
import logging
import math
import socket
import ssl
import struct
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from transformers import PreTrainedTokenizerBase

from gateway.core import Chunk, GatewayCore
from gateway.edge.auth import AmbiguousCredentials, KeyRing, TenantQuota, bearer_token, request_weight
from gateway.edge.bodies import BodyLimits, BodyParser, HttpError
from gateway.edge.choices import choice_requests, merged
from gateway.edge.connections import EdgeLimits, edge_protocol, quiet_accept_errors
from gateway.edge.tools import (
    FORMATS,
    ToolCalling,
    ToolReader,
    chat_messages,
    chunk_delta,
    renders_tools,
    reply_message,
    tool_calling,
    tools_as_text,
    with_preamble,
)
from gateway.errors import RETRY_PUSHBACK_MS, Busy, InvalidRequest, WorkerError
from gateway.grammar import StructureSpec
from gateway.request import ClientRequest, Mode
from gateway.step.engine import TokenLogprob
from gateway.step.records import Finish
from gateway.step.text import token_bytes
from specd.grpcserver import PortInUse
from specd.sampling import MAX_LOGIT_BIAS
from specd.tls import files_stamp

log = logging.getLogger(__name__)
T = TypeVar("T")

# What each endpoint accepts. Anything else is refused by name (never ignored).
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k",
             "speculation", "n", "user", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
             "min_p", "min_tokens", "stop_token_ids", "ignore_eos", "response_format", "structured_outputs",
             "cache_salt", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens"}
_COMPLETIONS = _SAMPLING | {"prompt", "echo", "logprobs", "best_of"}
_CHAT = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls", "chat_template_kwargs"}
_SPECULATION = {"mode", "draft_length", "min_draft_length", "max_draft_length", "draft_model", "policy",
                "min_draft_confidence", "overlap"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions
_FINISH = {Finish.LENGTH: "length", Finish.EOS: "stop", Finish.STOP: "stop"}
_WORKER_STATUS = {grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
                  grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.INVALID_ARGUMENT: 400}


def _response(error: HttpError) -> JSONResponse:
    return JSONResponse(error.body(), error.status, headers=error.headers)


def _busy(message: str) -> HttpError:
    return HttpError(429, message, "rate_limit_error",
                     headers={"Retry-After": str(max(1, math.ceil(RETRY_PUSHBACK_MS / 1000)))})


def _from_core(exc: Exception) -> HttpError:
    """The HTTP error of what the core raised."""
    if isinstance(exc, InvalidRequest):
        return HttpError(400, str(exc))
    # A worker's RESOURCE_EXHAUSTED (its KV pool full) is the same "come back soon" as admission's.
    if isinstance(exc, Busy) or isinstance(exc, WorkerError) and exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _busy(str(exc))
    if isinstance(exc, WorkerError):
        status = _WORKER_STATUS.get(exc.code, 502)
        return HttpError(status, str(exc), "server_error" if status >= 500 else "invalid_request_error")
    raise exc


# -- reading a body ---------------------------------------------------------------------------

def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise HttpError(400, f"'{name}' must be {what}, got {json.dumps(value)[:60]}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = float(_typed(body, name, (int, float), default, "a number"))
    if not math.isfinite(value):
        raise HttpError(400, f"'{name}' must be finite", param=name)
    return value


def _integer(body: dict[str, Any], name: str, default: int | None, low: int = 0) -> int | None:
    value = _typed(body, name, (int,), default, "an integer")
    if value is not None and value < low:
        raise HttpError(400, f"'{name}' must be at least {low}, got {value}", param=name)
    return value


def _refuse_unsupported(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse every field specd does not know, and every known one asked for a feature it lacks."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise HttpError(400, f"unsupported parameters {unknown}: specd does not implement them (it never ignores "
                             f"a parameter); remove them", param=unknown[0])
    lacking = []
    if body.get("best_of") not in (None, 1):
        lacking.append("best_of > 1")
    if body.get("echo") not in (None, False):
        lacking.append("echo")
    if lacking:
        raise HttpError(400, f"specd does not support {', '.join(lacking)}; leave them unset")


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives to report beside each token's log-probability (None: none asked).
    Chat: `logprobs: true` with `top_logprobs` (OpenAI's); completions: `logprobs: N`."""
    if not chat:
        return _integer(body, "logprobs", None)
    wanted = _typed(body, "logprobs", (bool,), False, "true or false")
    top = _integer(body, "top_logprobs", None)
    if top is not None and not wanted:
        raise HttpError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


# vLLM's structured_outputs kinds → gateway.grammar's.
_STRUCTURES = {"json": "json", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}


def _structure(body: dict[str, Any]) -> StructureSpec | None:
    """OpenAI's response_format, or vLLM's structured_outputs (one of them, one kind)."""
    response_format, extension = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and extension is not None:
        raise HttpError(400, "give 'response_format' or 'structured_outputs', not both", param="response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return StructureSpec("json_object", "")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise HttpError(400, "'response_format' json_schema needs {json_schema: {name, schema: {...}}}",
                                param="response_format")
            return StructureSpec("json", json.dumps(schema))
        raise HttpError(400, "'response_format' is {type: text | json_object | json_schema}",
                        param="response_format")
    if extension is None:
        return None
    given = {k: v for k, v in extension.items() if v is not None} if isinstance(extension, dict) else {}
    if len(given) != 1 or next(iter(given)) not in _STRUCTURES:
        raise HttpError(400, f"'structured_outputs' takes exactly one of {sorted(_STRUCTURES)}",
                        param="structured_outputs")
    (kind, value), = given.items()
    if kind == "json":
        if not isinstance(value, (dict, str)):
            raise HttpError(400, "'structured_outputs.json' is a JSON Schema (an object or its text)",
                            param="structured_outputs")
        return StructureSpec("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        if value is not True:
            raise HttpError(400, "'structured_outputs.json_object' is true", param="structured_outputs")
        return StructureSpec("json_object", "")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise HttpError(400, "'structured_outputs.choice' is a list of strings", param="structured_outputs")
        return StructureSpec("choice", json.dumps(value))
    if not isinstance(value, str):
        raise HttpError(400, f"'structured_outputs.{kind}' is a string", param="structured_outputs")
    return StructureSpec(_STRUCTURES[kind], value)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise HttpError(400, "'stop' must be a string or a list of strings", param="stop")


def _speculation(body: dict[str, Any]) -> dict[str, Any]:
    """The `speculation` extension as ClientRequest fields."""
    spec = body.get("speculation")
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        raise HttpError(400, "'speculation' must be an object with the gRPC API's fields "
                             f"{sorted(_SPECULATION)}", param="speculation")
    unknown = sorted(set(spec) - _SPECULATION)
    if unknown:
        raise HttpError(400, f"unknown speculation fields {unknown}; known: {sorted(_SPECULATION)}",
                        param="speculation")
    mode = _typed(spec, "mode", (str,), Mode.AUTO.value, "a string").lower()
    return {"mode": mode, "draft_length": _integer(spec, "draft_length", 0),
            "min_draft_length": _integer(spec, "min_draft_length", 0),
            "max_draft_length": _integer(spec, "max_draft_length", 0),
            "draft_model": _typed(spec, "draft_model", (str,), "", "a string"),
            "policy": _typed(spec, "policy", (str,), "", "a string"),
            "min_draft_confidence": _number(spec, "min_draft_confidence", 0.0),
            "overlap": _typed(spec, "overlap", (bool,), None, "true or false")}


def _sampling(body: dict[str, Any], max_tokens: int | None, model: dict[str, float]) -> dict[str, Any]:
    """The sampling fields shared by both endpoints. One left unset takes the model's own
    default (`model`: its generation_config.json's, as vLLM's --generation-config auto),
    else OpenAI's (temperature 1)."""
    seed = _integer(body, "seed", None)  # 0 is a seed, as in OpenAI's API; unset: the gateway picks one
    if seed is not None and seed >= 2 ** 63:
        raise HttpError(400, "'seed' must be below 2**63", param="seed")
    top_p = _number(body, "top_p", model.get("top_p", 1.0))
    if not 0.0 < top_p <= 1.0:  # checked here: the core reads 0 as "unset", as proto3 does
        raise HttpError(400, f"'top_p' must be in (0, 1] (1 = disabled), got {top_p:g}", param="top_p")
    repetition = _number(body, "repetition_penalty", model.get("repetition_penalty", 1.0))
    if repetition <= 0:  # checked here: the core reads 0 as "unset", as proto3 does
        raise HttpError(400, f"'repetition_penalty' must be in (0, 100] (1 = off), got {repetition:g}",
                        param="repetition_penalty")
    return {"temperature": _number(body, "temperature", model.get("temperature", 1.0)), "top_p": top_p,
            "top_k": _integer(body, "top_k", int(model.get("top_k", 0))),
            "seed": seed, "max_new_tokens": max_tokens, "stop": _stop(body),
            "presence_penalty": _number(body, "presence_penalty", 0.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0), "repetition_penalty": repetition,
            "logit_bias": _logit_bias(body), "min_p": _number(body, "min_p", model.get("min_p", 0.0)),
            "min_tokens": _integer(body, "min_tokens", 0), "stop_token_ids": _token_ids(body, "stop_token_ids"),
            "ignore_eos": _typed(body, "ignore_eos", (bool,), False, "true or false"),
            "structure": _structure(body), "cache_salt": _typed(body, "cache_salt", (str,), "", "a string"),
            "include_stop": _typed(body, "include_stop_str_in_output", (bool,), False, "true or false"),
            "truncate_prompt_tokens": _integer(body, "truncate_prompt_tokens", None, low=1),
            "skip_special_tokens": _typed(body, "skip_special_tokens", (bool,), True, "true or false"),
            **_speculation(body)}


# The arguments of apply_chat_template that the gateway sets itself.
_TEMPLATE_OWN = {"conversation", "chat_template", "tokenize", "add_generation_prompt", "tools", "return_dict",
                 "return_tensors", "continue_final_message", "documents"}


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `chat_template_kwargs`: variables for the chat template (`enable_thinking`, say),
    never the arguments the gateway sets."""
    extra = _typed(body, "chat_template_kwargs", (dict,), {}, "an object of template variables")
    taken = sorted(set(extra) & _TEMPLATE_OWN)
    if taken:
        raise HttpError(400, f"'chat_template_kwargs' may not set {taken}: the gateway sets them",
                        param="chat_template_kwargs")
    return extra


# The most prompts one completions request may list (OpenAI's batch of prompts; each of
# their choices weighs on the tenant's share).
MAX_PROMPTS = 32


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _prompts(prompt: Any) -> list[dict[str, Any]]:
    """A completions request's prompts, as OpenAI takes them: a string, a list of token ids,
    or a list of either (one completion each)."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if _is_ids(prompt):
        return [{"prompt_ids": prompt}]
    if isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                or all(_is_ids(p) for p in prompt)):
        if len(prompt) > MAX_PROMPTS:
            raise HttpError(400, f"'prompt' lists {len(prompt)} prompts; at most {MAX_PROMPTS} in one request",
                            param="prompt")
        return [{"prompt": p} if isinstance(p, str) else {"prompt_ids": p} for p in prompt]
    raise HttpError(400, "'prompt' must be a string, a list of token ids, or a list of either", param="prompt")


def _token_ids(body: dict[str, Any], name: str) -> list[int]:
    ids = body.get(name)
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise HttpError(400, f"'{name}' must be a list of token ids", param=name)
    return ids


def _logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys, so strings) → a bias in [-100, 100]."""
    bias = body.get("logit_bias")
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise HttpError(400, "'logit_bias' must be an object of token id → bias", param="logit_bias")
    parsed = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise HttpError(400, f"'logit_bias' keys are token ids (digits), got {json.dumps(key)[:40]}",
                            param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise HttpError(400, f"'logit_bias' values are numbers in [-100, 100], got {json.dumps(value)[:40]}",
                            param="logit_bias")
        parsed[int(key)] = float(value)
    return parsed


# -- the app ----------------------------------------------------------------------------------

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
        ], exception_handlers={HttpError: lambda request, exc: _response(exc),
                               404: lambda request, exc: _response(HttpError(404, f"no route {request.url.path}")),
                               405: lambda request, exc: _response(HttpError(405, "method not allowed")),
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
        return _response(HttpError(503, "no verifier answers its health checks", "server_error"))

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
        too_large = HttpError(413, f"the body is over this gateway's limit of {self.max_body} bytes")
        if length.isdigit() and int(length) > self.max_body:
            raise too_large
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > self.max_body:
                raise too_large
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
        _refuse_unsupported(body, _COMPLETIONS)
        self._check_model(body)
        sampling = _sampling(body, _integer(body, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS),
                             self.core.backend.sampling_defaults)
        asked = [ClientRequest(**source, user_segment=segment, logprobs=_logprobs(body, chat=False), **sampling)
                 for source in _prompts(body.get("prompt"))]
        return await self._respond(request, asked, body, "text_completion", "cmpl", segment)

    async def chat_completions(self, request: Request) -> Response:
        tenant = self._tenant(request)
        body = await self._body(request)
        segment = self._segment(tenant, body)
        _refuse_unsupported(body, _CHAT)
        self._check_model(body)
        calling = tool_calling(body, self.core.settings.tool_call_parser)
        prompt = await self._off_loop(self._render, body.get("messages"), calling, _template_kwargs(body))
        max_tokens = _integer(body, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", None)
        sampling = _sampling(body, max_tokens, self.core.backend.sampling_defaults)
        if calling is not None and calling.choice != "none":
            if sampling["structure"] is not None:
                raise HttpError(400, "'response_format' or 'structured_outputs' cannot be combined with tools the "
                                     "model may call: specd cannot let the model choose between a call and an "
                                     "answer in that format; use tool_choice 'none', or leave the format out",
                                param="tool_choice")
            sampling["structure"] = calling.structure()
        asked = ClientRequest(prompt=prompt, add_special_tokens=False, user_segment=segment,
                              logprobs=_logprobs(body, chat=True), **sampling)
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
        stream = _typed(body, "stream", (bool,), False, "true or false")
        options = body.get("stream_options")
        if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}):
            raise HttpError(400, "'stream_options' is {include_usage: bool}, with stream: true",
                            param="stream_options")
        include_usage = bool(options and options.get("include_usage"))
        asked = prompts[0]  # the prompts differ in their text alone
        try:
            n = _integer(body, "n", 1, low=1) or 1
            choices = [choice for prompt in prompts for choice in choice_requests(prompt, n)]
        except InvalidRequest as exc:
            raise HttpError(400, str(exc), param="n") from exc
        chat = kind == "chat.completion"
        logprobs = None if asked.logprobs is None else _Logprobs(self.core.backend.tokenizer, chat)
        reply = _Reply(kind, f"{prefix}-{uuid.uuid4().hex}", self.model_name, len(choices), logprobs, calling)

        leave = self._admit(segment, asked, len(choices))
        streaming = False  # once the stream is handed out, it gives the tenant's slots back
        try:
            chunks = merged([self.core.generate(choice) for choice in choices])
            if stream:
                first = await _first(chunks)  # errors before any text still get a status
                streaming = True
                return _EventStream(reply.events(first, chunks, include_usage, self.closing), chunks, leave)
            outcome = await _until_disconnect(request.receive, _collect(chunks, len(choices)))
        except (InvalidRequest, Busy, WorkerError) as exc:
            raise _from_core(exc) from exc
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
            raise _busy(refusal)
        return lambda: quota.leave(segment, weight)


async def _internal_error(request: Request, exc: Exception) -> Response:
    """A fault of specd's own is still an OpenAI error object (the traceback is logged)."""
    return _response(HttpError(500, f"the gateway failed this request: {type(exc).__name__}", "server_error"))


async def _first(chunks: AsyncGenerator[tuple[int, Chunk], None]) -> tuple[int, Chunk]:
    try:
        return await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise


async def _collect(chunks: AsyncGenerator[tuple[int, Chunk], None], n: int) -> list[_Outcome]:
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


async def _until_disconnect(receive: Receive, work: Coroutine[Any, Any, Any]) -> Any:
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
_Outcome = tuple[str, Chunk, tuple[TokenLogprob, ...]]
# What JSON cannot carry: a log-probability of -inf is written as vLLM writes it.
_NO_LOGPROB = -9999.0


class _Logprobs:
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


class _Reply:
    """One response's OpenAI objects (completion or chat completion, whole or streamed), of
    `n` choices; with `logprobs` (when the request asks), each choice's log-probabilities;
    with `calling` (a chat with tools), each choice's text read as tool calls."""

    def __init__(self, kind: str, ident: str, model: str, n: int = 1, logprobs: _Logprobs | None = None,
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

    def whole(self, outcomes: list[_Outcome]) -> dict[str, Any]:
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
                yield _event(_from_core(exc).body())
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


class _EventStream(Response):
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
                await _until_disconnect(receive, stream())
        finally:
            # Closed here too: cancelled before the events began, closing them would not
            # reach the request's chunks, and its worker sessions would wait for the GC.
            # The tenant's slot is given back whatever the closing raises.
            try:
                await self.events.aclose()
                await self.chunks.aclose()
            finally:
                self.on_close()


# -- serving ----------------------------------------------------------------------------------

class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the gateway's event loop: the gateway owns the process's signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


# How often the HTTPS port looks for renewed certificate files.
CERTIFICATE_CHECK_INTERVAL_S = 5.0
class HttpServer:
    """The HTTP app listening on host:port (0: a free port), in the running event loop."""

    def __init__(self, app: OpenAIApp, host: str, port: int, limits: EdgeLimits, certfile: str | None = None,
                 keyfile: str | None = None, client_ca: str | None = None) -> None:
        """With client_ca, callers must present a certificate it signed, as over gRPC.
        A taken port raises PortInUse naming it."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            raise PortInUse(f"{host}:{port}", "HTTP port") from exc
        self.port = self._socket.getsockname()[1]
        self.app = app
        self.limits = limits
        self._tls_files = (certfile, keyfile, client_ca)
        self._reloading: asyncio.Task | None = None
        # The listen backlog is also how many connections asyncio accepts in one go, before
        # any is closed at the cap: no larger than the cap, so a burst cannot take every
        # descriptor at once (2,048, uvicorn's default, did at a file limit of 512).
        config = uvicorn.Config(app.app, lifespan="off", log_level="warning", access_log=False,
                                http=edge_protocol(limits), backlog=max(16, min(2048, limits.max_connections)),
                                timeout_graceful_shutdown=2, ssl_certfile=certfile, ssl_keyfile=keyfile,
                                ssl_ca_certs=client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE)
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        for _ in range(1000):
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # raises what stopped it
        if self._server.config.ssl is not None:
            self._reloading = asyncio.get_running_loop().create_task(self._reload_certificates())
        log.info("OpenAI-compatible HTTP listening on port %d", self.port)

    async def _reload_certificates(self) -> None:
        """Take renewed certificate files into the live TLS context, for the handshakes after
        (gRPC's ports do the same, `specd.tls`). A pair caught mid-write, which does not load,
        is tried again at the next check. A new client CA is added to the trusted ones."""
        certfile, keyfile, client_ca = self._tls_files
        assert certfile is not None and keyfile is not None  # TLS is on
        paths = [Path(f) for f in self._tls_files if f is not None]
        context = self._server.config.ssl
        assert context is not None  # started with TLS
        seen = files_stamp(paths)
        while True:
            await asyncio.sleep(CERTIFICATE_CHECK_INTERVAL_S)
            try:
                stamp = files_stamp(paths)
                if stamp == seen:
                    continue
                # Tried on a context of its own first: a pair caught mid-write must not
                # reach the live one half loaded.
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
                context.load_cert_chain(certfile, keyfile)
                if client_ca is not None:
                    context.load_verify_locations(client_ca)
            except (OSError, ssl.SSLError) as exc:
                log.warning("keeping the HTTPS certificate: its files changed but do not load (%s)", exc)
                continue
            seen = stamp
            log.info("HTTPS certificate files changed: new connections get the new certificate")

    async def drain(self, grace_s: float) -> None:
        """Stop taking connections; let requests in flight finish for up to grace_s. Streams
        still running a moment before the grace ends are ended with an error event and
        [DONE], so that no client reads a cut body."""
        self._server.config.timeout_graceful_shutdown = max(math.ceil(grace_s), 1)
        self._server.should_exit = True
        closing = asyncio.get_running_loop().call_later(max(grace_s - min(1.0, grace_s / 2), 0),
                                                         self.app.closing.set)
        try:
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._task), grace_s + 5)
        finally:
            closing.cancel()

    async def stop(self) -> None:
        if self._reloading is not None:
            self._reloading.cancel()
        self.app.closing.set()
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 5)
        self._socket.close()
        self.app.close()
