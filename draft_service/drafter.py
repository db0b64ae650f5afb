"""The draft's role over the shared model runtime: proposing γ tokens.

A `Drafter` holds one draft model's `ModelRunner` (`specd.worker.runtime`: the model, its
KV pool, its sessions and its batch scheduler, which the verifier runs too) and owns what
only a draft keeps for a session beside its KV cache:

- the q rows of its last sampled proposal (`KeptRowsStore`), from which the next step's
  recovered token is drawn, so that they never cross the wire;
- the branches pre-drafted for its next step (`draft_service.predraft`);
- its grammar cursor (`draft_service.grammar`), so the draft proposes under a structured
  request's grammar.

The runner decides when a session goes (evicted, or ended); it tells the drafter, and
this state goes with it (`ModelRunner(on_session_gone=)`). No gRPC here.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from draft_service.grammar import GrammarCursors
from draft_service.jobs import ProposeJob
from draft_service.predraft import Branch, PreDrafts
from specd.errors import InvalidArgument
from specd.rejection import recovered_token
from specd.steps import DraftReply, DraftRequest, PreDraftRequest, Recovery
from specd.worker.metrics import RoleLoad
from specd.worker.runtime import ModelRunner
from specd.worker.settings import ModelSettings


@dataclass(frozen=True)
class KeptRows:
    """A session's last sampled proposal's q rows [m, V], its first token at `start`."""

    start: int
    probs: torch.Tensor

    def covers(self, position: int) -> bool:
        return self.start <= position < self.start + self.probs.shape[0]

    def row(self, position: int) -> torch.Tensor:
        """q at `position` (which `covers`)."""
        return self.probs[position - self.start]


class KeptRowsStore:
    """Each draft session's kept q rows, within a byte budget; the only owner of them.

    Past the budget the rows kept longest ago go first. That is safe: a recovery whose
    rows are gone rebuilds q from the committed tokens (`ProposeJob(recovery=)`), at the
    cost of one forward over the step's tokens. Why a budget: the rows cost γ × vocabulary
    × 4 bytes a session (10 MB at γ = 16 and 152,000 tokens), on the model's device,
    beside a KV pool sized without them.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._rows: OrderedDict[str, KeptRows] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def put(self, session_id: str, rows: KeptRows) -> None:
        self.pop(session_id)
        self._rows[session_id] = rows
        self.nbytes += _row_bytes(rows)
        while self.nbytes > self.max_bytes and self._rows:
            self.nbytes -= _row_bytes(self._rows.popitem(last=False)[1])

    def pop(self, session_id: str) -> KeptRows | None:
        rows = self._rows.pop(session_id, None)
        if rows is not None:
            self.nbytes -= _row_bytes(rows)
        return rows


def _row_bytes(rows: KeptRows) -> int:
    return rows.probs.numel() * rows.probs.element_size()


