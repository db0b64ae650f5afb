"""The gateway's side of the worker streams: one `WorkerLink` per request and worker.

Who owns what in the gateway: a link belongs to one request; it asks `gateway.backend`'s
pool for a stream, and the pool's `gateway.router` picks the replica.

A link knows how much of the committed sequence its worker holds (`position`) and sends
only the rest. When the worker has lost the session (NOT_FOUND: evicted or out of sync)
or the stream broke (UNAVAILABLE: the worker restarted), the link opens a new stream and
re-sends the whole committed sequence: workers are caches, the gateway holds the truth.
The first message of every stream names the model the gateway expects; a worker holding
another one (FAILED_PRECONDITION: swapped behind the address) is treated as lost: the
session moves to another endpoint, and no answer from the wrong model is ever used.
A worker that hangs fails nothing by itself, so every step has a budget learned from
measured step times (`gateway.budgets`): a draft step past it is skipped (the step goes
on without a proposal, and the draft service is left alone until a probe finds it
answering); a verifier step past it moves the session to another verifier, or ends the
request with UNAVAILABLE when there is none.
This is the gateway's side of the worker protocol: it builds the step messages and turns
the answers back into `specd.steps` types, through `specd.wire`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from gateway.errors import DraftSkipped, WorkerError
from specd.rejection import Draws
from specd.sampling import Transform
from specd.steps import ModelInfo, PreDraftRequest, Proposal, Scores
from specd.v1 import worker_pb2
from specd.wire import (
    batch_from_pb,
    identity_to_pb,
    transform_to_pb,
    unpack_distributions,
    verdict_from_pb,
    verdict_problem,
)

if TYPE_CHECKING:  # the pool is handed in; gateway.backend does not import the links
    from gateway.backend import WorkerPool

log = logging.getLogger(__name__)
# What a link sends and receives each step.
StepMessage = worker_pb2.ProposeRequest | worker_pb2.VerifyRequest
StepResponse = worker_pb2.ProposeResponse | worker_pb2.VerifyResponse

# Codes after which the session can be rebuilt on a (possibly new) worker process.
# FAILED_PRECONDITION: the endpoint holds another model; another endpoint may not.
_REOPENABLE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION}


_CORE_WRITE_FAILURE = "Internal error from Core"  # grpc.aio's details for a write that failed in Core


@dataclass
class LinkSettings:
    session_id: str
    max_reopens: int
    connect_timeout_s: float = 5.0  # a new stream's endpoint must accept it within this
    deadline: float | None = None  # the client's deadline (time.monotonic()); None: none

    def remaining(self) -> float | None:
        """Seconds left before the client's deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()


def _sooner(timeout_s: float, remaining: float | None) -> float:
    return timeout_s if remaining is None else min(timeout_s, remaining)


class StepOverBudget(Exception):
    """A worker did not answer a step within its budget (`gateway.budgets`); the link has
    dropped the stream, and the session will be re-opened from the committed tokens."""


