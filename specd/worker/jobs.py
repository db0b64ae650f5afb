"""One step of one session as the batch scheduler runs it: a draft proposal or a verification.

`ProposeJob` samples up to γ draft tokens, one per batched forward; `ScoreJob` scores
γ+1 positions in one. Their results, `Proposal` and `Scores` (`specd.steps`), are what
the services send back. Pure torch on the model's thread (`consume`); no gRPC.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from specd.rejection import (
    Draws,
    TargetVerdict,
    recovered_token,
    sample,
    sample_rows,
    target_verdict,
    target_verdicts,
    verify_greedy,
)
from specd.sampling import Transform, penalized, probs_from_logits, raw_logprobs, restricted
from specd.steps import DraftRequest, PositionLogprobs, Proposal, Recovery, Scores
from specd.worker.batching import Job
from specd.worker.grammar import GrammarCursor
from specd.worker.kvstore import SessionKV


class ProposeJob(Job):
    """A draft step: feed the delta, then sample one token per forward up to γ.

    It also notes, at every position, the draft's best token other than the one it
    proposed: its guess at the token the target would commit there if it rejected the
    proposal (what overlapped speculation pre-drafts from). With `guess_first`, the
    first forward's argmax is such a guess (`self.guess`), fed on without being proposed:
    the branch that assumes every proposal was accepted starts from the draft's guess at
    the bonus token. With `recovery`, the first forward's q is the draft's at the position
    the last step rejected (a session rebuilt from the committed tokens): the recovered
    token is sampled from it and fed on, and the proposal follows it. With `grammar`, q at
    every position is restricted to what a structured request's grammar allows there.
    """

    def __init__(self, session: SessionKV, feed: list[int], request: DraftRequest, guess_first: bool = False,
                 recovery: Recovery | None = None, grammar: GrammarCursor | None = None) -> None:
        super().__init__(session, feed, keep=1)
        self.request = request
        self.grammar = grammar
        self.generator = torch.Generator().manual_seed(request.seed)
        self.guessing = guess_first
        self.guess: int | None = None
        self.recovery = recovery
        self.recovered: int | None = None
        self.drafted: list[int] = []
        self.alternatives: list[int] = []
        self.probs: list[torch.Tensor] = []
        self.token_probs: list[float] = []
        # A plain greedy step's (best, second best, q of the best) at this forward, when
        # `post_process` computed it with the forward's other plain greedy steps.
        self.decided: tuple[int, int, float] | None = None
        # A plain sampled step's (token, second, best, q of the token, q's largest, q's row),
        # when `post_process` sampled it with the forward's other steps of the same law.
        self.sampled: tuple[int, int, int, float, float, torch.Tensor] | None = None

    def _plain(self) -> bool:
        """Whether this forward's law is the draft's own logits under the request's
        temperature and truncation alone: no penalties, grammar, guess or recovery."""
        return (not self.request.transform.penalized and self.grammar is None and not self.guessing
                and self.recovery is None)

    @staticmethod
    def post_process(logits: torch.Tensor, members: Sequence[tuple[Job, slice]]) -> None:
        """Every plain step of the forward at once, so that host waits per forward stay
        constant however many sessions share it (on a GPU each copy to the host waits for
        the device). Greedy ones: one top-2 and one softmax over their rows, and one copy to
        the host. Sampled ones of the same law: one q over their rows, each sampled by inverse
        CDF with its uniform from its own seeded generator (drawn on the host, uploaded as one
        tensor: the same draw and the same token as one at a time), and one copy back. For
        each vocabulary limit (and law) among them."""
        greedy: dict[int, list[tuple[ProposeJob, int]]] = {}
        sampled: dict[tuple, list[tuple[ProposeJob, int]]] = {}
        for job, rows in members:
            assert isinstance(job, ProposeJob)
            if rows.stop - rows.start != 1 or not job._plain():
                continue
            limit, transform = job.request.vocab_limit or logits.shape[-1], job.request.transform
            if transform.greedy:
                greedy.setdefault(limit, []).append((job, rows.start))
            else:
                law = (limit, transform.temperature, transform.top_k, transform.top_p, transform.min_p)
                sampled.setdefault(law, []).append((job, rows.start))
        for limit, jobs in greedy.items():
            chosen = _rows(logits, jobs, limit)
            top = chosen.topk(2, dim=-1).indices
            best_q = torch.softmax(chosen, -1).gather(1, top[:, :1])
            # One copy back: ids are exact in float64.
            for (job, _), (best, second, q) in zip(jobs, torch.cat((top.double(), best_q.double()), 1).tolist()):
                job.decided = (int(best), int(second), q)
        for (limit, *_), jobs in sampled.items():
            chosen = _rows(logits, jobs, limit)
            q = probs_from_logits(chosen, jobs[0][0].request.transform)
            uniforms = torch.stack([torch.rand((), generator=job.generator, dtype=torch.float64)
                                    for job, _ in jobs]).to(logits.device)
            token = sample_rows(q, uniforms)
            top = chosen.topk(2, dim=-1).indices
            figures = torch.cat((token.double(), top.double(), q.gather(1, token).double(),
                                 q.max(dim=1, keepdim=True).values.double()), 1)
            for row, ((job, _), (tok, best, second, token_q, largest)) in enumerate(zip(jobs, figures.tolist())):
                job.sampled = (int(tok), int(second), int(best), token_q, largest, q[row])

    def consume(self, logits: torch.Tensor) -> bool:
        if logits.shape[0] == 0:  # a prefill chunk: nothing to sample yet
            return False
        request = self.request
        if self.decided is not None:
            best, second, best_q = self.decided
            self.decided = None
            if self.drafted and best_q < request.min_confidence:
                return True
            return self._propose(best, second, best, best_q)
        if self.sampled is not None:
            token, second, best, token_q, largest, q_row = self.sampled
            self.sampled = None
            if self.drafted and largest < request.min_confidence:
                return True
            self.probs.append(q_row)
            return self._propose(token, second, best, token_q)
        embeddings = logits.shape[-1]  # the ids this model can be fed
        if request.vocab_limit:
            logits = logits[:, :request.vocab_limit]
        if request.transform.penalized:  # what the target scores this position under: the tokens before it
            logits = penalized(logits, request.transform, self.session.tokens + self.drafted)
        if self.grammar is not None:
            logits = restricted(logits, self.grammar.allowed(self.session.tokens + self.drafted))
        if self.guessing:
            self.guessing = False
            self.guess = int(logits[0].argmax())
            self.session.tokens.append(self.guess)
            self.pending = [self.guess]
            return False
        greedy = request.transform.greedy
        q = torch.softmax(logits[0], -1) if greedy else probs_from_logits(logits, request.transform)[0]
        if self.recovery is not None:
            self.recovered = recovered_token(self.recovery.target_row, q, self.recovery.uniform)
            self.recovery = None
            if self.recovered >= embeddings:  # a target id this draft cannot feed: nothing to draft after it
                return True
            self.session.tokens.append(self.recovered)
            if request.draft_length == 0:  # the recovered token alone: it is not fed yet
                return True
            self.pending = [self.recovered]
            return False
        if self.drafted and request.min_confidence and float(q.max()) < request.min_confidence:
            return True
        best, second = logits[0].topk(2).indices.tolist()
        # Sampled by inverse CDF with a uniform from the step's seeded generator (on the
        # host): the same draw on any device, and only the token comes back from it.
        token = best if greedy else sample(q, float(torch.rand((), generator=self.generator, dtype=torch.float64)))
        if not greedy:
            self.probs.append(q)
        return self._propose(token, second, best, float(q[token]))

    def _propose(self, token: int, second: int, best: int, token_q: float) -> bool:
        """Take `token` (q `token_q`) into the proposal; True when the step is done."""
        self.drafted.append(token)
        self.alternatives.append(second if token == best else best)
        self.token_probs.append(token_q)
        if len(self.drafted) == self.request.draft_length:
            return True
        # The last proposal is not fed: nothing needs its logits yet; it stays known, so
        # the next step feeds it if it was accepted.
        self.pending = [token]
        return False

    def result(self) -> Proposal:
        self.session.tokens.extend(self.drafted)
        return Proposal(self.drafted, torch.stack(self.probs) if self.probs else None, self.forward_ms,
                        tuple(self.token_probs), self.batch_stats(), recovered=self.recovered)


def _verdicts(logits: torch.Tensor, jobs: Sequence[tuple[ScoreJob, slice]]) -> None:
    """The target's verdicts of sampled steps of one law, decided together
    (`specd.rejection.target_verdicts`: two copies to the host for all of them)."""
    index = torch.tensor([row for _, rows in jobs for row in range(rows.start, rows.stop)], device=logits.device)
    p = probs_from_logits(logits.index_select(0, index), jobs[0][0].transform)
    steps = []
    for job, _ in jobs:
        assert job.draws is not None  # grouped for its draws
        steps.append((job.draft_tokens, job.draft_token_probs, job.draws))
    for (job, _), verdict in zip(jobs, target_verdicts(p, steps)):
        job.verdict = verdict


def _rows(logits: torch.Tensor, jobs: Sequence[tuple[Job, int]], limit: int) -> torch.Tensor:
    """The jobs' rows of a forward's logits, cut at the vocabulary limit (one index upload)."""
    index = torch.tensor([row for _, row in jobs], device=logits.device)
    return logits.index_select(0, index)[:, :limit]


# How a run of plain steps scored ahead answers each: (its index, 1 first; its scores, or
# None when the run stopped before it).
AnswerAhead = Callable[[int, "Scores | None"], None]


class AheadRun:
    """Plain steps a `ScoreJob` scores one after another on the model's thread, unasked
    (`specd.worker.runahead`): up to `steps`, each fed the token the one before committed,
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
    token = logprobs[rows, torch.tensor(chosen, dtype=torch.long, device=logprobs.device)].tolist()
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
        self.run = run  # plain steps scored ahead, unasked (specd.worker.runahead)
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
