"""Plain steps scored before they are asked for (verifier side).

Decoding plainly, a step's token is the target's argmax, or the token the target's p gives
the gateway's uniform: the verifier computes it itself. So when the gateway says that
the next step will be plain too (`VerifyRequest.run_ahead`, with the next step's uniform
when sampled), the verifier scores that next step at once, as if the gateway had
committed this step's token, instead of idling through the round trip: the answer is
ready, or in the model's next forward, when the gateway asks. The forwards of
a session then follow each other with no gap, and at many sessions the verifier's next
batched forward overlaps the gateway's work on the last one.

Nothing is decided here. An ahead answer is given only to the step it assumed: the same
session, the same committed length, this step's token as the new one, and the same
transform and uniform. Any other step waits
for the ahead one to finish (a forward cannot stop half-way) and is scored as asked;
the session's cache is cropped back like after any step.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specd.rejection import Draws
from specd.sampling import Transform
from specd.steps import Scores


@dataclass(frozen=True)
class PlainStep:
    """A plain step as the verifier is asked it: the committed length before the new
    token, the token, and how it is scored (no draws: greedy)."""

    start: int
    token: int
    transform: Transform
    draws: Draws | None


@dataclass
class _Ahead:
    step: PlainStep  # the step it assumed the gateway asks next
    task: asyncio.Task  # the ahead step: it puts the session back when it finishes


class RunAhead:
    """The ahead steps of one model's sessions, by session id; lives on the event loop."""

    def __init__(self) -> None:
        self._ahead: dict[str, _Ahead] = {}
        # Counted where an ahead step leaves the table, so each is counted once.
        self.answered = 0  # ahead steps that answered the step asked
        self.dropped = 0  # the others: another step came, it could not run, or the session ended

    def start(self, session_id: str, step: PlainStep, task: asyncio.Task) -> None:
        """Remember the ahead step `task`, which scores `step`."""
        ahead = self._ahead[session_id] = _Ahead(step, task)
        task.add_done_callback(lambda done: self._failed(session_id, ahead))

    def _failed(self, session_id: str, ahead: _Ahead) -> None:
        """An ahead step that failed leaves the table at once (its session may have ended,
        and then nothing else would take it out)."""
        if not ahead.task.cancelled() and ahead.task.exception() is not None and self._unlist(session_id, ahead):
            self.dropped += 1

    def _unlist(self, session_id: str, ahead: _Ahead) -> bool:
        """Take `ahead` out of the table; False if something else already did."""
        if self._ahead.get(session_id) is not ahead:
            return False
        del self._ahead[session_id]
        return True

    async def take(self, session_id: str, step: PlainStep | None) -> Scores | None:
        """The ahead answer to `step` (None: not a plain step), if it is the one assumed;
        None otherwise, once any ahead step of the session has finished and put it back."""
        ahead = self._ahead.get(session_id)
        if ahead is None:
            return None
        # Not ahead.task itself: its failure is not this step's. And still listed while this
        # step waits: a session ended meanwhile must find the ahead step to cancel it, or the
        # ahead step would put the session back after the end. A future of our own rather
        # than `asyncio.wait` (a set, a counter, callbacks to take off again): about a third of
        # its cost, once per plain step, and none when the ahead step has finished already.
        if not ahead.task.done():
            finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def wake(_: asyncio.Task) -> None:
                if not finished.done():  # not when this step was cancelled meanwhile
                    finished.set_result(None)

            ahead.task.add_done_callback(wake)
            await finished
        if not self._unlist(session_id, ahead):  # the session ended meanwhile, or the step failed
            return None
        if not ahead.task.cancelled() and ahead.task.exception() is None and step == ahead.step:
            self.answered += 1
            return ahead.task.result()
        self.dropped += 1
        return None

    def cancel(self, session_id: str) -> None:
        """The session ended, or was evicted: stop its ahead step (it does not put the
        session back)."""
        ahead = self._ahead.pop(session_id, None)
        if ahead is not None:
            ahead.task.cancel()
            self.dropped += 1

    def __len__(self) -> int:
        return len(self._ahead)

