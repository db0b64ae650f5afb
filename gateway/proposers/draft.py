"""The request's draft model as a proposer: its session on the draft service, reached
through a `DraftClient` (`gateway.workers.links.DraftLink`, or a test's scripted one).

The draft keeps its q rows, so it draws a sampled rejection's recovered token itself, and
the same hop drafts the next step's proposal after that token."""
from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Protocol

from gateway.proposers.base import Proposal, Recovered, StepContext
from gateway.request import Generation
from specd import steps
from specd.steps import DraftRequest, PreDraftRequest, Recovery

# specd.rejection loads torch; the choice that builds proposals (`gateway.proposers.hybrid`) loads none
if TYPE_CHECKING:
    from specd.rejection import Draws, TargetVerdict


class DraftClient(Protocol):
    """What the draft model's proposer needs of the draft service: one session's proposals
    (`gateway.workers.links.DraftLink`)."""

    last_exchange_bytes: int  # request + response bytes of the last hop

    async def draft(self, committed: list[int], request: DraftRequest, draft_model: str, carrier: dict[str, str],
                    pre_draft: PreDraftRequest | None = None, recovery: Recovery | None = None) -> steps.DraftReply:
        """Up to γ draft tokens after `committed`, with qᵢ(xᵢ) unless greedy; DraftSkipped when
        the draft cannot answer this step in time. With `recovery`, the recovered token at
        the end of `committed` first (`specd.steps.DraftReply.recovered`), which the tokens follow."""
        ...

    def advance(self, position: int) -> None:
        """The committed sequence is settled up to `position`: the rest of the session's cache is stale."""

    def close(self) -> None:
        """End the session (a step of it still running is dropped)."""


def draft_seed(request_seed: int, step: int) -> int:
    """The seed of the draft's sampler at a step: a function of the request's seed and the
    step's index only, so overlapped speculation can hand it to the draft a step early and
    the output is the same with overlap on or off."""
    digest = hashlib.blake2b(f"{request_seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class DraftModelProposer:
    """The request's draft model as a proposer: its session on the draft service.

    The draft keeps its q rows, so it draws a sampled rejection's recovered token itself,
    and the same hop drafts the next step's proposal after that token, which this proposer
    keeps for that step (*in hand*) when the step asks the draft for one.
    """

    def __init__(self, client: DraftClient, request: Generation, draft_context: int, vocab_size: int) -> None:
        self.client = client
        self.name = request.draft_model
        self.request = request
        self.draft_context = draft_context
        self.vocab_size = vocab_size
        # The proposal the last recovery hop drafted, and the index of the step it is for: a
        # step that takes another proposer's proposal, or none, leaves it unused.
        self._in_hand: tuple[int, Proposal] | None = None

    async def propose(self, context: StepContext, max_tokens: int) -> Proposal:
        """Up to γ = `max_tokens` draft tokens after the committed ones: the proposal in hand
        when the last step's recovery hop drafted one for this step (for at most its γ: a
        prefix), else a draft hop. DraftSkipped or WorkerError as `DraftClient.draft`."""
        gamma = max_tokens
        in_hand, self._in_hand = self._in_hand, None
        if in_hand is not None and in_hand[0] == context.index:
            return in_hand[1].prefix(gamma)
        request, transform = self.request, self.request.transform
        began = time.perf_counter()
        seed = 0 if transform.greedy else draft_seed(request.seed, context.index)
        pre_draft = None
        if request.overlap:
            # The next step most likely asks for the same γ (a shorter one takes a prefix).
            next_seed = 0 if transform.greedy else draft_seed(request.seed, context.index + 1)
            pre_draft = PreDraftRequest(gamma, next_seed)
        reply = await self.client.draft(context.committed, self._draft_request(gamma, seed), self.name,
                                        context.carrier, pre_draft)
        return self._proposal(reply, began, pre_draft)

    async def recover(self, proposal: Proposal, verdict: TargetVerdict, draws: Draws,
                      context: StepContext, next_gamma: int) -> Recovered:
        """Drawn by the draft, which holds q there. The same hop drafts the next step's
        proposal from it, for at most `next_gamma` tokens (the policy has not seen this step
        yet; a smaller γ takes a prefix): one draft hop a step, as without a rejection.
        WorkerError (UNAVAILABLE) when no draft answers: nothing else can draw this token
        exactly."""
        assert verdict.rejected_row is not None  # a rejection carries p's row
        began = time.perf_counter()
        request = self.request
        kept = context.committed + proposal.tokens[:verdict.accepted]
        remaining = context.remaining - verdict.accepted - 1  # after this step
        gamma = max(0, min(next_gamma, remaining - 1, self.draft_context - len(kept) - 1))
        seed = draft_seed(request.seed, context.index + 1)
        pre_draft = (PreDraftRequest(gamma, draft_seed(request.seed, context.index + 2))
                     if request.overlap and gamma else None)
        self.client.advance(len(kept))  # it holds the accepted tokens; the rest of its proposal is stale
        drafting = time.perf_counter()
        reply = await self.client.draft(kept, self._draft_request(gamma, seed), self.name, context.carrier,
                                        pre_draft, Recovery(verdict.rejected_row, draws.final))
        assert reply.recovered is not None  # the link checks that a recovery was answered
        if reply.tokens:  # none when γ = 0, or the recovered token is one the draft cannot feed
            self._in_hand = (context.index + 1, self._proposal(reply, drafting, pre_draft, in_hand=True))
        return Recovered(reply.recovered, held=True, hop_ms=(time.perf_counter() - began) * 1e3)

    def settle(self, proposal: Proposal, position: int) -> None:
        """The draft's session is settled up to `position`; a proposal of no tokens left it as it was."""
        if proposal.tokens:
            self.client.advance(position)

    def close(self) -> None:
        """End the draft's session."""
        self.client.close()

    def _draft_request(self, gamma: int, seed: int) -> DraftRequest:
        request = self.request
        return DraftRequest(gamma, request.transform, seed, request.min_confidence, self.vocab_size,
                            request.grammar)

    def _proposal(self, reply: steps.DraftReply, began: float, pre_draft: PreDraftRequest | None,
                  in_hand: bool = False) -> Proposal:
        """The draft's reply as the step's proposal; `began`: when its hop started."""
        return Proposal(reply.tokens, reply.token_probs, (time.perf_counter() - began) * 1e3, reply.forward_ms,
                        self.client.last_exchange_bytes, reply.batch, reply.pre_drafted, pre_draft is not None,
                        self, in_hand)