class Drafter:
    """One draft model: its runner, and each session's kept q rows, pre-drafted branches
    and grammar cursor."""

    def __init__(self, path: str | Path, settings: ModelSettings = ModelSettings(), *, name: str | None = None,
                 pre_draft_branches: str = "3", kept_rows_bytes: int = 512 << 20,
                 grammar_mask_budget_ms: float = 20.0, draft_base: Path | None = None,
                 cpu_weights: str = "float16") -> None:
        """pre_draft_branches: which verdicts to pre-draft for (`draft_service.predraft`);
        kept_rows_bytes: the kept q rows' budget, all sessions together (`KeptRowsStore`).
        The rows live on the model's device beside its KV pool, so the runner sizes the
        pool leaving room for them. grammar_mask_budget_ms: a session's grammar cursor whose
        mask takes longer stops guiding its proposals (`draft_service.grammar`). draft_base:
        the target a draft made by `specd distill` from the target alone reads its shared
        weights from (`specd.worker.sharing`). cpu_weights: "float16", a draft's large
        linear layers on a CPU hold float16 weights (`specd.worker.packing`), or
        "as-loaded"."""
        self.runner = ModelRunner(path, settings, name=name, kept_rows_bytes=kept_rows_bytes,
                                  draft_base=draft_base, float16_linears=cpu_weights == "float16",
                                  on_session_gone=self._forget)
        info = self.runner.info
        self.kept_rows = KeptRowsStore(kept_rows_bytes)
        self.pre_drafts = PreDrafts(self.runner.scheduler.submit, pre_draft_branches)
        self.grammars = GrammarCursors(self.runner.tokenizer, info.vocab_size, info.eos_token_ids,
                                       settings.max_sessions, grammar_mask_budget_ms)

    def _forget(self, session_id: str) -> None:
        """The runner let a session go (evicted or ended): its branches (they hold pool
        blocks), kept q rows and grammar cursor go with it."""
        self.pre_drafts.cancel(session_id)
        self.kept_rows.pop(session_id)
        self.grammars.drop(session_id)

    def role_load(self) -> RoleLoad:
        """What the drafter holds beside the sessions' KV caches, for the metrics."""
        return RoleLoad(kept_rows_bytes=self.kept_rows.nbytes, pre_drafted_sessions=len(self.pre_drafts))

    async def propose(self, session_id: str, start: int, tokens: list[int], request: DraftRequest,
                      pre_draft: PreDraftRequest | None = None, recovery: Recovery | None = None,
                      salt: bytes = b"", ranked: bool = True) -> DraftReply:
        """Bring the session up to date and propose up to `request.draft_length` tokens.

        The draft forwards are shared with every session proposing at the same time.
        With request.min_confidence, proposing stops early (after at least one token) when
        the draft's top probability for the next token falls below it. request.vocab_limit
        > 0 keeps proposals below that id (the target's vocabulary). With pre_draft, the next
        step's proposal is drafted for the likely verdicts once this one is answered
        (`draft_service.predraft`); a request matching one is answered from it.

        A sampled proposal's q rows stay here (`KeptRows`). With `recovery`, the last step
        rejected this draft's token at position `start`: the recovered token is sampled
        first, from p's row and the q kept for that position (or, in a session rebuilt from
        the committed tokens, the q its forward finds there), and the proposal follows it
        (`DraftReply.recovered`). γ may then be 0: the recovered token alone.

        ranked: a greedy proposal also carries each token's q and the draft's runner-up
        (`ProposeJob`); pre-drafting needs them, so a step that asks it is ranked anyway.
        """
        draft_length = request.draft_length
        if draft_length < 1 and recovery is None:
            raise InvalidArgument("draft_length must be >= 1")
        kept = self.kept_rows.pop(session_id)
        recovered = None
        if recovery is not None and not tokens and kept is not None and kept.covers(start):
            recovered = await self._draw_recovered(recovery, kept.row(start))
            if recovered >= self.runner.info.vocab_size:  # a target id this draft has no embedding for
                self.pre_drafts.cancel(session_id)
                return DraftReply([], None, 0.0, recovered=recovered)  # nothing to draft after it
            tokens, recovery = [recovered], None
        if recovery is not None:  # rebuilt: no branch assumed what the forward will draw
            self.pre_drafts.cancel(session_id)
            branch = None
        else:
            branch = self.pre_drafts.take(session_id, start, tokens, request)
        proposal = job = None
        if branch is not None:
            proposal, job = await self._adopt(session_id, branch, draft_length)
        if proposal is None:
            # The guess a pre-drafted branch may feed, then the drafted tokens fed back.
            session, feed = self.runner.sync(session_id, start, tokens, draft_length + 1, salt)
            if not feed and recovery is not None and start > 0:  # q at `start` needs its last token fed again
                session.crop(start - 1)
                feed = session.tokens[start - 1:start]
                self.runner.reserve(session, start + draft_length + 1)  # position start - 1 may be shared
            if not feed:
                self.runner.sessions.release()
                raise InvalidArgument("nothing to feed: a step must carry at least one new committed token")
            if draft_length == 0 and recovery is None:  # the recovered token alone, sampled above
                self.runner.sessions.put(session_id, session)
                self.runner.sessions.release()
                return DraftReply([], None, 0.0, recovered=recovered)
            grammar = (await self.grammars.cursor(session_id, request.grammar, request.transform.output_start)
                       if request.grammar else None)
            job = ProposeJob(session, feed, request, recovery=recovery, grammar=grammar,
                             ranked=ranked or pre_draft is not None)
            proposal = await self.runner.step(session_id, session, job)
        assert job is not None  # it made the proposal
        committed = len(job.session.tokens) - len(proposal.tokens)
        if proposal.probs is not None:
            self.kept_rows.put(session_id, KeptRows(committed, proposal.probs))
        if recovered is not None:
            proposal = replace(proposal, recovered=recovered)
        if pre_draft is not None and proposal.tokens:
            settled = self.pre_drafts.start(session_id, job.session, committed, job, pre_draft)
            proposal = replace(proposal, pre_draft=settled)
        return proposal

    async def _draw_recovered(self, recovery: Recovery, draft_row: torch.Tensor) -> int:
        """The recovered token from a kept q row. On a CPU at once; on an accelerator on the
        model's thread, since the draw waits for the device (its work queued before it), and
        the event loop, which every session's messages go through, must not."""
        if self.runner.device.type == "cpu":
            return recovered_token(recovery.target_row, draft_row, recovery.uniform)
        return await self.runner.scheduler.on_model_thread(recovered_token, recovery.target_row, draft_row,
                                                           recovery.uniform)

    async def _adopt(self, session_id: str, branch: Branch,
                     draft_length: int) -> tuple[DraftReply | None, ProposeJob | None]:
        """Answer from a pre-drafted branch: its session becomes the session's (None: it failed)."""
        try:
            full = await branch.task
        except (Exception, asyncio.CancelledError):
            return None, None
        session = branch.job.session
        cut = len(full.tokens) - min(draft_length, len(full.tokens))  # a shorter γ takes a prefix
        if cut:
            session.tokens = session.tokens[:-cut]
            del branch.job.drafted[-cut:], branch.job.alternatives[-cut:]
        session.crop(len(session.tokens) - 1)  # the last proposal is known, not cached
        self.runner.sessions.drop(session_id)
        self.runner.sessions.put(session_id, session)
        kept = len(full.tokens) - cut
        probs = None if full.probs is None else full.probs[:kept]
        return DraftReply(full.tokens[:kept], probs, full.forward_ms, full.token_probs[:kept], full.batch,
                          pre_drafted=True), branch.job
