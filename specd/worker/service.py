"""What the draft and verifier servicers share: a multiplexed step stream's skeleton.

A gateway keeps one stream open to each worker endpoint it uses (since worker protocol 3,
`proto/specd/v1/worker.proto`); each message carries the ready steps of its sessions and
the sessions it is done with. `serve_multiplexed` runs every step as a task of its own
(so the steps of one message meet in the model's next batched forward), answers each in
a result that names it, and sends the results that finish together in one message. A
step that fails, fails alone: its result carries the status that
`specd.interceptors.status_of` gives its exception (`SessionNotFound` NOT_FOUND,
`Overloaded` RESOURCE_EXHAUSTED, `InvalidArgument` INVALID_ARGUMENT, `WrongModel`
FAILED_PRECONDITION), and the stream goes on. Each step runs under a span that is the
child of the gateway's step span.

A session belongs to the stream that opened it: the runtime knows it by the stream's id
and the gateway's session id together, so a step from another stream or connection that
names the same session id reaches a different session (NOT_FOUND unless it opens its
own) and changes nothing of the first. A session ends when the gateway names it ended
(a step of it still running is cancelled and answered CANCELLED: its client went away,
or the gateway gave up on the step), when its request's deadline passes
(`SequenceDelta.expires_in_ms`), or when the stream ends.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from opentelemetry import trace

from specd.errors import InvalidArgument, StepCancelled, WrongModel, clip
from specd.interceptors import status_of
from specd.steps import BatchStats, ModelInfo
from specd.telemetry import batch_span_attributes, worker_step_span
from specd.wire import identity_mismatch, status_to_pb
from specd.worker.runtime import ModelRunner

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # annotations only: specd.wire is this side's protobuf module
    from specd.v1 import worker_pb2

Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")


class StepStream:
    """One gateway's stream: the owner of the sessions its steps open. `answer(step_id,
    response or exception)` answers a step the gateway reserved but did not send (the
    verifier's run-ahead, `verifier_service.runahead`), in the stream's next results message."""

    def __init__(self, answer: Callable[[int, Any], None]) -> None:
        self.id = uuid.uuid4().hex
        self._opened: dict[tuple[int, str], tuple[ModelRunner, str]] = {}
        self.answer = answer

    def session(self, runner: ModelRunner, session_id: str) -> str:
        """The runtime's key of this stream's session `session_id` on `runner`, which a
        step of this stream is about to touch."""
        key = self._key(session_id)
        self._opened[(id(runner), key)] = (runner, key)
        return key

    def end_session(self, session_id: str) -> None:
        """Forget this stream's session `session_id` on every model it touched."""
        key = self._key(session_id)
        for opened in [o for o in self._opened if o[1] == key]:
            runner, _ = self._opened.pop(opened)
            runner.end_session(key)

    def end(self) -> None:
        for runner, key in self._opened.values():
            runner.end_session(key)
        self._opened.clear()

    def _key(self, session_id: str) -> str:
        return f"{self.id}/{session_id}"


class _Steps:
    """The steps of one stream that are running, and the results not yet sent."""

    def __init__(self, step: Callable[[Any, StepStream, int], Awaitable[Any]], result_type: Callable[..., Any],
                 method: str) -> None:
        self.stream = StepStream(self._answer)
        self._step, self._result_type, self._method = step, result_type, method
        self.running: dict[str, tuple[asyncio.Task, int]] = {}  # session id → its step in flight, and its id
        self._expiry: dict[str, asyncio.TimerHandle] = {}  # session id → when its request's deadline passes
        self.finished: list = []  # results to send
        self.ready = asyncio.Event()  # a result finished, or the gateway stopped sending

    async def read(self, messages: AsyncIterator) -> None:
        """Start each step of each message; end the sessions each one names ended."""
        try:
            async for message in messages:
                for entry in message.steps:
                    session_id = entry.request.delta.session_id
                    if session_id in self.running:
                        self._finish(entry.step_id, InvalidArgument(
                            f"session {clip(session_id)} already has a step running; send one step a session"))
                        continue
                    self.running[session_id] = (asyncio.create_task(self._run(entry, session_id)), entry.step_id)
                    if entry.request.delta.expires_in_ms:
                        self._expire_later(session_id, entry.request.delta.expires_in_ms / 1e3)
                # After the steps: a step that left beside its session's end is ended too.
                for session_id in message.ended_sessions:
                    self.end_session(session_id)
        finally:
            self.ready.set()

    async def _run(self, entry, session_id: str) -> None:
        try:
            response = await self._step(entry.request, self.stream, entry.step_id)
        except asyncio.CancelledError:  # its session ended, which answered the step
            return
        except Exception as exc:  # noqa: BLE001 - a step fails alone, with a status
            self._finish(entry.step_id, exc)
        else:
            self.finished.append(self._result_type(step_id=entry.step_id, response=response))
            self.ready.set()
        finally:
            if self.running.get(session_id, (None,))[0] is asyncio.current_task():
                del self.running[session_id]

    def _answer(self, step_id: int, outcome: Any) -> None:
        """Answer a reserved step: a response, or the exception it failed with."""
        if isinstance(outcome, BaseException):
            self._finish(step_id, outcome)
        else:
            self.finished.append(self._result_type(step_id=step_id, response=outcome))
            self.ready.set()

    def end_session(self, session_id: str) -> None:
        """The session is over: cancel a step of it still running (answered CANCELLED, so
        every step gets one result), and forget it."""
        running = self.running.pop(session_id, None)
        if running is not None:
            task, step_id = running
            task.cancel()
            self._finish(step_id, StepCancelled(f"session {clip(session_id)} ended while its step ran"))
        expiry = self._expiry.pop(session_id, None)
        if expiry is not None:
            expiry.cancel()
        self.stream.end_session(session_id)

    def _expire_later(self, session_id: str, seconds: float) -> None:
        """End the session when its request's deadline passes (each step moves the time)."""
        expiry = self._expiry.pop(session_id, None)
        if expiry is not None:
            expiry.cancel()
        self._expiry[session_id] = asyncio.get_running_loop().call_later(seconds, self.end_session, session_id)

    def _finish(self, step_id: int, exc: BaseException) -> None:
        code, message = status_of(exc, self._method)
        self.finished.append(self._result_type(step_id=step_id, status=status_to_pb(code, message)))
        self.ready.set()

    def cancel(self) -> None:
        for task, _ in self.running.values():
            task.cancel()
        self.running.clear()
        for expiry in self._expiry.values():
            expiry.cancel()
        self._expiry.clear()
        self.stream.end()


async def serve_multiplexed(messages: AsyncIterator, step: Callable[[Request, StepStream, int], Awaitable[Response]],
                            results_type: Callable[..., Any], result_type: Callable[..., Any],
                            method: str) -> AsyncGenerator[Any, None]:
    """Serve one multiplexed stream: run every step of every message with `step(request,
    stream, step_id)`, and answer with `results_type` messages of `result_type` results (see the module's text).

    The stream ends once the gateway has stopped sending and every step has answered;
    its sessions end with it, whatever ended it.
    """
    steps = _Steps(step, result_type, method)
    reader = asyncio.create_task(steps.read(messages))
    try:
        while True:
            await steps.ready.wait()
            steps.ready.clear()
            # One turn of the loop first: steps that finished in the same batched forward
            # resume one after the other, and their results leave in one message.
            await asyncio.sleep(0)
            if steps.finished:
                results, steps.finished = steps.finished, []
                yield results_type(results=results)
            if reader.done():
                if reader.exception() is not None:  # a message that did not decode: the stream's status
                    reader.result()
                if not steps.running and not steps.finished:
                    return
    finally:
        reader.cancel()
        steps.cancel()


def check_model(expected: worker_pb2.ModelIdentity, held: ModelInfo | None, service: str) -> None:
    """WrongModel unless this worker holds the model a session expects (`held` None: the
    model it names is not hosted here)."""
    if held is None:
        raise WrongModel(f"this {service} service does not host {expected.name!r}, which the session expects")
    problem = identity_mismatch(expected, held)
    if problem is not None:
        raise WrongModel(problem)


def check_problems(problems: list[str]) -> None:
    """InvalidArgument naming every problem of a step, if it has any."""
    if problems:
        raise InvalidArgument("; ".join(problems))


async def traced_step(tracer: trace.Tracer, span_name: str, carrier: Mapping[str, str],
                      run: Awaitable[Result], attributes: Callable[[Result], dict]) -> Result:
    """Await a step under its worker span (`specd.telemetry.worker_step_span`), then put
    `attributes(result)` on the span when it records."""
    if not carrier:  # tracing is off: no span, and none of the context manager's cost per step
        return await run
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
        "specd.prefix_cache.hit_tokens": batch.cached,  # the prompt positions a session-opening step reused
        **batch_span_attributes(batch),
    }


# Whole forwards failing in a row before a worker reports NOT_SERVING. A request's bad
# input fails its own step, never a whole forward; forwards that all fail are the device
# or the process, which a restart (the liveness probe on "") may cure and traffic cannot.
FAILING_FORWARDS = 5


async def watch_forwards(runners: Mapping[str, ModelRunner], health: Any, names: list[str],
                         interval_s: float = 1.0) -> None:
    """Set `names` and "" NOT_SERVING while any runner's last FAILING_FORWARDS forwards
    all failed, SERVING again once one succeeds; runs until cancelled."""
    from grpc_health.v1 import health_pb2

    serving = True
    while True:
        await asyncio.sleep(interval_s)
        failing = [name for name, runner in runners.items() if runner.scheduler.failed_forwards >= FAILING_FORWARDS]
        if serving == (not failing):
            continue
        serving = not failing
        if failing:
            log.error("the last %d forwards of %s all failed: NOT_SERVING", FAILING_FORWARDS, ", ".join(failing))
        else:
            log.warning("forwards succeed again: SERVING")
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *names):
            await health.set(name, status)
