"""Overlapped speculation, draft side: branches pre-drafted while the target verifies.

After answering a proposal x₁..x_m, the draft service keeps drafting the NEXT step's
proposal for the verdicts it can guess, one branch each, while the gateway has the
target verify this one (PEARL's post-verify; "speculative speculative decoding"):

- branch j < m assumes x₁..x_j accepted and x_{j+1} rejected, and that the target then
  commits the draft's best other token at position j+1;
- branch m assumes everything accepted and a bonus token equal to the draft's own next
  token (its guess, `ProposeJob(guess_first=True)`).

Each branch is an ordinary `ProposeJob` on a fork of the session's KV cache, sampling
with the seed the next request will carry, so its tokens and q are exactly what that
request would get (up to batched floating point). The next request either matches a
branch — same committed length and token, seed, transform, γ at most the branch's — and
is answered from it at once, or every branch is dropped and it is proposed as usual.
Nothing pre-drafted reaches the committed sequence except through a matching request.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from draft_service.grammar import GrammarCursor
from draft_service.jobs import ProposeJob
from specd.steps import DraftReply, DraftRequest, PreDraftRequest
from specd.worker.kvstore import SessionKV


def check_branches(mode: str) -> str:
    """Which verdicts to pre-draft for: "all" (every accepted length), "bonus" (only all
    accepted), or a number K: the K verdicts the draft itself finds most likely."""
    if mode in ("all", "bonus") or (mode.isdigit() and int(mode) >= 1):
        return mode
    raise ValueError(f"pre-draft branches must be all, bonus or a number >= 1, got {mode!r}")


@dataclass
class Branch:
    """One guessed verdict: the committed length `start` it assumes and the token the target
    commits there (`token`; None for the all-accepted branch: its job's guess, once made)."""

    start: int
    token: int | None
    job: ProposeJob
    task: asyncio.Task

    def assumes(self, start: int, token: int) -> bool:
        guessed = self.token if self.token is not None else self.job.guess
        return self.start == start and guessed == token

    def cancel(self) -> None:
        self.job.cancelled = True
        self.task.cancel()


@dataclass
class PendingPreDraft:
    """The branches of one session and the request they were drafted under."""

    request: DraftRequest
    branches: list[Branch]

    def cancel(self) -> None:
        for branch in self.branches:
            branch.cancel()


class PreDrafts:
    """Pending branches by session, on the event loop; `submit` queues a job on the model."""

    def __init__(self, submit: Callable[[ProposeJob], Coroutine[Any, Any, DraftReply]], mode: str = "3") -> None:
        self._submit = submit
        self.mode = check_branches(mode)
        self._pending: dict[str, PendingPreDraft] = {}

    def start(self, session_id: str, session: SessionKV, committed: int, proposed: ProposeJob,
              pre_draft: PreDraftRequest) -> asyncio.Future:
        """Pre-draft the next step of a session that has just proposed `proposed.drafted`.

        committed: the committed length the proposal followed (its x₁ is at that index).
        Returns a future done when every branch has finished or been dropped, with the
        accepted lengths they assumed.
        """
        self.cancel(session_id)
        drafted, request = proposed.drafted, proposed.request.then(pre_draft)
        branches = []
        for j in self._verdicts(proposed.token_probs):
            if j < len(drafted):  # x_{j+1} rejected: the target commits the draft's other guess there
                token = proposed.alternatives[j]
                branch = self._branch(session, committed + j, token, token, request, proposed.grammar)
            else:  # everything accepted: feed x_m (not cached yet), guess the bonus, go on from it
                branch = self._branch(session, committed + j - 1, drafted[-1], None, request, proposed.grammar)
            if branch is not None:
                branches.append(branch)
        self._pending[session_id] = PendingPreDraft(request, branches)
        assumed = [branch.start - committed for branch in branches]
        settled = asyncio.gather(*(branch.task for branch in branches), return_exceptions=True)
        return asyncio.ensure_future(_then(settled, assumed))

    def _verdicts(self, token_probs: tuple[float, ...] | list[float]) -> list[int]:
        """The accepted lengths j to pre-draft for, most likely first by the draft's own
        reckoning: P(j) = Π_{i≤j} q_i(x_i) · (1 − q_{j+1}(x_{j+1})), P(m) = Π_{i≤m} q_i(x_i)."""
        m = len(token_probs)
        if self.mode == "bonus":
            return [m]
        likelihood, survive = [], 1.0
        for j, q in enumerate(token_probs):
            likelihood.append((survive * (1.0 - q), j))
            survive *= q
        likelihood.append((survive, m))
        ranked = [j for _, j in sorted(likelihood, reverse=True)]
        return ranked if self.mode == "all" else ranked[:int(self.mode)]

    def _branch(self, session: SessionKV, keep: int, feed: int, token: int | None, request: DraftRequest,
                grammar: GrammarCursor | None) -> Branch | None:
        """A job proposing from the first `keep` cached tokens plus `feed` (then a guess if token
        is None), under a copy of the proposal's grammar cursor if it had one; None when the
        KV pool has no room for it (pre-drafting is only a bet)."""
        fork = session.fork(keep, keep + request.draft_length + 2)
        if fork is None:
            return None
        fork.tokens.append(feed)
        job = ProposeJob(fork, [feed], request, guess_first=token is None,
                         grammar=None if grammar is None else grammar.copy())
        task = asyncio.get_running_loop().create_task(self._submit(job))
        task.add_done_callback(_consume_error)
        start = keep if token is not None else keep + 1
        return Branch(start, token, job, task)

    def take(self, session_id: str, start: int, tokens: list[int], request: DraftRequest) -> Branch | None:
        """The branch matching a session's next request, if any; every other branch is dropped.
        A branch answers a request that differs from the one it foresaw only by a shorter γ
        (it takes a prefix)."""
        pending = self._pending.pop(session_id, None)
        if pending is None:
            return None
        hit = None
        foreseen = pending.request
        settings_match = (replace(request, draft_length=foreseen.draft_length) == foreseen
                          and 0 < request.draft_length <= foreseen.draft_length and len(tokens) == 1)
        for branch in pending.branches:
            if hit is None and settings_match and branch.assumes(start, tokens[0]):
                hit = branch
            else:
                branch.cancel()
        return hit

    def cancel(self, session_id: str) -> None:
        pending = self._pending.pop(session_id, None)
        if pending is not None:
            pending.cancel()

    def __len__(self) -> int:
        return len(self._pending)


async def _then(settled: Awaitable, value):
    await settled
    return value


def _consume_error(task: asyncio.Task) -> None:
    """A branch nobody takes may fail or be cancelled: that is not an error to report."""
    if not task.cancelled():
        task.exception()
