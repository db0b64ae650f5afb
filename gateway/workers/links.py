"""The gateway's side of the worker protocol: one `WorkerLink` per request and worker.

Who owns what in the gateway: a link belongs to one request; it asks `gateway.workers.backend`'s
pool for the stream to its session's endpoint (the pool's `gateway.workers.router` picks the
replica), a `gateway.workers.streams.WorkerStream` that the sessions of every request on that
endpoint share.

A link knows how much of the committed sequence its worker holds (`position`) and sends
only the rest. When the worker has lost the session (NOT_FOUND: evicted or out of sync)
or the stream broke (UNAVAILABLE: the worker restarted), the link re-opens the session
and re-sends the whole committed sequence: workers are caches, the gateway holds the
truth. The step that opens a session names the model the gateway expects; a worker
holding another one (FAILED_PRECONDITION: swapped behind the address) is treated as
lost: the session moves to another endpoint, and no answer from the wrong model is ever
used. A worker that hangs fails nothing by itself, so every step has a budget learned
from measured step times (`gateway.workers.budgets`): a draft step past it is skipped (the step
goes on without a proposal, and the draft service is left alone until a probe finds it
answering); a verifier step past it moves the session to another verifier, or ends the
request with UNAVAILABLE when there is none.
It builds the step messages and turns the answers back into `specd.steps` types, through
`specd.wire`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc
import torch

from gateway.errors import DraftSkipped, WorkerError
from gateway.workers.streams import StepFailed, WorkerStream
from specd.prefixkeys import prompt_keys
from specd.rejection import Draws, verify_greedy
from specd.sampling import Transform
from specd.steps import DraftReply, DraftRequest, ModelInfo, PreDraftRequest, Recovery, Scores
from specd.v1 import worker_pb2
from specd.wire import (
    allowed_to_bytes,
    batch_from_pb,
    draft_request_fields,
    identity_to_pb,
    logprobs_from_pb,
    recovery_to_pb,
    transform_to_pb,
    verdict_from_pb,
    verdict_problem,
)

if TYPE_CHECKING:  # the pool is handed in; `gateway.workers.backend` does not import the links
    from gateway.workers.backend import WorkerPool

log = logging.getLogger(__name__)
# What a link sends and receives each step.
StepMessage = worker_pb2.ProposeRequest | worker_pb2.VerifyRequest
StepResponse = worker_pb2.ProposeResponse | worker_pb2.VerifyResponse

# Codes after which the session can be rebuilt on a (possibly new) worker process.
# FAILED_PRECONDITION: the endpoint holds another model; another endpoint may not.
_REOPENABLE = {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION}


@dataclass
class LinkSettings:
    session_id: str
    max_reopens: int
    connect_timeout_s: float = 5.0  # a new stream's endpoint must accept it within this
    deadline: float | None = None  # the client's deadline (time.monotonic()); None: none
    cache_salt: bytes = b""  # the workers' prefix caches hit only prompts cached under the same salt

    def remaining(self) -> float | None:
        """Seconds left before the client's deadline (None: no deadline)."""
        return None if self.deadline is None else self.deadline - time.monotonic()


def _expires_in_ms(remaining: float | None) -> int:
    """The wire's milliseconds to a deadline `remaining` seconds away (0: none; a deadline
    beyond what uint32 holds, about 49 days, is sent as the longest it can say)."""
    if remaining is None:
        return 0
    return min(max(1, int(remaining * 1e3)), 2 ** 32 - 1)


def _sooner(timeout_s: float, remaining: float | None) -> float:
    return timeout_s if remaining is None else min(timeout_s, remaining)


class StepOverBudget(Exception):
    """A worker did not answer a step within its budget (`gateway.workers.budgets`); the link has
    left the session, which will be re-opened from the committed tokens."""


class Reserved:
    """The step ids a link reserved after the last step it sent, and the futures of the
    answers the worker may send to them unasked (`verifier_service.runahead`), first first."""

    def __init__(self, stream: WorkerStream | None = None, first_id: int = 0,
                 futures: Sequence[asyncio.Future] = ()) -> None:
        self._stream = stream
        self._ids = range(first_id, first_id + len(futures))
        self._futures = collections.deque(futures)
        # The step the next answer is for: the committed length and its last token.
        self.expects: tuple[int, int] | None = None

    def __bool__(self) -> bool:
        return bool(self._futures)

    def next(self) -> asyncio.Future:
        """The next answer's future (the stream's reader hands the answer over and forgets it)."""
        return self._futures.popleft()

    def drop(self) -> None:
        """The link takes none of the rest (it sends the next step itself): the stream
        forgets every id still reserved, the one taken last included if it never came."""
        if self._stream is not None:
            self._stream.forget_reserved(self._ids)
        for future in self._futures:
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # an ABORTED nobody will read is not an error to log
        self._stream, self._futures = None, collections.deque()