class WorkerLink:
    """One request's session on one worker service, over one bidi stream at a time.

    The stream is opened through `pool` (its router picks the endpoint; after the
    endpoint failed the session, moved=True lets it move the session to another), with
    `metadata` on every stream. Every step is timed against the pool's `StepBudget`.
    `close()` is called once the request is over (the router forgets the session).
    """

    def __init__(self, name: str, pool: WorkerPool, rpc: str, settings: LinkSettings,
                 identity: ModelInfo | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.name = name
        # The model validated at start-up; it opens every stream (None: nothing checked).
        self.identity = identity
        self.pool = pool
        self._rpc = rpc
        self._metadata = metadata
        self.settings = settings
        self.position = 0  # committed tokens the worker holds; the next delta starts here
        self.reopens = 0  # sessions re-opened over the request (reported in stats)
        self._failures_in_row = 0  # a step that succeeds after a re-open resets this
        self.last_exchange_bytes = 0  # request + response bytes of the last step
        self._call: grpc.aio.StreamStreamCall[StepMessage, StepResponse] | None = None
        self._moved = False  # the last stream's endpoint failed: move the session

    def advance(self, position: int) -> None:
        """After a step: the worker holds the old committed length plus the accepted tokens."""
        self.position = position

    async def exchange(self, committed: list[int], build: Callable[[worker_pb2.SequenceDelta], StepMessage]):
        """Send one step built around the delta the worker lacks; return its response.

        StepOverBudget when the worker does not answer within the step's budget (or does
        not accept a new stream within the connect timeout): a hung worker fails nothing.
        """
        while True:
            remaining = self.settings.remaining()
            if remaining is not None and remaining <= 0:
                # Past the client's deadline nothing is re-opened: the request is over.
                self._drop_call()
                raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"{self.name}: the request's deadline passed")
            delta = worker_pb2.SequenceDelta(session_id=self.settings.session_id, start=self.position,
                                             tokens=committed[self.position:])
            budget = self.pool.budget.seconds(len(delta.tokens))
            waited = budget  # what the timeout below stands for, if it fires
            try:
                message = build(delta)
                sent = time.perf_counter()
                if self._call is None:
                    if self.identity is not None:
                        message.expected_model.CopyFrom(identity_to_pb(self.identity))
                    self._call = self.pool.open_stream(self.settings.session_id, self._rpc, self._moved,
                                                       self._metadata, remaining)
                    # A new stream waits for its endpoint (a restarting worker keeps its
                    # address), but not for ever: a dead one is left for another.
                    waited = self.settings.connect_timeout_s
                    await asyncio.wait_for(self._call.write(message), _sooner(waited, remaining))
                    waited = budget
                else:
                    await self._call.write(message)
                # asyncio.timeout, not wait_for: no task wrapped around every step's read.
                async with asyncio.timeout(_sooner(budget, remaining)):
                    response = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details()
                if code == grpc.StatusCode.INTERNAL and details == _CORE_WRITE_FAILURE:
                    # grpc/grpc#36066: a write to a stream the worker's end already closed (it
                    # died) reports this instead of the stream's own status.
                    code = grpc.StatusCode.UNAVAILABLE
            except asyncio.InvalidStateError as exc:  # wrote to a stream that already ended
                code, details = grpc.StatusCode.UNAVAILABLE, str(exc) or "stream closed"
            except TimeoutError:
                self._drop_call()
                if remaining is not None and remaining <= waited:  # the client's deadline, not the budget
                    raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"{self.name}: the request's deadline passed") from None
                self._moved = True
                self.position = 0  # re-prefill from the committed tokens
                raise StepOverBudget(f"{self.name} did not answer a step within {waited:.2f} s (the step "
                                     f"budget: {self.pool.budget.describe()})") from None
            else:
                if response is not grpc.aio.EOF:
                    self.pool.budget.observe(time.perf_counter() - sent)
                    self._failures_in_row = 0
                    # grpc's stubs type EOF as object, which swallows the response's type.
                    self.last_exchange_bytes = message.ByteSize() + response.ByteSize()  # type: ignore[union-attr]
                    return response
                code, details = grpc.StatusCode.UNAVAILABLE, "stream ended early"
            self._drop_call()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                log.error("%s refused a stream, it holds another model (moving the session): %s",
                          self.name, details)
            # NOT_FOUND: the endpoint is fine but evicted the session; re-open it there.
            # Anything else reopenable: the endpoint itself failed; move if possible.
            self._moved = code != grpc.StatusCode.NOT_FOUND
            if code not in _REOPENABLE:
                # The gateway validated the request; a worker refusing a step is a bug
                # between the two, not something the client can fix.
                upstream = grpc.StatusCode.INTERNAL if code == grpc.StatusCode.INVALID_ARGUMENT else code
                raise WorkerError(upstream, f"{self.name}: {details}")
            self._failures_in_row += 1
            if self._failures_in_row > self.settings.max_reopens:
                raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                                  f"{self.name} failed {self._failures_in_row} times in a row: {details}")
            self.reopens += 1
            self.position = 0  # re-prefill from the committed tokens

    def _drop_call(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self, finished: bool = True) -> None:
        """End the stream; the worker forgets the session, the router releases it.

        finished=False (the request failed or the client went away): cancel, so the
        worker stops at once instead of finishing a step nobody will read.
        """
        self.pool.router.release(self.settings.session_id)
        if self._call is None:
            return
        call, self._call = self._call, None
        if not finished:
            call.cancel()
            return
        try:
            await call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass
        except asyncio.CancelledError:
            call.cancel()  # interrupted half-way: never leave the worker's stream (and session) open
            raise


