"""A verification as the batch scheduler runs it: `ScoreJob` scores γ+1 positions in one
batched forward, and goes on scoring the plain steps after it when it runs ahead
(`AheadRun`). Its result, `Scores` (`specd.steps`), is what the verifier service sends
back. Pure torch on the model's thread (`consume`); no gRPC.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specd.devices import select_rows, upload
from specd.rejection import Draws, TargetVerdict, target_verdict, target_verdicts, verify_greedy
from specd.sampling import Transform, penalized, probs_from_logits, raw_logprobs, restricted
from specd.steps import PositionLogprobs, Scores
from specd.worker.batching import Job
from specd.worker.kvstore import SessionKV


def _verdicts(logits: torch.Tensor, jobs: Sequence[tuple[ScoreJob, slice]]) -> None:
    """The target's verdicts of sampled steps of one law, decided together
    (`specd.rejection.target_verdicts`: two copies to the host for all of them)."""
    chosen = select_rows(logits, [row for _, rows in jobs for row in range(rows.start, rows.stop)])
    p = probs_from_logits(chosen, jobs[0][0].transform)
    steps = []
    for job, _ in jobs:
        assert job.draws is not None  # grouped for its draws
        steps.append((job.draft_tokens, job.draft_token_probs, job.draws))
    for (job, _), verdict in zip(jobs, target_verdicts(p, steps)):
        job.verdict = verdict


# How a run of plain steps scored ahead answers each: (its index, 1 first; its scores, or
# None when the run stopped before it).
AnswerAhead = Callable[[int, "Scores | None"], None]


class AheadRun:
    """Plain steps a `ScoreJob` scores one after another on the model's thread, unasked
    (`verifier_service.runahead`): up to `steps`, each fed the token the one before committed,
    and each answer handed to `answer(index, scores)` on the event loop (index 1 for the
    first). It stops early at EOS, at the context's end, without room in the pool (a bet
    evicts nothing, and leaves `headroom_blocks` free), or when told to (`stopping`, set
    from the event loop)."""

    def __init__(self, steps: int, answer: AnswerAhead, eos_token_ids: tuple[int, ...],
                 max_context: int, headroom_blocks: int, draws: Sequence[Draws] = ()) -> None:
        self.steps = steps
        self.draws = draws  # sampled: each step's draws, in order (empty when greedy)
        self.answer = answer
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.headroom_blocks = headroom_blocks  # pool blocks a run leaves free for asked steps
        self.answered = 0  # steps answered so far
        self.stopping = False  # another step of the session came: stop after the forward in flight
        self.cut_short = False  # it stopped at the context's end or for want of room: the gateway must ask on

    def room_for(self, session: SessionKV, needed: int) -> bool:
        """Hold room in the pool for `needed` positions of `session`, if the run may: a new
        block only while more than `headroom_blocks` stay free."""
        if needed > session.capacity and session.pool.free_blocks <= self.headroom_blocks:
            return False
        return session.reserve(needed)


def decided_logprobs(logits: torch.Tensor, chosen: list[int], positions: int,
                     top: int) -> tuple[PositionLogprobs, ...]:
    """The raw log-probabilities of the first `positions` rows of `logits`: each position's
    `top` likeliest tokens and its chosen token's. A position past `chosen` (a sampled
    rejection: its token is drawn by the draft or the gateway) carries its whole row."""
    logprobs = raw_logprobs(logits[:positions])
    if top:
        best = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        tops = [tuple(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]
    else:
        tops = [()] * positions
    rows = torch.arange(len(chosen), device=logprobs.device)
    token = logprobs[rows, upload(chosen, logprobs.device)].tolist()
    return tuple(PositionLogprobs(tops[i], token[i]) if i < len(chosen) else
                 PositionLogprobs(tops[i], None, logprobs[i].cpu()) for i in range(positions))


class ScoreJob(Job):
    """A verify step: feed the delta and the proposal; keep logits of the last γ+1 positions.

    Greedy, the result is their argmax. Sampled, the acceptance tests run here with the
    gateway's `draws` and the draft's qᵢ(xᵢ), and only the verdict leaves (`specd.rejection`).
    With `allowed` (a grammar's tokens at each position, bool [γ+1, V]) the rest are
    forbidden after the penalties; with `logprobs` (how many alternatives), the raw
    log-probabilities of the positions the step decided come back too.
    """

    def __init__(self, session: SessionKV, feed: list[int], draft_tokens: list[int], transform: Transform,
                 draft_token_probs: list[float], draws: Draws | None, run: AheadRun | None = None,
                 logprobs: int | None = None, allowed: torch.Tensor | None = None) -> None:
        super().__init__(session, feed + draft_tokens, keep=len(draft_tokens) + 1)
        self.run = run  # plain steps scored ahead, unasked (verifier_service.runahead)
        self.draft_tokens = draft_tokens
        self.transform = transform
        self.draft_token_probs = draft_token_probs
        self.draws = draws
        self.logprobs = logprobs
        self.allowed = allowed
        self.scores: Scores | None = None
        self.decided: list[int] | None = None  # a plain greedy step's argmax rows, from `post_process`
        self.verdict: TargetVerdict | None = None  # ...and a plain sampled step's verdict

    def _plain(self) -> bool:
        """Whether the step's law is the target's own logits under the request's temperature
        and truncation alone (no penalties, grammar or logprobs)."""
        return not self.transform.penalized and self.allowed is None and self.logprobs is None

    @staticmethod
    def post_process(logits: torch.Tensor, members: Sequence[tuple[Job, slice]]) -> None:
        """Every plain step of the forward at once, so that host waits per forward stay
        constant however many sessions share it. Greedy ones: one argmax over all the
        forward's rows and one copy to the host. Sampled ones of the same law: one p over
        their rows, their proposed tokens' p and their bonus tokens (each drawn with its
        step's last uniform, uploaded as one tensor) in one copy back, then the rows at their
        rejections in one more (`specd.rejection.target_verdict`, for many steps)."""
        plain = [(job, rows) for job, rows in members
                 if isinstance(job, ScoreJob) and rows.stop > rows.start and job._plain()]
        greedy = [(job, rows) for job, rows in plain if job.transform.greedy]
        if greedy:
            argmax = logits.argmax(dim=-1).tolist()
            for job, rows in greedy:
                job.decided = argmax[rows]
        laws: dict[tuple, list[tuple[ScoreJob, slice]]] = {}
        for job, rows in plain:
            if not job.transform.greedy and job.draws is not None:
                transform = job.transform
                laws.setdefault((transform.temperature, transform.top_k, transform.top_p, transform.min_p),
                                []).append((job, rows))
        for jobs in laws.values():
            _verdicts(logits, jobs)

    def consume(self, logits: torch.Tensor) -> bool:
        if logits.shape[0] == 0:
            return False
        if self.decided is not None:
            self.scores, self.decided = Scores(self.decided, None, 0.0), None
            return self.run is None or not self._go_on(self.run)
        if self.verdict is not None:
            self.scores, self.verdict = Scores(None, self.verdict, 0.0), None
            return self.run is None or not self._go_on(self.run)
        raw = logits
        # Each row over the tokens before it, then the grammar's cut.
        logits = restricted(penalized(logits, self.transform, self.session.tokens), self.allowed)
        if self.transform.greedy:
            self.scores = Scores(logits.argmax(dim=-1).tolist(), None, 0.0)
        else:
            assert self.draws is not None  # a sampled step carries the gateway's draws (checked on arrival)
            p = probs_from_logits(logits, self.transform)
            # A rejected row comes back on the host: the event loop never waits on the device.
            self.scores = Scores(None, target_verdict(self.draft_tokens, self.draft_token_probs, p, self.draws), 0.0)
        if self.logprobs is not None:
            self.scores = self._with_logprobs(self.scores, raw, self.logprobs)
        return self.run is None or not self._go_on(self.run)

    def _with_logprobs(self, scores: Scores, raw: torch.Tensor, top: int) -> Scores:
        """The scores with the raw log-probabilities of the positions they decide: up to the
        first mismatch (greedy), or the accepted ones and the bonus or rejected one."""
        if scores.argmax is not None:
            chosen = scores.argmax[:verify_greedy(self.draft_tokens, scores.argmax).accepted + 1]
            positions = len(chosen)
        else:
            assert scores.verdict is not None
            verdict = scores.verdict
            bonus = [] if verdict.bonus_token is None else [verdict.bonus_token]
            chosen, positions = self.draft_tokens[:verdict.accepted] + bonus, verdict.accepted + 1
        return Scores(scores.argmax, scores.verdict, 0.0, logprobs=decided_logprobs(raw, chosen, positions, top))

    def _go_on(self, run: AheadRun) -> bool:
        """Model's thread, a step of a run scored: hand its answer out and, unless the run
        ends here, become the next step (fed this one's token, scored with its own draws
        when sampled)."""
        scores = self.result()
        run.answered += 1
        self.published = (run.answer, (run.answered, scores))
        token = scores.plain_token()
        known = len(self.session.tokens)
        if run.answered == run.steps or run.stopping or self.cancelled or token in run.eos_token_ids:
            return False  # the run is over, or the gateway will not ask what follows
        if known + 1 >= run.max_context or not run.room_for(self.session, known + 1):
            run.cut_short = True
            return False
        self.session.tokens.append(token)
        self.pending, self.scores = [token], None
        if run.draws:
            self.draws = run.draws[run.answered]
        self.submitted = self.started = time.perf_counter()
        self.forward_ms, self.forwards, self.largest = 0.0, 0, (0, 0)
        return True

    def result(self) -> Scores:
        assert self.scores is not None  # the job finished: consume() scored it
        ahead = self.run is not None
        return Scores(self.scores.argmax, self.scores.verdict, self.forward_ms, self.batch_stats(), ahead,
                      self.scores.logprobs)