class WorkerLink:
    """One request's session on one worker service, over its endpoint's shared stream.

    The stream comes from `pool` (its router picks the endpoint; after the endpoint
    failed the session, moved=True lets it move the session to another). Every step is
    timed against the pool's `StepBudget`. `close()` is called once the request is over
    (the worker forgets the session, the router releases it).
    """

    def __init__(self, name: str, pool: WorkerPool, rpc: str, settings: LinkSettings,
                 identity: ModelInfo | None = None) -> None:
        self.name = name
        # The model validated at start-up; it opens every session (None: nothing checked).
        self.identity = identity
        self.pool = pool
        self._rpc = rpc
        self.settings = settings
        self.position = 0  # committed tokens the worker holds; the next delta starts here
        self.reopens = 0  # sessions re-opened over the request (reported in stats)
        self._failures_in_row = 0  # a step that succeeds after a re-open resets this
        self.last_exchange_bytes = 0  # request + response bytes of the last step
        self._stream: WorkerStream | None = None
        # The worker's name of the session: a new one each time it is re-opened, so a
        # step of the session left behind (still running on a hung worker) is never mixed
        # up with the new one.
        self._incarnation = 0
        self._moved = False  # the last stream's endpoint failed: move the session
        # The answers the worker may send unasked to the steps after the last one sent.
        self.reserved = Reserved()

    @property
    def worker_session(self) -> str:
        return f"{self.settings.session_id}.{self._incarnation}"

    def advance(self, position: int) -> None:
        """After a step: the worker holds the old committed length plus the accepted tokens."""
        self.position = position

    async def exchange(self, committed: list[int], build: Callable[[worker_pb2.SequenceDelta], StepMessage],
                       reserve: int = 0):
        """Send one step built around the delta the worker lacks; return its response (and,
        with `reserve`, keep the futures of that many step ids after it in `self.reserved`).

        StepOverBudget when the worker does not answer within the step's budget (plus the
        connect timeout on a stream the endpoint has not answered yet): a hung worker
        fails nothing.
        """
        while True:
            remaining = self.settings.remaining()
            if remaining is not None and remaining <= 0:
                # Past the client's deadline nothing is re-opened: the request is over.
                self._leave()
                raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"{self.name}: the request's deadline passed")
            delta = worker_pb2.SequenceDelta(session_id=self.worker_session, start=self.position,
                                             tokens=committed[self.position:],
                                             expires_in_ms=_expires_in_ms(remaining))
            if self.position == 0:
                delta.cache_salt = self.settings.cache_salt
            message = build(delta)
            if self.position == 0 and self.identity is not None:  # the step opens the session
                message.expected_model.CopyFrom(identity_to_pb(self.identity))
            budget = self.pool.budget.seconds(len(delta.tokens))
            waited = budget  # what the timeout below stands for, if it fires
            try:
                if self._stream is None:
                    # A session that opens goes where its prompt's prefix is likely cached.
                    prefix = prompt_keys(self.settings.cache_salt, committed) if self.position == 0 else ()
                    self._stream = self.pool.stream(self.settings.session_id, self._rpc, self._moved, prefix)
                stream = self._stream
                if stream.connecting():
                    # A new stream waits for its endpoint, but not for ever: a dead one is left
                    # for another.
                    waited += self.settings.connect_timeout_s
                sent = time.perf_counter()
                step_id, answer, reserved = stream.send(message, reserve)
                try:
                    async with asyncio.timeout(_sooner(waited, remaining)):
                        response = await answer
                except BaseException:
                    Reserved(stream, step_id + 1, reserved).drop()  # answers to these will not be read
                    raise
                finally:
                    stream.forget(step_id)
                self.reserved = Reserved(stream, step_id + 1, reserved)
            except StepFailed as exc:
                code, details = exc.code, exc.details
            except TimeoutError:
                if stream.connecting():
                    stream.close()  # an endpoint that never took the stream: others leave it too
                self._leave()
                if remaining is not None and remaining <= waited:  # the client's deadline, not the budget
                    raise WorkerError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                      f"{self.name}: the request's deadline passed") from None
                self._moved = True
                raise StepOverBudget(f"{self.name} did not answer a step within {waited:.2f} s (the step "
                                     f"budget: {self.pool.budget.describe()})") from None
            else:
                self.pool.budget.observe(time.perf_counter() - sent)
                self._failures_in_row = 0
                self.last_exchange_bytes = message.ByteSize() + response.ByteSize()
                return response
            self._leave()
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                log.error("%s refused a session, it holds another model (moving the session): %s",
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

    def _leave(self) -> None:
        """Leave the session on its worker (which forgets it, cancelling a step of it that
        is still running); the next step re-opens it, from the committed tokens."""
        self.reserved.drop()
        if self._stream is not None:
            self._stream.end_session(self.worker_session)
            self._stream = None
        self._incarnation += 1
        self.position = 0

    def close(self) -> None:
        """The request is over: the worker forgets the session (and stops a step of it
        still running, when the client went away), the router releases it."""
        self.pool.router.release(self.settings.session_id)
        self.reserved.drop()
        if self._stream is not None:
            self._stream.end_session(self.worker_session)
            self._stream = None


class DraftLink(WorkerLink):
    """Asks the draft service for proposals."""

    async def draft(self, committed: list[int], request: DraftRequest, draft_model: str,
                    trace_carrier: dict[str, str], pre_draft: PreDraftRequest | None = None,
                    recovery: Recovery | None = None) -> DraftReply:
        """One proposal; with pre_draft, the draft then pre-drafts the next step (overlap).

        With `recovery` (the last step rejected this draft's token at the end of `committed`),
        the draft first samples the recovered token from its q there, and the proposal
        follows it (`DraftReply.recovered`). Only the draft holds that q, so this step is not
        skipped when the draft is slow: it is asked again (the session re-opened, on another
        draft if there is one; after a pause when the draft is full) and fails with
        UNAVAILABLE when no draft answers.
        """
        recovery_pb = None if recovery is None else recovery_to_pb(recovery, request.transform.sparse)

        def build(delta: worker_pb2.SequenceDelta) -> worker_pb2.ProposeRequest:
            message = worker_pb2.ProposeRequest(
                delta=delta, draft_model=draft_model, trace_context=worker_pb2.TraceContext(carrier=trace_carrier),
                **draft_request_fields(request))
            if pre_draft is not None:
                message.pre_draft.draft_length, message.pre_draft.seed = pre_draft.draft_length, pre_draft.seed
            if recovery_pb is not None:
                message.recovery.CopyFrom(recovery_pb)
            return message

        slow = self.pool.slow
        if recovery is None and not slow.ask(self):
            self._leave()  # a hung draft must not hold the session either
            raise DraftSkipped(f"{self.name} is marked slow; the step goes on without it")
        for attempt in range(1 if recovery is None else self.settings.max_reopens + 1):
            try:
                response = await self.exchange(committed, build)
                break
            except StepOverBudget as exc:
                slow.timed_out(self)
                if recovery is None:
                    raise DraftSkipped(str(exc)) from exc
                log.warning("%s; asking again: only the draft holds q for this step's recovered token", exc)
            except WorkerError as exc:
                slow.abandon(self)
                if recovery is None or exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))  # full for now: its steps in flight free room
            except BaseException:
                slow.abandon(self)
                raise
        else:
            raise WorkerError(grpc.StatusCode.UNAVAILABLE,
                              f"{self.name} did not answer a step whose recovered token only it can draw (it "
                              f"holds the draft's q at the rejected position); retry the request")
        slow.answered()
        recovered = response.recovered_token if response.HasField("recovered_token") else None
        if (recovery is None) != (recovered is None):
            asked = "asked" if recovery is not None else "not asked"
            raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name} was {asked} for a recovered token, and "
                                                        f"{'sent none' if recovered is None else 'sent one'}")
        return DraftReply(list(response.draft_tokens), None, response.forward_ms,
                          tuple(response.draft_token_probs), batch_from_pb(response.batch),
                          pre_drafted=response.pre_drafted, recovered=recovered)