async def close_links(links: list[WorkerLink | None], finished: bool) -> None:
    """Close every link of a request, even when the request is cancelled while closing one.

    Soak-tested: a client that cancels just as its request finishes used to interrupt the
    draft's close, skip the verifier's, and leave the verifier's session open for good.
    """
    interrupted: asyncio.CancelledError | None = None
    for link in links:
        if link is None:
            continue
        try:
            await link.close(finished and interrupted is None)
        except asyncio.CancelledError as exc:
            interrupted = exc
    if interrupted is not None:
        raise interrupted


class DraftLink(WorkerLink):
    """Asks the draft service for proposals."""

    async def propose(self, committed: list[int], draft_length: int, transform: Transform,
                      seed: int, draft_model: str, min_confidence: float, vocab_limit: int,
                      trace_carrier: dict[str, str], pre_draft: PreDraftRequest | None = None) -> Proposal:
        """One proposal; with pre_draft, the draft then pre-drafts the next step (overlap)."""
        def build(delta: worker_pb2.SequenceDelta) -> worker_pb2.ProposeRequest:
            message = worker_pb2.ProposeRequest(
                delta=delta, draft_length=draft_length, transform=transform_to_pb(transform), seed=seed,
                draft_model=draft_model, min_confidence=min_confidence, vocab_limit=vocab_limit,
                trace_context=worker_pb2.TraceContext(carrier=trace_carrier))
            if pre_draft is not None:
                message.pre_draft.draft_length, message.pre_draft.seed = pre_draft.draft_length, pre_draft.seed
            return message

        slow = self.pool.slow
        if not slow.ask(self):
            self._drop_call()  # a hung draft must not hold the session's stream either
            self.position = 0
            raise DraftSkipped(f"{self.name} is marked slow; the step goes on without it")
        try:
            response = await self.exchange(committed, build)
        except StepOverBudget as exc:
            slow.timed_out(self)
            raise DraftSkipped(str(exc)) from exc
        except BaseException:
            slow.abandon(self)
            raise
        slow.answered()
        probs = unpack_distributions(response.draft_probs) if response.HasField("draft_probs") else None
        return Proposal(list(response.draft_tokens), probs, response.forward_ms, batch=batch_from_pb(response.batch),
                        pre_drafted=response.pre_drafted)


class VerifierLink(WorkerLink):
    """Asks the verifier service for the target's view of a proposal."""

    async def verify(self, committed: list[int], draft_tokens: list[int], transform: Transform,
                     trace_carrier: dict[str, str], draft_token_probs: Sequence[float] = (),
                     draws: Draws | None = None) -> Scores:
        """Greedy: the target's argmax. Sampled: its verdict under `draws` (one row at most crosses)."""
        def build(delta: worker_pb2.SequenceDelta) -> worker_pb2.VerifyRequest:
            message = worker_pb2.VerifyRequest(
                delta=delta, draft_tokens=draft_tokens, transform=transform_to_pb(transform),
                trace_context=worker_pb2.TraceContext(carrier=trace_carrier), draft_token_probs=draft_token_probs)
            if draws is not None:
                message.uniforms.extend((*draws.accept, draws.final))
            return message

        for _ in range(self.settings.max_reopens + 1):
            try:
                response = await self.exchange(committed, build)
                break
            except StepOverBudget as exc:
                # A hung verifier: another one takes the session, if there is one.
                if not self.pool.router.has_alternative(self.settings.session_id):
                    raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"{exc}; no other verifier to fail over to") \
                        from exc
                log.warning("%s; moving the session to another verifier", exc)
                self.reopens += 1
        else:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, f"{self.name}: every verifier tried was over budget")
        batch = batch_from_pb(response.batch)
        if transform.greedy:
            if len(response.target_argmax) != len(draft_tokens) + 1:
                raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name} scored {len(response.target_argmax)} "
                                                            f"positions of {len(draft_tokens) + 1}")
            return Scores(list(response.target_argmax), None, response.forward_ms, batch)
        problem = verdict_problem(response, len(draft_tokens))
        if problem is not None:  # a verifier of another protocol: never sample from what it sent
            raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name}: {problem}")
        return Scores(None, verdict_from_pb(response), response.forward_ms, batch)

