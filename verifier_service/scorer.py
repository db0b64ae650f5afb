"""The verifier's role over the shared model runtime: scoring γ+1 positions of the target.

A `Scorer` holds the target's `ModelRunner` (`specd.worker.runtime`: the model, its KV
pool, its sessions and its batch scheduler, which a draft runs too) and owns what only the
verifier keeps for a session beside its KV cache: the run of plain steps it scores ahead,
unasked (`verifier_service.runahead`). The runner decides when a session goes (evicted,
or ended); it tells the scorer, and the session's run ends with it
(`ModelRunner(on_session_gone=)`). No gRPC here.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from specd.errors import InvalidArgument
from specd.rejection import Draws
from specd.sampling import Transform
from specd.steps import Scores
from specd.worker.metrics import RoleLoad
from specd.worker.runtime import ModelRunner
from specd.worker.settings import ModelSettings
from verifier_service.jobs import AheadRun, AnswerAhead, ScoreJob
from verifier_service.runahead import RunAhead


class Scorer:
    """The target model: its runner, and each session's run of plain steps scored ahead."""

    def __init__(self, path: str | Path, settings: ModelSettings = ModelSettings(), *,
                 name: str | None = None) -> None:
        self.runner = ModelRunner(path, settings, name=name, on_session_gone=self._forget)
        self.run_ahead = RunAhead()

    def _forget(self, session_id: str) -> None:
        """The runner let a session go: its run ends at once. (Called before the runner
        drops the session: a run holds its session taken, and puts it back at its end
        unless it was cancelled here.)"""
        self.run_ahead.cancel(session_id)

    def role_load(self) -> RoleLoad:
        """What the scorer has done beside the sessions' steps, for the metrics."""
        return RoleLoad(run_ahead_answered=self.run_ahead.answered, run_ahead_dropped=self.run_ahead.dropped)

    async def score(self, session_id: str, start: int, tokens: list[int], draft_tokens: list[int],
                    transform: Transform, draft_token_probs: Sequence[float] = (),
                    draws: Draws | None = None, run_ahead: int = 0, ahead_draws: Sequence[Draws] = (),
                    answer_ahead: AnswerAhead | None = None, logprobs: int | None = None,
                    allowed: torch.Tensor | None = None, salt: bytes = b"") -> Scores:
        """Bring the session up to date and score γ+1 positions in one forward.

        The forward is shared with every session verifying at the same time. With no
        draft tokens this is one plain decoding step (one position). A sampled step needs
        the draft's qᵢ(xᵢ) and the gateway's draws: its result is the verdict.

        With `run_ahead` (a plain step), up to that many plain steps after this one are
        scored next, unasked, each answered with `answer_ahead(index, scores)` (index 1
        first; scores None: the run stopped before that step); sampled, each with its draws
        from `ahead_draws`, one per step (`verifier_service.runahead`).

        `logprobs`: also the raw log-probabilities of the positions decided, with that many
        alternatives each. `allowed`: a grammar's tokens at each of the γ+1 positions (bool
        [γ+1, V]); the others are forbidden there.
        """
        if not transform.greedy and (draws is None or len(draws.accept) != len(draft_tokens)
                                     or len(draft_token_probs) != len(draft_tokens)):
            raise InvalidArgument(f"a sampled step needs {len(draft_tokens) + 1} uniforms and "
                                  f"{len(draft_tokens)} draft token probabilities (worker protocol 2)")
        bad = [t for t in draft_tokens if not 0 <= t < self.runner.info.vocab_size]
        if bad:
            raise InvalidArgument(f"draft token id {bad[0]} is outside {self.runner.info.name}'s vocabulary of "
                                  f"{self.runner.info.vocab_size}")
        if run_ahead and (draft_tokens or answer_ahead is None):
            raise InvalidArgument("only a plain step (no draft tokens) may run ahead")
        if allowed is not None and (allowed.shape[0] != len(draft_tokens) + 1 or run_ahead):
            raise InvalidArgument(f"allowed_tokens must have one row for each of the {len(draft_tokens) + 1} "
                                  f"positions scored, got {allowed.shape[0]}, and no run ahead")
        if run_ahead and not transform.greedy and len(ahead_draws) != run_ahead:
            raise InvalidArgument(f"a sampled step that runs {run_ahead} steps ahead needs a uniform for each; "
                                  f"it sent {len(ahead_draws)}")
        await self.run_ahead.stop(session_id)  # any other step stops the session's run
        session, feed = self.runner.sync(session_id, start, tokens, len(draft_tokens), salt)
        if not feed:
            self.runner.sessions.release()
            raise InvalidArgument("nothing to score: a step must carry at least one new committed token")
        session.tokens.extend(draft_tokens)
        job = ScoreJob(session, feed, list(draft_tokens), transform, list(draft_token_probs), draws,
                       logprobs=logprobs, allowed=allowed)
        scores = await self.runner.step(session_id, session, job)
        if run_ahead:
            assert answer_ahead is not None  # checked on arrival
            self._run_ahead(session_id, scores.plain_token(), transform, ahead_draws, run_ahead, answer_ahead,
                            logprobs)
        return scores

    def _run_ahead(self, session_id: str, token: int, transform: Transform, draws: Sequence[Draws], steps: int,
                   answer: AnswerAhead, logprobs: int | None) -> None:
        """Score up to `steps` plain steps after the one that committed `token`, unasked. Not
        past EOS or the context, nor while the queue is half full (a bet must not take the
        room of steps that were asked for), nor without room in the pool (a bet evicts
        nothing): then the first step is answered None, and the gateway asks it itself."""
        runner = self.runner
        if token in runner.info.eos_token_ids:  # the gateway ends the request here
            return
        if not runner.sessions.holds(session_id):  # it ended while this step ran: nobody waits
            return
        session = runner.sessions.take(session_id)
        start = len(session.tokens)
        # A run leaves an eighth of the pool to asked steps, which cannot evict a session
        # running ahead (it is taken).
        run = AheadRun(steps, answer, runner.info.eos_token_ids, runner.info.max_context, runner.pool.blocks // 8,
                       draws)
        if (start + 1 >= runner.info.max_context or runner.scheduler.queued >= runner.scheduler.settings.max_queue // 2
                or not run.room_for(session, start + 1)):
            runner.sessions.put(session_id, session)
            runner.sessions.release()
            self.run_ahead.dropped += 1
            answer(1, None)
            return
        session.tokens.append(token)
        job = ScoreJob(session, [token], [], transform, [], draws[0] if draws else None, run, logprobs)
        future = runner.scheduler.enqueue(job)
        future.add_done_callback(lambda done: self._run_ended(session_id, job, run))
        self.run_ahead.start(session_id, job, future)

    def _run_ended(self, session_id: str, job: ScoreJob, run: AheadRun) -> None:
        """A run's end, however it came: the session goes back to the store (cropped to its
        answered steps if a forward failed), unless the session ended. A run that failed or
        was cut short answers its next step None, for the gateway to ask it; one that
        stopped at EOS or for another step of the session need not."""
        assert job.future is not None
        self.run_ahead.answered += run.answered
        failed = job.future.cancelled() or job.future.exception() is not None
        if job.cancelled or run.stopping or failed or run.cut_short:
            self.run_ahead.dropped += 1
        try:
            if not job.cancelled:
                if failed:
                    kept = len(job.session.tokens) - 1  # the failed step's token is not committed
                    job.session.crop(kept)
                    job.session.tokens = job.session.tokens[:kept]
                self.runner.sessions.put(session_id, job.session)
                if failed or run.cut_short:
                    run.answer(run.answered + 1, None)
        finally:
            self.runner.sessions.release()