class VerifierLink(WorkerLink):
    """Asks the verifier service for the target's view of a proposal."""

    async def verify(self, committed: list[int], draft_tokens: list[int], transform: Transform,
                     trace_carrier: dict[str, str], draft_token_probs: Sequence[float] = (),
                     draws: Draws | None = None, run_ahead: int = 0, ahead_uniforms: Sequence[float] = (),
                     logprobs: int | None = None, allowed: torch.Tensor | None = None) -> Scores:
        """Greedy: the target's argmax. Sampled: its verdict under `draws` (one row at most crosses).
        With `logprobs`, the decided positions' log-probabilities too; with `allowed` (a
        grammar's bitmask words, int32 [γ+1, ceil(V / 32)]), only those tokens may be chosen.

        run_ahead: plain steps follow, up to that many (sampled, each with its uniform in
        `ahead_uniforms`): the verifier scores them unasked (`verifier_service.runahead`). A
        plain step that one of them is for takes that answer and sends nothing."""
        if self.reserved:
            ahead = self.reserved.expects == (len(committed), committed[-1]) and self.position == len(committed) - 1
            scores = (await self._answered_ahead(draft_tokens, transform, logprobs is not None)
                      if ahead and not draft_tokens else None)
            if scores is not None:
                self._expect_after(committed, scores)
                return scores
            self.reserved.drop()

        def build(delta: worker_pb2.SequenceDelta) -> worker_pb2.VerifyRequest:
            message = worker_pb2.VerifyRequest(
                delta=delta, draft_tokens=draft_tokens, transform=transform_to_pb(transform),
                trace_context=worker_pb2.TraceContext(carrier=trace_carrier), draft_token_probs=draft_token_probs,
                run_ahead_steps=run_ahead)
            if logprobs is not None:
                message.logprobs = logprobs
            if allowed is not None:
                message.allowed_tokens = allowed_to_bytes(allowed)
            if draws is not None:
                message.uniforms.extend((*draws.accept, draws.final))
            message.ahead_uniforms.extend(ahead_uniforms)
            return message

        for _ in range(self.settings.max_reopens + 1):
            try:
                response = await self.exchange(committed, build, run_ahead)
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
        scores = self._scores(response, draft_tokens, transform, logprobs is not None)
        self._expect_after(committed, scores)
        return scores

    async def _answered_ahead(self, draft_tokens: list[int], transform: Transform, logprobs: bool) -> Scores | None:
        """This plain step's answer, sent unasked; None if it does not come within a step's
        budget or came as a failure (the run stopped): then the step is asked."""
        remaining = self.settings.remaining()
        try:
            async with asyncio.timeout(_sooner(self.pool.budget.seconds(1), remaining)):
                response = await self.reserved.next()
        except (StepFailed, TimeoutError):
            return None
        self.last_exchange_bytes = response.ByteSize()
        return self._scores(response, draft_tokens, transform, logprobs)

    def _expect_after(self, committed: list[int], scores: Scores) -> None:
        """After a plain step, the next reserved answer is for the step that commits its token."""
        if self.reserved:
            self.reserved.expects = (len(committed) + 1, scores.plain_token())

    def _scores(self, response: worker_pb2.VerifyResponse, draft_tokens: list[int], transform: Transform,
                logprobs: bool = False) -> Scores:
        batch = batch_from_pb(response.batch)
        if transform.greedy:
            if len(response.target_argmax) != len(draft_tokens) + 1:
                raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name} scored {len(response.target_argmax)} "
                                                            f"positions of {len(draft_tokens) + 1}")
            scores = Scores(list(response.target_argmax), None, response.forward_ms, batch, response.ran_ahead)
            decided = verify_greedy(draft_tokens, scores.argmax or []).accepted + 1
        else:
            problem = verdict_problem(response, len(draft_tokens))
            if problem is not None:  # a verifier of another protocol: never sample from what it sent
                raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name}: {problem}")
            scores = Scores(None, verdict_from_pb(response), response.forward_ms, batch, response.ran_ahead)
            decided = response.accepted + 1
        if not logprobs:
            return scores
        if len(response.logprobs) != decided:
            raise WorkerError(grpc.StatusCode.INTERNAL, f"{self.name} sent log-probabilities of "
                                                        f"{len(response.logprobs)} positions of {decided}")
        return replace(scores, logprobs=logprobs_from_pb(response.logprobs))
