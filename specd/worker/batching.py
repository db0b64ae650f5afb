"""Continuous batching of one model's forwards across sessions (docs/design.md §4).

Every step a worker is asked for becomes a `Job` in one bounded queue. Whenever the
model is free, the `Scheduler` takes the jobs at the head of the queue, up to
`max_batch_tokens`, and runs ONE batched forward over all of them (`specd.worker.forwards`) on
the model's thread. A job may need several forwards — a draft proposing γ tokens needs
γ, a long prompt is fed `prefill_chunk` tokens at a time so it never holds up the
others for long — and goes back to the head of the queue until it is done; new jobs
join at any forward. Each job keeps its own state (its session, its generator), so what
a request gets does not depend on what shares its batch, up to floating-point rounding.

No gRPC here: `specd.errors.Overloaded` leaves a worker as RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from typing import Any

import torch

from specd.errors import Overloaded
from specd.steps import BatchStats
from specd.worker.kvstore import SessionKV
from specd.worker.layout import BatchRow
from specd.worker.settings import BatchSettings

log = logging.getLogger(__name__)


class Job:
    """One session's step: feeds tokens over one or more forwards, then has a result.

    Subclasses say what to do with each forward's logits (`consume`, on the model's
    thread) and what the result is. `pending` holds the tokens still to feed.
    """

    def __init__(self, session: SessionKV, feed: list[int], keep: int) -> None:
        self.session = session
        self.pending = feed
        self.keep = keep  # logits wanted from the forward that feeds the last pending token
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.started: float | None = None
        self.forward_ms = 0.0  # time of the forwards this job took part in
        self.forwards = 0
        self.largest = (0, 0)  # (sessions, tokens) of the largest forward it shared
        self.open_sessions = 0  # sessions the worker held at the step's first forward
        self.cached = 0  # positions the step found in the prefix cache (the step that opened the session)
        self.future: asyncio.Future | None = None
        # An answer the job hands out while it goes on (`verifier_service.jobs.AheadRun`): a
        # callable for the event loop, and its arguments.
        self.published: tuple[Callable[..., None], tuple] | None = None

    def batch_stats(self) -> BatchStats:
        queue_ms = ((self.started or self.submitted) - self.submitted) * 1e3
        return BatchStats(self.largest[0], self.largest[1], queue_ms, self.forwards, self.open_sessions, self.cached)

    def next_size(self, chunk: int) -> int:
        """Tokens this job feeds in its next forward, at most (what the batch's budget counts)."""
        return min(len(self.pending), max(chunk, self.keep))

    def _next_take(self, chunk: int) -> int:
        """Tokens the next forward takes: all pending, or a chunk that leaves at least `keep`
        tokens for the last forward (their logits are the result)."""
        if len(self.pending) <= max(chunk, self.keep):
            return len(self.pending)
        return min(chunk, len(self.pending) - self.keep)

    def next_end(self, chunk: int) -> int:
        """Positions the session holds after this job's next forward."""
        return self.session.length + self._next_take(chunk)

    def next_row(self, chunk: int) -> BatchRow:
        """The tokens this job feeds in the next forward (logits only with its last tokens)."""
        take = self._next_take(chunk)
        if take == len(self.pending):
            row = BatchRow(self.session, self.pending, self.keep)
            self.pending = []
        else:
            row = BatchRow(self.session, self.pending[:take], 0)
            self.pending = self.pending[take:]
        return row

    @staticmethod
    def post_process(logits: torch.Tensor, members: Sequence[tuple[Job, slice]]) -> None:
        """Before each job consumes its rows: what jobs of this kind compute over all their
        rows of one forward at once (`logits` [Σ keep, V], every row of the forward; each
        member's slice of it), so that a forward costs one launch and one copy to the host,
        not one per session. Nothing by default."""

    def consume(self, logits: torch.Tensor) -> bool:
        """Use the logits [keep, V] of a forward (empty mid-prefill); True when the step is done."""
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


class ForwardClock:
    """Times a forward. On a CPU the host's clock. On CUDA, events on the device's stream:
    the host returns from a forward once its kernels are queued, so the host's clock would
    give the launches' time, and the cost model would price a forward at that."""

    def __init__(self, device: torch.device | None) -> None:
        self._cuda = device is not None and device.type == "cuda"
        self._began = 0.0
        self._ended = 0.0
        self._events: tuple[Any, Any] | None = None

    def start(self) -> None:
        if self._cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        """Mark the forward's end: now on the host, or when the device gets there."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._ended = time.perf_counter()

    def ms(self) -> float:
        """Milliseconds from `start` to `stop`; on CUDA waits for the stop's event (the
        logits it follows are read next anyway)."""
        if self._events is None:
            return (self._ended - self._began) * 1e3
        began, ended = self._events
        ended.synchronize()
        return float(began.elapsed_time(ended))


class Scheduler:
    """One model's queue of jobs and the loop that batches them; lives on the event loop.

    `forward(rows) -> (logits [Σ keep, V], each row's slice of them)` runs on `executor`
    (the model's one thread).
    `open_sessions()` says how many sessions could send a step; while fewer steps are
    queued, a forward waits a moment (`max_wait_ms`) for the others to arrive, and a little
    longer for those it has just answered (`_gather`). With
    `regime`, only rows whose sessions' ends after the forward give the same key share a
    forward (`specd.worker.rope`: a rotary scaling that rotates a forward's rows by its
    last position); the others wait in the queue, in their order, for a forward of their own.
    """

    def __init__(self, forward: Callable[[Sequence[BatchRow]], tuple[torch.Tensor, list[slice]]], executor: Executor,
                 settings: BatchSettings, open_sessions: Callable[[], int] = lambda: 0,
                 regime: Callable[[int], Hashable] | None = None, device: torch.device | None = None) -> None:
        self._forward = forward
        self._clock = ForwardClock(device)
        self._open_sessions = open_sessions
        self._regime = regime
        self._executor = executor
        self.settings = settings
        self._queue: collections.deque[Job] = collections.deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._forward_ms = 10.0  # EMA of one forward, for retry hints
        # Whole forwards that raised since the last that did not: a worker whose every
        # forward fails (a device in a bad state) says NOT_SERVING (`specd.worker.service`).
        self.failed_forwards = 0
        self._running: list[Job] = []  # the jobs of the forwards on the model's thread now
        # Sessions whose steps the last batch answered and which have not sent their next
        # (ids, not the sessions: an ended session's blocks must not wait on this set).
        self._answered: set[int] = set()
        self._other_work = 0  # calls waiting for the model's thread besides the forwards (`on_model_thread`)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop the jobs' futures belong to

    @property
    def busy(self) -> bool:
        """A batch's forwards are running on the model's thread."""
        return bool(self._running)

    @property
    def recent_forward_ms(self) -> float:
        """A recent forward's time (an average): what a retry hint is made of."""
        return self._forward_ms

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, job: Job) -> Any:
        """Queue a job and wait for its result; raises Overloaded when the queue is full."""
        future = self.enqueue(job)
        try:
            return await future
        except asyncio.CancelledError:
            job.cancelled = True  # leaves the batch at its next forward
            raise

    def enqueue(self, job: Job) -> asyncio.Future:
        """Queue a job; its result lands on the future returned (`job.future`). Overloaded
        when the queue is full. Whoever holds the future without awaiting it stops the job
        by setting `job.cancelled` and cancelling the future."""
        if len(self._queue) >= self.settings.max_queue:
            waves = len(self._queue) / max(1, self.settings.max_batch_tokens // 8) + 1
            retry = self._forward_ms * waves
            raise Overloaded(f"{len(self._queue)} steps are waiting for this model (limit "
                             f"{self.settings.max_queue}); retry in about {retry:.0f} ms", retry)
        self._ensure_running()
        self._answered.discard(id(job.session))
        assert self._wake is not None  # made with the loop's task
        job.future = asyncio.get_running_loop().create_future()
        self._queue.append(job)
        self._wake.set()
        return job.future

    async def on_model_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the model's thread, between two forwards: a job's run of forwards
        there stops at the next one to let it in."""
        self._other_work += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        finally:
            self._other_work -= 1

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run(), name="specd-batch-loop")

    def _next_batch(self) -> tuple[list[Job], list[BatchRow]]:
        """Jobs from the head of the queue whose next chunks fit in max_batch_tokens; where
        the model has regimes, those of the oldest waiting job's regime. (Its oldest, not
        the head: jobs in progress go back to the head after each forward, and a regime that
        always has one would keep the other waiting for good.)"""
        jobs: list[Job] = []
        rows: list[BatchRow] = []
        tokens = 0
        chunk = self.settings.prefill_chunk
        key = self._oldest_regime(chunk)
        index = 0
        while index < len(self._queue):
            job = self._queue[index]
            if job.cancelled:
                del self._queue[index]
                if job.future is not None:  # it may have no awaiter to cancel it: its callbacks must run
                    job.future.cancel()
                continue
            if self._regime is not None and self._regime(job.next_end(chunk)) != key:
                index += 1  # it waits, in its place, for a forward of its own regime
                continue
            size = job.next_size(chunk)
            if rows and tokens + size > self.settings.max_batch_tokens:
                break
            del self._queue[index]
            row = job.next_row(chunk)
            jobs.append(job)
            rows.append(row)
            tokens += len(row.tokens)
        return jobs, rows

    def _oldest_regime(self, chunk: int) -> Hashable:
        """The regime of the live job submitted first (None: the model has none, or nothing waits)."""
        if self._regime is None:  # most models: nothing to scan on every forward
            return None
        live = [job for job in self._queue if not job.cancelled]
        if not live:
            return None
        return self._regime(min(live, key=lambda job: job.submitted).next_end(chunk))

    def _run_on_thread(self, jobs: list[Job], rows: list[BatchRow]) -> list[BaseException | bool]:
        """Forwards of these jobs and each job's use of their logits; errors stay with their job.

        While every job needs another forward and no other step waits in the queue, the
        next forward runs here at once. Why: going back to the event loop between forwards
        costs two thread hand-offs and a turn of the loop (about 0.25 ms on a CPU, a
        quarter of a small draft's forward), and a draft proposing γ tokens would pay it γ
        times. A step that arrives meanwhile joins at the next forward, as it would have.
        """
        while True:
            outcomes = self._forward_once(jobs, rows)
            if not self._continues(jobs, outcomes):
                return outcomes
            rows = [job.next_row(self.settings.prefill_chunk) for job in jobs]

    def _continues(self, jobs: list[Job], outcomes: list[BaseException | bool]) -> bool:
        """Whether the same jobs can run their next forward without the event loop: none
        finished, failed or was cancelled, nothing else waits for the thread (a step or other
        work), and the next rows fit. (Read from the model's thread: a queue length, a count
        and flags, each one atomic read.)"""
        if self._queue or self._other_work or any(job.cancelled for job in jobs):
            return False
        if any(outcome is not False for outcome in outcomes):  # finished or failed
            return False
        chunk = self.settings.prefill_chunk
        if self._regime is not None and len({self._regime(job.next_end(chunk)) for job in jobs}) > 1:
            return False  # their next rows may not share a forward: the loop batches them again
        return sum(job.next_size(chunk) for job in jobs) <= self.settings.max_batch_tokens

    def _forward_once(self, jobs: list[Job], rows: list[BatchRow]) -> list[BaseException | bool]:
        """One forward and each job's use of its logits."""
        self._clock.start()
        try:
            logits, kept = self._forward(rows)
        except Exception as exc:  # the whole forward failed: every job in it fails
            self.failed_forwards += 1
            return [exc] * len(jobs)
        self._clock.stop()
        self.failed_forwards = 0
        elapsed = self._clock.ms()
        failed: dict[int, BaseException] = {}
        for kind in {type(job) for job in jobs}:
            members = [(job, rows_kept) for job, rows_kept in zip(jobs, kept) if type(job) is kind]
            try:
                kind.post_process(logits, members)
            except Exception as exc:  # the jobs of this kind fail; the others go on
                failed.update((id(job), exc) for job, _ in members)
        outcomes: list[BaseException | bool] = []
        published = []
        shared = (len(rows), sum(len(r.tokens) for r in rows))
        for job, rows_kept in zip(jobs, kept):
            job.forward_ms += elapsed
            job.forwards += 1
            job.largest = max(job.largest, shared)
            if id(job) in failed:
                outcomes.append(failed[id(job)])
                continue
            try:
                outcomes.append(job.consume(logits[rows_kept]))
            except Exception as exc:
                outcomes.append(exc)
            if job.published is not None:
                published.append(job.published)
                job.published = None
        if published:  # now, not when this run of forwards ends: the gateway waits for them
            assert self._loop is not None  # the jobs were queued on it
            self._loop.call_soon_threadsafe(_hand_out, published)
        self._forward_ms += 0.1 * (elapsed - self._forward_ms)
        return outcomes

    async def _gather(self) -> None:
        """Wait briefly for the steps of other open sessions, so that they share this forward:
        up to `max_wait_ms` for any, and up to a quarter of a forward for those the last
        batch answered.

        Why: the gateway answers its sessions one after another, so their next steps reach
        the worker a little apart; starting at the first one splits them over two forwards.
        And a session just answered is on its way back, a round trip away: under load, the
        other sessions' runs ahead would start the next forward without it, and it would wait
        that whole forward. On the demo pair at 8 in flight (docs/batching.md), two thirds of
        the steps asked between runs missed the next forward that way, a round trip of
        4–6 ms against `max_wait_ms` (3).
        """
        assert self._wake is not None  # made with the loop's task
        loop = asyncio.get_running_loop()
        now, quarter = loop.time(), 0.25 * self._forward_ms / 1e3
        any_deadline = now + min(self.settings.max_wait_ms / 1e3, quarter)
        answered_deadline = now + quarter if self.settings.max_wait_ms > 0 else any_deadline  # 0: no wait at all
        while len(self._queue) < self._open_sessions():
            left = (answered_deadline if self._answered else any_deadline) - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    async def _run(self) -> None:
        assert self._wake is not None  # made with this task
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            await self._gather()
            await self._run_batch()

    async def _run_batch(self) -> None:
        """One batched forward of the jobs at the head of the queue, and its results. A
        method of its own so that nothing of the batch outlives it: the KV blocks of a
        session that ended go back to the pool with its last reference."""
        jobs, rows = self._next_batch()
        if not jobs:
            return
        now = time.perf_counter()
        held = self._open_sessions()
        for job in jobs:
            if job.started is None:
                job.started, job.open_sessions = now, held
        self._running = jobs
        try:
            outcomes = await asyncio.get_running_loop().run_in_executor(self._executor, self._run_on_thread, jobs, rows)
        finally:
            self._running = []
        unfinished = []
        self._answered.clear()  # whoever did not come back for the last forward is not awaited again
        for job, outcome in zip(jobs, outcomes):
            assert job.future is not None  # submitted
            if job.future.done():  # cancelled while its forward ran
                continue
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            elif outcome:
                job.future.set_result(job.result())
                self._answered.add(id(job.session))
            else:
                unfinished.append(job)
        # Jobs in progress go first: a step already started finishes before new ones start.
        self._queue.extendleft(reversed(unfinished))

    async def close(self) -> None:
        for job in self._running:  # a run of forwards on the model's thread stops at the next one
            job.cancelled = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for job in self._queue:
            if job.future is not None and not job.future.done():
                job.future.set_exception(RuntimeError("the model is shutting down"))
        self._queue.clear()


def _hand_out(published: list[tuple[Callable[..., None], tuple]]) -> None:
    """Event loop: the answers that jobs handed out while they went on (one failing to go
    out does not keep the others back)."""
    for hand, args in published:
        try:
            hand(*args)
        except Exception:  # noqa: BLE001 - logged; its gateway asks the step itself
            log.exception("an answer scored ahead could not be handed out")
