"""The gateway's end of a multiplexed worker stream (since worker protocol 3).

A `WorkerStream` is one Propose or Verify stream to one worker endpoint, shared by every
request whose session lives there (`gateway.workers.backend.WorkerPool` keeps one per endpoint
and service). A link hands it a step and awaits the step's answer. The steps handed over
while the stream is busy, or in the same turn of the event loop, leave together in one
message; so after a batched forward, whose results come back in one message, the
sessions' next steps go out in one message too: one write and one read per hop for all
of them, where protocol 2 paid one of each per session.

A step's result names the step; one reader task hands each result to the step waiting
for it. A result with a status fails that step alone (`StepFailed` with the worker's
code); the stream failing (the worker died, the connection broke) fails every step in
flight with the stream's status, and the pool opens a new stream for the next one.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any

import grpc

from specd.v1 import worker_pb2
from specd.wire import status_from_pb

# The message types of each multiplexed RPC: what the gateway sends, and one step of it.
STEP_TYPES: dict[str, tuple[Any, Any]] = {
    "Propose": (worker_pb2.ProposeSteps, worker_pb2.ProposeStep),
    "Verify": (worker_pb2.VerifySteps, worker_pb2.VerifyStep),
}
log = logging.getLogger(__name__)
_CORE_WRITE_FAILURE = "Internal error from Core"  # grpc.aio's details for a write that failed in Core


class StepFailed(Exception):
    """A step did not get an answer: its result carried a status, or its stream failed."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details

    def copy(self) -> StepFailed:
        """A new exception of the same status: each waiting step raises its own, so no
        traceback piles up on one shared object."""
        return StepFailed(self.code, self.details)


class WorkerStream:
    """One multiplexed stream to a worker endpoint (see the module's text)."""

    def __init__(self, call: grpc.aio.StreamStreamCall, rpc: str, channel: grpc.aio.Channel) -> None:
        self._call = call
        self._channel = channel
        self._steps_type, self._step_type = STEP_TYPES[rpc]
        self._outbox: list = []  # steps to send
        self._ended: list[str] = []  # sessions to name ended
        self._waiting: dict[int, asyncio.Future] = {}  # step id → the future its link awaits
        self._step_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self.answered = False  # the worker has answered a step: the endpoint took the stream
        # The status the stream failed with; a failed stream takes no more steps.
        self.failure: StepFailed | None = None
        self._writer = asyncio.create_task(self._write())
        self._reader = asyncio.create_task(self._read())

    def send(self, request, reserve: int = 0) -> tuple[int, asyncio.Future, list[asyncio.Future]]:
        """Queue one step; its id and the future its answer (or `StepFailed`) lands on, and
        the futures of the `reserve` step ids after it, which the worker may answer unasked
        (a verifier's run-ahead): forget them by their ids, step_id + 1 on."""
        if self.failure is not None:
            raise self.failure.copy()
        step_id = next(self._step_ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[step_id] = future
        reserved = []
        for _ in range(reserve):  # no await in between: the ids follow step_id
            reserved.append(asyncio.get_running_loop().create_future())
            self._waiting[next(self._step_ids)] = reserved[-1]
        self._outbox.append(self._step_type(step_id=step_id, request=request))
        self._wake.set()
        return step_id, future, reserved

    def forget_reserved(self, step_ids: range) -> None:
        """Its link will not use the answers to these reserved step ids."""
        for step_id in step_ids:
            self._waiting.pop(step_id, None)

    def connecting(self) -> bool:
        """Whether the stream may still be waiting for its endpoint to accept a connection
        (a restarting worker keeps its address): then a step may wait for that too."""
        return not self.answered and self._channel.get_state() != grpc.ChannelConnectivity.READY

    def forget(self, step_id: int) -> None:
        """Its link is done with a step: drop it if it has not left yet, and its answer
        when it comes."""
        self._waiting.pop(step_id, None)
        self._outbox = [step for step in self._outbox if step.step_id != step_id]

    def end_session(self, session_id: str) -> None:
        """Tell the worker to forget a session, and to cancel a step of it still running."""
        if self.failure is None:
            self._ended.append(session_id)
            self._wake.set()

    def close(self) -> None:
        """Cancel the stream: the worker forgets every session it opened."""
        self._fail(grpc.StatusCode.CANCELLED, "the gateway closed the stream")

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                # One turn of the loop first: the sessions that resumed on the same answer
                # message hand over their next steps, and they leave in one message.
                await asyncio.sleep(0)
                steps, self._outbox = self._outbox, []
                ended, self._ended = self._ended, []
                await self._call.write(self._steps_type(steps=steps, ended_sessions=ended))
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.INTERNAL and details == _CORE_WRITE_FAILURE:
                # grpc/grpc#36066: a write to a stream the worker's end already closed (it
                # died) reports this instead of the stream's own status.
                code = grpc.StatusCode.UNAVAILABLE
            self._fail(code, details)
        except asyncio.InvalidStateError as exc:  # wrote to a stream that already ended
            self._fail(grpc.StatusCode.UNAVAILABLE, str(exc) or "stream closed")
        finally:
            self._ended_otherwise("writer")

    async def _read(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    self._fail(grpc.StatusCode.UNAVAILABLE, "the worker ended the stream")
                    return
                self.answered = True
                for result in message.results:  # type: ignore[attr-defined]  # grpc types EOF as object
                    future = self._waiting.pop(result.step_id, None)
                    if future is None or future.done():  # a step its link gave up on
                        continue
                    if result.status.code:
                        future.set_exception(StepFailed(status_from_pb(result.status), result.status.message))
                    else:
                        future.set_result(result.response)
        except grpc.aio.AioRpcError as exc:
            self._fail(exc.code(), exc.details() or "")
        finally:
            self._ended_otherwise("reader")

    def _ended_otherwise(self, task: str) -> None:
        """A reader or writer that stops leaves a failed stream, whatever stopped it (a
        cancelled call, an unexpected error): never one that takes steps nobody answers."""
        if self.failure is None:
            log.warning("the %s of a worker stream stopped unexpectedly; opening a new stream", task)
            self._fail(grpc.StatusCode.UNAVAILABLE, f"the stream's {task} stopped")

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        if self.failure is not None:
            return
        self.failure = StepFailed(code, details)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self.failure.copy())
        self._waiting.clear()
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._writer, self._reader):
            if task is not current:
                task.cancel()
