"""A draft step as the batch scheduler runs it: `ProposeJob` samples up to γ draft tokens,
one per batched forward. Its result, a `DraftReply` (`specd.steps`), is what the draft
service sends back. Pure torch on the model's thread (`consume`); no gRPC.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from draft_service.grammar import GrammarCursor
from specd.devices import select_rows, to_device
from specd.rejection import recovered_token, sample, sample_rows
from specd.sampling import penalized, probs_from_logits, restricted
from specd.steps import DraftReply, DraftRequest, Recovery
from specd.worker.batching import Job
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

    A plain step without `ranked` finds only what the verdict needs: a greedy one each
    position's argmax, a sampled one its token and q there. The runner-up and q's largest
    are for a confidence threshold, pre-drafting and trace spans, and on a CPU the top two
    and the softmax cost the demo draft about 0.05 ms a token, after a forward of 1.4
    (docs/performance.md); at a vocabulary of 131,072 the top two alone take about 0.3 ms.
    An unranked greedy proposal carries no `token_probs`.
    """

    def __init__(self, session: SessionKV, feed: list[int], request: DraftRequest, guess_first: bool = False,
                 recovery: Recovery | None = None, grammar: GrammarCursor | None = None,
                 ranked: bool = True) -> None:
        super().__init__(session, feed, keep=1)
        self.request = request
        self.ranked = ranked or bool(request.min_confidence)
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
        # `post_process` computed it with the forward's other plain greedy steps; unranked,
        # (best, None, None).
        self.decided: tuple[int, int | None, float | None] | None = None
        # A plain sampled step's (token, q of the token, q's row, and when ranked the
        # draft's best other token and q's largest), when `post_process` sampled it with the
        # forward's other steps of the same law.
        self.sampled: tuple[int, float, torch.Tensor, int | None, float | None] | None = None

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
        greedy: dict[tuple[int, bool], list[tuple[ProposeJob, int]]] = {}
        sampled: dict[tuple, list[tuple[ProposeJob, int]]] = {}
        for job, rows in members:
            assert isinstance(job, ProposeJob)
            if rows.stop - rows.start != 1 or not job._plain():
                continue
            limit, transform = job.request.vocab_limit or logits.shape[-1], job.request.transform
            if transform.greedy:
                greedy.setdefault((limit, job.ranked), []).append((job, rows.start))
            else:
                law = (limit, job.ranked, transform.temperature, transform.top_k, transform.top_p, transform.min_p)
                sampled.setdefault(law, []).append((job, rows.start))
        for (limit, ranked), jobs in greedy.items():
            if not ranked:
                for (job, _), best in zip(jobs, _rows(logits, jobs, limit).argmax(dim=-1).tolist()):
                    job.decided = (best, None, None)
                continue
            chosen = _rows(logits, jobs, limit)
            top = chosen.topk(2, dim=-1).indices
            best_q = torch.softmax(chosen, -1).gather(1, top[:, :1])
            # One copy back: ids are exact in float64.
            for (job, _), (best, second, q) in zip(jobs, torch.cat((top.double(), best_q.double()), 1).tolist()):
                job.decided = (int(best), int(second), q)
        for (limit, ranked, *_), jobs in sampled.items():
            chosen = _rows(logits, jobs, limit)
            q = probs_from_logits(chosen, jobs[0][0].request.transform)
            uniforms = to_device(torch.stack([torch.rand((), generator=job.generator, dtype=torch.float64)
                                              for job, _ in jobs]), logits.device)
            token = sample_rows(q, uniforms)
            figures = [token.double(), q.gather(1, token).double()]
            if ranked:
                figures += [chosen.topk(2, dim=-1).indices.double(), q.max(dim=1, keepdim=True).values.double()]
            # One copy back: ids are exact in float64.
            for row, ((job, _), drawn) in enumerate(zip(jobs, torch.cat(figures, 1).tolist())):
                tok, alternative, largest = int(drawn[0]), None, None
                if ranked:
                    best, second, largest = int(drawn[2]), int(drawn[3]), drawn[4]
                    alternative = second if tok == best else best
                job.sampled = (tok, drawn[1], q[row], alternative, largest)

    def consume(self, logits: torch.Tensor) -> bool:
        if logits.shape[0] == 0:  # a prefill chunk: nothing to sample yet
            return False
        request = self.request
        if self.decided is not None:
            best, second, best_q = self.decided
            self.decided = None
            if self.drafted and best_q is not None and best_q < request.min_confidence:
                return True
            return self._propose(best, best_q, second)
        if self.sampled is not None:
            token, token_q, q_row, alternative, largest = self.sampled
            self.sampled = None
            if self.drafted and largest is not None and largest < request.min_confidence:
                return True
            self.probs.append(q_row)
            return self._propose(token, token_q, alternative)
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
        return self._propose(token, float(q[token]), second if token == best else best)

    def _propose(self, token: int, token_q: float | None, alternative: int | None) -> bool:
        """Take `token` (q `token_q`: None for an unranked greedy step) into the proposal,
        with the draft's best other token there (None when unranked); True when the step is done."""
        self.drafted.append(token)
        if token_q is not None:
            self.token_probs.append(token_q)
        if alternative is not None:
            self.alternatives.append(alternative)
        if len(self.drafted) == self.request.draft_length:
            return True
        # The last proposal is not fed: nothing needs its logits yet; it stays known, so
        # the next step feeds it if it was accepted.
        self.pending = [token]
        return False

    def result(self) -> DraftReply:
        self.session.tokens.extend(self.drafted)
        return DraftReply(self.drafted, torch.stack(self.probs) if self.probs else None, self.forward_ms,
                          tuple(self.token_probs), self.batch_stats(), recovered=self.recovered)


def _rows(logits: torch.Tensor, jobs: Sequence[tuple[Job, int]], limit: int) -> torch.Tensor:
    """The jobs' rows of a forward's logits, cut at the vocabulary limit."""
    return select_rows(logits, [row for _, row in jobs])[:, :limit]
