"""Speculative sampling: accept or reject draft tokens so the output keeps the target's law.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and
Chen et al. 2023 ("Accelerating LLM Decoding with Speculative Sampling"). Words used:

- draft tokens x₁..x_γ: what the draft proposed, with its distributions q₁..q_γ;
- target distributions p₁..p_{γ+1}: the target's, from one forward over the proposal;
- accepted: the leading draft tokens kept (xᵢ kept with probability min(1, pᵢ(xᵢ)/qᵢ(xᵢ)));
- recovered token: sampled from norm(max(0, pᵢ − qᵢ)) at the first rejection;
- bonus token: sampled from p_{γ+1} when every draft token was accepted.

A step emits the accepted tokens plus one recovered or bonus token. The gateway draws
every uniform a step uses (`Draws`); the verifier runs the acceptance tests and samples a
bonus token with them, so only a rejected position's row of p ever leaves it. The
recovered token is sampled where q is: by the draft service, which keeps its q rows and
is sent p's row with its next proposal request, or by the gateway for a model-free
proposal, whose q is one-hot (docs/serving-path.md, "What crosses the wire").
Pure torch; no gRPC.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specd.devices import select_rows, upload


@dataclass(frozen=True)
class StepOutcome:
    """What one verification decided."""

    accepted: int  # number of leading draft tokens accepted
    token: int  # the recovered token (after a rejection) or the bonus token
    bonus: bool  # True when every draft token was accepted and `token` came from p_{γ+1}


def verify_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> StepOutcome:
    """Greedy special case: accept while xᵢ == argmax pᵢ, then emit the target's argmax.

    draft_tokens: γ ids; target_argmax: γ+1 ids. Plain Python: a handful of ints, compared
    on every step of every greedy request, cost less than building tensors for them.
    """
    gamma = len(draft_tokens)
    assert len(target_argmax) == gamma + 1, "need γ+1 target positions"
    accepted = next((i for i, (x, best) in enumerate(zip(draft_tokens, target_argmax)) if x != best), gamma)
    return StepOutcome(accepted, int(target_argmax[accepted]), accepted == gamma)


@dataclass(frozen=True)
class Draws:
    """The randomness of one sampled step, drawn by the gateway from the request's generator:
    one uniform per draft token (its acceptance test) and one for the step's last token."""

    accept: tuple[float, ...]
    final: float

    @staticmethod
    def draw(gamma: int, generator: torch.Generator) -> Draws:
        uniforms = torch.rand(gamma + 1, generator=generator, dtype=torch.float64).tolist()
        return Draws(tuple(uniforms[:gamma]), uniforms[gamma])


def accepted_prefix(draft_token_probs: Sequence[float], target_token_probs: Sequence[float],
                    uniforms: Sequence[float]) -> int:
    """How many leading draft tokens pass their test uᵢ < pᵢ(xᵢ)/qᵢ(xᵢ).

    The test needs only the two probabilities of each proposed token, so it runs where p
    is (the verifier) without any full distribution crossing a wire. Written as
    u·q < p: no division, and q = 0 (impossible for a sampled token) would simply reject.
    """
    for i, (q, p, u) in enumerate(zip(draft_token_probs, target_token_probs, uniforms)):
        if not u * q < p:
            return i
    return len(uniforms)


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """max(0, p − q) [V]: the weights (`sample` normalises them) of the token after a rejection."""
    weights = torch.clamp(target_probs - draft_probs, min=0.0)
    # p == q up to rounding: rejection had probability ~0, and p itself is the law.
    return weights if weights.sum() > 0 else target_probs


def sample(weights: torch.Tensor, uniform: float) -> int:
    """The token at `uniform` of the cumulative law of non-negative weights [V] (inverse CDF).

    A token of weight 0 is never chosen; the sum runs in float64, so rounding moves no mass
    that matters. The same uniform always gives the same token: a seed reproduces a step.
    """
    cumulative = torch.cumsum(weights.double(), 0)
    at = (cumulative[-1] * uniform).reshape(1)  # on the weights' device: no copy to the host before the search
    return min(int(torch.searchsorted(cumulative, at, right=True)), weights.shape[0] - 1)


