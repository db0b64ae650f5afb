"""What the draft and verifier servicers share: a step stream's skeleton.

Both workers serve one bidi stream per client request, one step message at a time:
check the message (refusing a stream meant for another model, or a step that cannot
run), run the step on the model's thread under a span that is the child of the
gateway's step span, convert, answer; when the stream ends, for whatever reason, the
sessions it opened are forgotten. A session belongs to the stream that opened it: the
runtime knows it by the stream's id and the gateway's session id together, so a step
from another stream or connection that names the same session id reaches a different
session (NOT_FOUND unless it opens its own) and changes nothing of the first. Failures leave as statuses through
`specd.interceptors` (`SessionNotFound` NOT_FOUND, `Overloaded` RESOURCE_EXHAUSTED,
`InvalidArgument` INVALID_ARGUMENT); nothing here catches to abort.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

import grpc
from opentelemetry import trace

from specd.runtime import ModelRunner
from specd.steps import BatchStats, ModelInfo
from specd.telemetry import batch_span_attributes, worker_step_span
from specd.wire import identity_mismatch

if TYPE_CHECKING:  # annotations only: specd.wire is this side's protobuf module
    from specd.v1 import worker_pb2

Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")


class StepStream:
    """One client stream: the owner of the sessions it opens, which end when it ends."""

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self._opened: dict[tuple[int, str], tuple[ModelRunner, str]] = {}

    def session(self, runner: ModelRunner, session_id: str) -> str:
        """The runtime's key of this stream's session `session_id` on `runner`, which a
        step of this stream is about to touch."""
        key = f"{self.id}/{session_id}"
        self._opened[(id(runner), key)] = (runner, key)
        return key

    def end(self) -> None:
        for runner, key in self._opened.values():
            runner.end_session(key)


async def serve_steps(requests: AsyncIterator[Request],
                      step: Callable[[Request, StepStream], Awaitable[Response]]) -> AsyncGenerator[Response, None]:
    """Answer each step message of one stream with `step`; end its sessions when it ends."""
    stream = StepStream()
    try:
        async for request in requests:
            yield await step(request, stream)
    finally:
        stream.end()


async def refuse_wrong_model(context: grpc.aio.ServicerContext, expected: worker_pb2.ModelIdentity,
                             held: ModelInfo | None, service: str) -> None:
    """FAILED_PRECONDITION unless this worker holds the model the stream expects
    (`held` None: the model it names is not hosted here)."""
    if held is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this {service} service does not host {expected.name!r}, which the stream expects")
    problem = identity_mismatch(expected, held)
    if problem is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)


async def refuse_problems(context: grpc.aio.ServicerContext, problems: list[str]) -> None:
    """INVALID_ARGUMENT naming every problem of a step message, if it has any."""
    if problems:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))


async def traced_step(tracer: trace.Tracer, span_name: str, carrier: Mapping[str, str],
                      run: Awaitable[Result], attributes: Callable[[Result], dict]) -> Result:
    """Await a step under its worker span (`specd.telemetry.worker_step_span`), then put
    `attributes(result)` on the span when it records."""
    with worker_step_span(tracer, span_name, carrier) as span:
        result = await run
        if span is not None and span.is_recording():
            span.set_attributes(attributes(result))
    return result


def step_span_attributes(model: str, delta: worker_pb2.SequenceDelta, forward_ms: float,
                         batch: BatchStats) -> dict:
    """The attributes every worker step span carries (docs/tracing.md)."""
    return {
        "gen_ai.request.model": model,
        "specd.session.id": delta.session_id,
        "specd.delta.start": delta.start,
        "specd.delta.tokens": len(delta.tokens),
        "specd.forward_ms": forward_ms,
        **batch_span_attributes(batch),
    }
