"""Server interceptors every specd service shares: every failure leaves with a real status.

gRPC answers `UNKNOWN` for an exception that escapes a handler, and for a request that
does not deserialize (bad UTF-8 in a string field, random bytes). `ErrorMappingInterceptor`
is the one place exceptions become statuses: a specd exception leaves with the status it
names (`specd.errors`, which draws the tree), a body that does not decode is
`INVALID_ARGUMENT`, and anything unexpected is `INTERNAL` with a reference the server
logged the traceback under. Handlers that abort with a code of their own pass untouched.
`status_of` is the same mapping for one step of a multiplexed worker stream, which fails
alone, in its result (`specd.worker.service`).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specd.errors import SpecdError, clip

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not deserialize; the handler is not called."""

    error: Exception


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's bad body
            return Undecodable(exc)

    return deserialize


def _undecodable_message(method: str, request: Undecodable) -> str:
    return (f"the request body is not a valid message for {method}: {clip(str(request.error), 200)}; "
            f"string fields must be UTF-8")


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status `exc` stands for in `method`, and its message; an unexpected exception is
    INTERNAL, logged here under the reference the message names."""
    if isinstance(exc, SpecdError) and exc.status is not None:
        return grpc.StatusCode[exc.status], exc.status_message(service_of(method))
    if isinstance(exc, DecodeError):  # a streamed request message that did not decode
        return grpc.StatusCode.INVALID_ARGUMENT, f"a request message is not valid for {method}: {clip(str(exc), 200)}"
    reference = uuid.uuid4().hex[:12]
    log.error("unexpected error in %s (reference %s)", method, reference, exc_info=exc)
    return (grpc.StatusCode.INTERNAL,
            f"internal error in {method}, reference {reference}: the server logged it; please report it")


async def _map(exc: BaseException, method: str, context: grpc.aio.ServicerContext) -> None:
    """Abort with the status that `exc` stands for, and its trailers (re-raises what is
    already a status)."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, SpecdError) and exc.trailers:
        context.set_trailing_metadata(exc.trailers)
    await context.abort(*status_of(exc, method))


def service_of(method: str) -> str:
    """"/specd.v1.Draft/Propose" → "draft": the service a status message names."""
    return method.lstrip("/").partition("/")[0].rpartition(".")[2].lower()


def replace_behavior(handler: grpc.RpcMethodHandler, **fields: Any) -> grpc.RpcMethodHandler:
    """`handler` with some of its fields replaced (a behavior, the request deserializer)."""
    # grpc's handlers are namedtuples at run time; its stubs declare a plain class.
    return handler._replace(**fields)  # type: ignore[attr-defined]


def wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """The same handler, with undecodable requests refused and unexpected errors mapped."""
    if handler.request_streaming and handler.response_streaming:
        behavior = handler.stream_stream

        async def stream_stream(requests, context):
            try:
                # aclosing: when this wrapper is closed (the call ended), the servicer's own
                # generator is closed now, running its finally (session clean-up) at once.
                async with contextlib.aclosing(behavior(requests, context)) as responses:
                    async for response in responses:
                        yield response
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never UNKNOWN
                await _map(exc, method, context)

        return replace_behavior(handler, stream_stream=stream_stream)
    if handler.request_streaming:
        behavior = handler.stream_unary

        async def stream_unary(requests, context):
            try:
                return await behavior(requests, context)
            except Exception as exc:  # noqa: BLE001
                await _map(exc, method, context)

        return replace_behavior(handler, stream_unary=stream_unary)
    deserializer = _tolerant(handler.request_deserializer)
    if handler.response_streaming:
        behavior = handler.unary_stream
        assert behavior is not None  # the behavior of the handler's own kind is always set
        if not inspect.isasyncgenfunction(behavior):  # a coroutine that writes with context.write
            return replace_behavior(handler, request_deserializer=deserializer,
                                    unary_stream=_unary(behavior, method))

        async def unary_stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(method, request))
            try:
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            except Exception as exc:  # noqa: BLE001
                await _map(exc, method, context)

        return replace_behavior(handler, request_deserializer=deserializer, unary_stream=unary_stream)
    assert handler.unary_unary is not None
    return replace_behavior(handler, request_deserializer=deserializer, unary_unary=_unary(handler.unary_unary, method))


def _unary(behavior: Callable[..., Any], method: str) -> Callable[..., Awaitable[Any]]:
    """`behavior` (a coroutine function, or a plain one) with undecodable requests refused
    and unexpected errors mapped."""
    async def unary(request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _undecodable_message(method, request))
        try:
            result = behavior(request, context)
            return await result if inspect.isawaitable(result) else result
        except Exception as exc:  # noqa: BLE001
            await _map(exc, method, context)

    return unary


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Gives every RPC a real status: INVALID_ARGUMENT for a body that does not decode,
    INTERNAL (logged, with a reference) for an unexpected exception; never UNKNOWN."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED itself
            return None
        return wrap_handler(handler, handler_call_details.method)


def guarded(handler: grpc.RpcMethodHandler, check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]
            ) -> grpc.RpcMethodHandler:
    """The same handler, `check` (which aborts the call to refuse it) run first."""
    kind = ("stream" if handler.request_streaming else "unary") + "_" + (
        "stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)
    if handler.response_streaming and inspect.isasyncgenfunction(behavior):
        async def streaming(request, context):
            await check(context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return replace_behavior(handler, **{kind: streaming})

    async def once(request, context):
        await check(context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return replace_behavior(handler, **{kind: once})


class ClientNameInterceptor(grpc.aio.ServerInterceptor):
    """Mutual TLS that checks who the client is, not only who signed its certificate: a
    call is served only when the client certificate names one of `names` (a DNS
    subject-alternative name, or the common name). Health checks are open, as probes need."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        return guarded(handler, self._check)

    async def _check(self, context: grpc.aio.ServicerContext) -> None:
        auth = context.auth_context()
        presented = {v.decode(errors="replace") for key in ("x509_subject_alternative_name", "x509_common_name")
                     for v in auth.get(key, [])}
        if not presented & self.names:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"this worker serves clients named {sorted(self.names)}; the client certificate "
                                f"names {sorted(presented)[:4] or 'nothing'} (--tls-client-names)")