def sample_rows(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`sample` for each row of weights [n, V] with its uniform (float64 [n], on their
    device): the tokens [n, 1], on the device, with no copy to the host."""
    cumulative = torch.cumsum(weights.double(), 1)
    return torch.searchsorted(cumulative, cumulative[:, -1:] * uniforms[:, None], right=True).clamp(
        max=weights.shape[1] - 1)


@dataclass(frozen=True)
class TargetVerdict:
    """The verifier's part of a sampled step: how many draft tokens passed their test, and
    either the bonus token (all passed) or p at the first rejected position, the one row
    the gateway needs to sample the recovered token."""

    accepted: int
    bonus_token: int | None
    rejected_row: torch.Tensor | None  # p_{accepted+1} [V]


def target_verdict(draft_tokens: Sequence[int], draft_token_probs: Sequence[float], target_probs: torch.Tensor,
                   draws: Draws) -> TargetVerdict:
    """Run the acceptance tests where p is; sample the bonus token if every test passed.

    draft_token_probs: qᵢ(xᵢ) as the draft drew them; target_probs: [γ+1, V] (p). A
    rejected row comes back on the host (it is sent to the gateway).
    """
    assert target_probs.shape[0] == len(draft_tokens) + 1
    return target_verdicts(target_probs, [(draft_tokens, draft_token_probs, draws)])[0]


def target_verdicts(target_probs: torch.Tensor,
                    steps: Sequence[tuple[Sequence[int], Sequence[float], Draws]]) -> list[TargetVerdict]:
    """`target_verdict` for several steps at once, with two copies to the host for all of
    them: p of every proposed token with every step's bonus token (drawn whether or not it
    is needed: one row each), then the rows at the rejections.

    target_probs: the steps' p rows one after another, γᵢ+1 for step i; steps: (draft
    tokens, qᵢ(xᵢ), draws) of each.
    """
    device = target_probs.device
    proposed_rows: list[int] = []
    proposed_tokens: list[int] = []
    last_rows: list[int] = []  # each step's last row: its bonus token's law
    for draft_tokens, draft_token_probs, draws in steps:
        gamma = len(draft_tokens)
        assert len(draft_token_probs) == gamma == len(draws.accept)
        start = last_rows[-1] + 1 if last_rows else 0
        proposed_rows += range(start, start + gamma)
        proposed_tokens += draft_tokens
        last_rows.append(start + gamma)
    uniforms = upload([draws.final for _, _, draws in steps], device, torch.float64)
    figures = sample_rows(select_rows(target_probs, last_rows), uniforms)[:, 0].double()  # the bonus tokens
    if proposed_rows:  # none in plain steps: no upload and no gather
        proposed_at = upload(proposed_rows + proposed_tokens, device).view(2, -1)
        figures = torch.cat((target_probs[proposed_at[0], proposed_at[1]].double(), figures))
    listed = figures.tolist()  # one copy to the host
    proposed, bonus_tokens = listed[:len(proposed_rows)], listed[len(proposed_rows):]
    verdicts: list[TargetVerdict | None] = []
    rejected: list[tuple[int, int, int]] = []  # (step, accepted, p's row)
    for i, ((draft_tokens, draft_token_probs, draws), last, bonus_token) in enumerate(
            zip(steps, last_rows, bonus_tokens)):
        gamma = len(draft_tokens)
        taken, proposed = proposed[:gamma], proposed[gamma:]
        accepted = accepted_prefix(draft_token_probs, taken, draws.accept)
        verdicts.append(TargetVerdict(gamma, int(bonus_token), None) if accepted == gamma else None)
        if accepted < gamma:
            rejected.append((i, accepted, last - gamma + accepted))
    if rejected:
        rows = target_probs.index_select(0, upload([row for _, _, row in rejected], device))
        for (i, accepted, _), row in zip(rejected, rows.float().cpu()):
            verdicts[i] = TargetVerdict(accepted, None, row)
    done = [verdict for verdict in verdicts if verdict is not None]
    assert len(done) == len(steps)  # each step accepted all, or was rejected at a row
    return done


def recovered_token(target_row: torch.Tensor, draft_row: torch.Tensor, uniform: float) -> int:
    """The token after a rejection: sampled from norm(max(0, p − q)) at the rejected position
    with the step's last uniform. Run where q is (the draft service, for a draft model's
    proposal; the gateway, for a model-free one), with p's row sent there."""
    width = max(target_row.shape[0], draft_row.shape[0])  # a draft and a target may pad their vocabularies apart
    device = draft_row.device
    p, q = (torch.nn.functional.pad(row.to(device, torch.float32), (0, width - row.shape[0]))
            for row in (target_row, draft_row))
    return sample(residual(p, q), uniform)


def finish_verdict(verdict: TargetVerdict, draft_row: Callable[[int], torch.Tensor], draws: Draws) -> StepOutcome:
    """The gateway's part, where it holds q: the bonus token as the verifier drew it, or the
    recovered token sampled from norm(max(0, p − q)) at the first rejection. draft_row(i):
    q's row at position i (a model-free proposal's one-hot row, made only when a rejection
    needs it)."""
    if verdict.bonus_token is not None:
        return StepOutcome(verdict.accepted, verdict.bonus_token, True)
    assert verdict.rejected_row is not None  # a rejection carries p's row
    token = recovered_token(verdict.rejected_row, draft_row(verdict.accepted), draws.final)
    return StepOutcome(verdict.accepted, token, False)
