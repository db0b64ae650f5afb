"""Plain steps scored before they are asked for (verifier side).

Decoding plainly, a step's token is the target's argmax, or the token the target's p gives
the gateway's uniform: the verifier computes it itself. So when the gateway says that
plain steps follow this one (`VerifyRequest.run_ahead_steps`, with the next step's
uniform when sampled), the verifier goes on decoding the session plainly, up to that many
steps, as if the gateway had committed each token, and answers each step unasked, under
the step ids the gateway reserved for them. The forwards of a session then follow each
other on the model's thread with nothing between them (`verifier_service.jobs.AheadRun`), and
no message goes from the gateway to the verifier for those steps: at one request in
flight the verifier decodes as a model in one process does, and the gateway's work on each
step overlaps the next forward.

Nothing is decided here. The gateway takes an answer only for the step it would have
asked; any other step it sends for the session (a proposal, a stop string cut, a
re-sync) stops the run after its forward in flight and is scored as asked, the session's
cache cropped back like after any step. A run that stops before its last step for want of
room, or fails, answers its next step id with ABORTED, and the gateway asks that step
itself.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from verifier_service.jobs import ScoreJob


@dataclass
class _Run:
    job: ScoreJob  # scores the run's steps one after another (its `run`)
    future: asyncio.Future  # done when the run ends, however it ends


class RunAhead:
    """The runs of plain steps of one model's sessions, by session id; lives on the event loop."""

    def __init__(self) -> None:
        self._runs: dict[str, _Run] = {}
        self.answered = 0  # steps answered ahead
        self.dropped = 0  # runs cut short: another step came, no room, a failed forward, the session ended

    def start(self, session_id: str, job: ScoreJob, future: asyncio.Future) -> None:
        """Remember the run `job` scores (its end, `future`, takes it out of the table)."""
        run = self._runs[session_id] = _Run(job, future)
        future.add_done_callback(lambda done: self._unlist(session_id, run))

    def _unlist(self, session_id: str, run: _Run) -> None:
        if self._runs.get(session_id) is run:
            del self._runs[session_id]

    async def stop(self, session_id: str) -> None:
        """Another step of the session came: stop its run, if it has one, after the forward
        in flight, and return once the run has put the session back."""
        run = self._runs.get(session_id)
        if run is None:
            return
        assert run.job.run is not None  # a run's job
        run.job.run.stopping = True
        # A future of our own rather than `asyncio.wait` (a set, a counter, callbacks to take
        # off again). Awaited even when the run's future is done: its end callback, added
        # first, may still be queued, and it runs before this one (which puts the session back).
        finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def wake(_: asyncio.Future) -> None:
            if not finished.done():  # not when this step was cancelled meanwhile
                finished.set_result(None)

        run.future.add_done_callback(wake)
        await finished

    def cancel(self, session_id: str) -> None:
        """The session ended, or was evicted: end its run at once (the session is not put
        back; a forward in flight finishes on the model's thread and is thrown away)."""
        run = self._runs.pop(session_id, None)
        if run is not None:
            run.job.cancelled = True
            run.future.cancel()

    def __len__(self) -> int:
        return len(self._runs)
