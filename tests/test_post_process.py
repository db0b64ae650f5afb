"""A forward's post-processing runs once for all the sessions in it (`Job.post_process`):
host waits per forward stay constant as sessions grow, greedy or sampled, and a seeded step
samples the same tokens whatever else shares its forward."""
from __future__ import annotations

import asyncio
import sys

import pytest
import torch

from draft_service.drafter import Drafter
from specd.rejection import Draws
from specd.sampling import Transform
from specd.steps import DraftRequest
from specd.worker.settings import ModelSettings
from verifier_service.scorer import Scorer

SAMPLED = Transform(temperature=0.8, top_p=0.95)


def prompts(sessions: int) -> list[list[int]]:
    return [[5 + i, 6, 7, 8] for i in range(sessions)]


async def draft_steps(drafter: Drafter, sessions: int, transform: Transform, seed: int = 0) -> list[list[int]]:
    proposals = await asyncio.gather(*(drafter.propose(f"s{i}", 0, p, DraftRequest(4, transform, seed=seed + i))
                                       for i, p in enumerate(prompts(sessions))))
    return [proposal.tokens for proposal in proposals]


def draws_of(sessions: int, seed: int = 0) -> list[Draws]:
    """Each session's uniforms, as the gateway draws them (made before anything is counted)."""
    return [Draws.draw(4, torch.Generator().manual_seed(seed + i)) for i in range(sessions)]


async def verify_steps(scorer: Scorer, sessions: int, transform: Transform, draws: list[Draws]) -> list:
    return await asyncio.gather(*(
        scorer.score(f"s{i}", 0, p, [9, 10, 11, 12], transform, [0.3, 0.3, 0.3, 0.3],
                     None if transform.greedy else draws[i]) for i, p in enumerate(prompts(sessions))))


async def discarded(steps) -> None:
    """Run the steps and drop what they return: asyncio may print a finished task's result
    (tensors, converted to text), which is no copy the worker makes."""
    await steps


def verdict(scores) -> tuple:
    """A sampled verification's outcome, comparable: accepted, bonus token, p's rejected row."""
    found = scores.verdict
    return found.accepted, found.bonus_token, None if found.rejected_row is None else found.rejected_row.tolist()


@pytest.mark.parametrize("transform", [Transform(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("role", ["draft", "verifier"])
def test_copies_to_the_host_per_forward_do_not_grow_with_the_sessions(model_dirs, device, monkeypatch, role,
                                                                     transform):
    """Steps of 1 and of 8 sessions: every forward's tokens reach the host in the same
    number of copies (one or two for all its sessions), not one or more per session. On a
    GPU each such copy is a wait for the device. Counted at torch's tensor-to-host
    conversions."""
    settings = ModelSettings(max_sessions=16, device=device)
    served = Drafter(model_dirs["close"], settings) if role == "draft" else Scorer(model_dirs["target"], settings)
    runner = served.runner
    forwards = []
    inner = runner.scheduler._forward

    def counted_forward(rows):
        forwards.append(len(rows))
        return inner(rows)

    runner.scheduler._forward = counted_forward
    copies = [0]
    for name in ("tolist", "item", "cpu", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, **kwargs):
            copies[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def per_forward(sessions: int) -> float:
        draws = draws_of(sessions)
        forwards.clear()
        copies[0] = 0
        if isinstance(served, Drafter):
            steps = draft_steps(served, sessions, transform)
        else:
            steps = verify_steps(served, sessions, transform, draws)
        asyncio.run(discarded(steps))
        return copies[0] / len(forwards)

    alone, together = per_forward(1), per_forward(8)
    assert together <= alone + 0.5, f"{alone:.1f} copies a forward for 1 session, {together:.1f} for 8"


@pytest.mark.parametrize("role", ["draft", "verifier"])
def test_a_forwards_post_processing_uploads_only_without_a_wait(model_dirs, device, monkeypatch, role):
    """Sampled steps of 8 sessions: every index list and uniform the post-processing sends
    to the device goes through `specd.devices` (from pinned memory, `non_blocking`, on a
    GPU, where a copy from pageable memory waits for the forward to end), a constant number
    of them per forward. Counted at every tensor specd's code makes with a device or moves to
    one, outside `specd.devices`."""
    from draft_service import jobs as draft_jobs
    from specd import devices

    settings = ModelSettings(max_sessions=16, device=device)
    served = Drafter(model_dirs["close"], settings) if role == "draft" else Scorer(model_dirs["target"], settings)
    forwards = [0]
    inner = served.runner.scheduler._forward

    def counted_forward(rows):
        forwards[0] += 1
        return inner(rows)

    served.runner.scheduler._forward = counted_forward
    direct, through = [0], [0]
    make, move, helper = torch.tensor, torch.Tensor.to, devices.to_device

    def ours() -> bool:  # called from specd's code, but for specd.devices (transformers' own moves are the model's)
        caller = sys._getframe(2).f_globals.get("__name__", "")
        return caller != devices.__name__ and caller.split(".")[0] in ("specd", "draft_service", "verifier_service")

    def counted_make(*args, **kwargs):
        direct[0] += kwargs.get("device") is not None and ours()
        return make(*args, **kwargs)

    def counted_move(self, *args, **kwargs):
        direct[0] += ("device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)) and ours()
        return move(self, *args, **kwargs)

    def counted_helper(host, on):
        through[0] += 1
        return helper(host, on)

    draws = draws_of(8)
    monkeypatch.setattr(devices, "to_device", counted_helper)
    monkeypatch.setattr(draft_jobs, "to_device", counted_helper, raising=False)
    monkeypatch.setattr(torch, "tensor", counted_make)
    monkeypatch.setattr(torch.Tensor, "to", counted_move)
    steps = (draft_steps(served, 8, SAMPLED) if isinstance(served, Drafter)
             else verify_steps(served, 8, SAMPLED, draws))
    asyncio.run(discarded(steps))
    assert direct[0] == 0, f"{direct[0]} uploads bypassed specd.devices"
    # The forward's inputs, then a few index lists and uniforms: not one or more a session.
    assert 0 < through[0] <= 6 * forwards[0] < 8 * forwards[0], (through[0], forwards[0])


@pytest.mark.parametrize("role", ["draft", "verifier"])
def test_a_seeded_sampled_step_is_the_same_alone_or_batched(model_dirs, device, role):
    """Session 0's seeded step gives the same tokens (and verdict) alone in its forward as
    beside seven others: sampling them together changes no draw."""
    def run(sessions: int) -> list:
        settings = ModelSettings(max_sessions=16, device=device)
        if role == "draft":
            return asyncio.run(draft_steps(Drafter(model_dirs["close"], settings), sessions, SAMPLED, seed=11))
        scored = asyncio.run(verify_steps(Scorer(model_dirs["target"], settings), sessions, SAMPLED,
                                          draws_of(sessions, seed=11)))
        return [verdict(scores) for scores in scored]

    alone, together = run(1), run(8)
    if role == "draft":
        assert together[0] == alone[0]
    else:  # p's row may round apart: the forward's products differ with the batch's shape
        (accepted, bonus, row), (accepted_alone, bonus_alone, row_alone) = together[0], alone[0]
        assert (accepted, bonus) == (accepted_alone, bonus_alone)
        assert (row is None) == (row_alone is None)
        if row is not None:
            torch.testing.assert_close(torch.tensor(row), torch.tensor(row_alone))
    assert len({str(result) for result in together}) > 1  # the seeds differ, and so do the draws


SOFTMAX = {"_softmax", "softmax"}  # the name it dispatches under depends on whether its input is a view


def recorded_proposals(model_dirs, device, monkeypatch, transform: Transform, ranked: bool,
                       min_confidence: float = 0.0) -> tuple[list, set[str]]:
    """Steps of 3 sessions on a fresh drafter, and the operators that ran in their forwards'
    `ProposeJob.post_process` (recorded with a `TorchDispatchMode`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from draft_service import jobs as draft_jobs

    ran: set[str] = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    inner = draft_jobs.ProposeJob.post_process

    def recorded(logits, members):
        with Recorder():
            inner(logits, members)

    monkeypatch.setattr(draft_jobs.ProposeJob, "post_process", staticmethod(recorded))
    drafter = Drafter(model_dirs["close"], ModelSettings(max_sessions=16, device=device))

    async def run() -> list:
        return list(await asyncio.gather(*(
            drafter.propose(f"s{i}", 0, p, DraftRequest(4, transform, seed=i, min_confidence=min_confidence),
                            ranked=ranked) for i, p in enumerate(prompts(3)))))

    return asyncio.run(run()), ran


def test_an_unranked_greedy_step_finds_only_argmaxes_and_the_same_tokens(model_dirs, device, monkeypatch):
    """Greedy steps of 3 sessions, ranked (what a traced or pre-drafting step asks) and not
    (every other greedy step the draft service serves): the same tokens, and the unranked
    forwards' post-processing runs no softmax or top two, so their proposals carry no q.
    A confidence threshold needs q, so a step with one is ranked whatever it was asked."""
    ranked, ranked_ops = recorded_proposals(model_dirs, device, monkeypatch, Transform(), ranked=True)
    unranked, unranked_ops = recorded_proposals(model_dirs, device, monkeypatch, Transform(), ranked=False)
    assert [p.tokens for p in unranked] == [p.tokens for p in ranked]
    assert all(len(p.tokens) == 4 and len(p.token_probs) == 4 for p in ranked)
    assert all(p.token_probs == () for p in unranked)
    assert "topk" in ranked_ops and ranked_ops & SOFTMAX, ranked_ops
    assert "argmax" in unranked_ops and not unranked_ops & (SOFTMAX | {"topk"}), unranked_ops
    confident, confident_ops = recorded_proposals(model_dirs, device, monkeypatch, Transform(), ranked=False,
                                                  min_confidence=1e-6)
    assert [q for p in confident for q in p.token_probs] == pytest.approx([q for p in ranked for q in p.token_probs],
                                                                          rel=1e-5)
    assert "topk" in confident_ops and confident_ops & SOFTMAX, confident_ops


def test_an_unranked_sampled_step_draws_the_same_tokens_without_the_top_two(model_dirs, device, monkeypatch):
    """Seeded sampled steps of 3 sessions, ranked and not: the same tokens and the same q at
    each (the acceptance test needs them), and the unranked forwards run no top two and no
    largest q, which at a vocabulary of 131,072 cost about as much as the draw."""
    ranked, ranked_ops = recorded_proposals(model_dirs, device, monkeypatch, SAMPLED, ranked=True)
    unranked, unranked_ops = recorded_proposals(model_dirs, device, monkeypatch, SAMPLED, ranked=False)
    assert [p.tokens for p in unranked] == [p.tokens for p in ranked]
    assert [p.token_probs for p in unranked] == [p.token_probs for p in ranked]
    assert all(len(p.tokens) == 4 and len(p.token_probs) == 4 for p in unranked)
    assert all(torch.equal(a.probs, b.probs) for a, b in zip(unranked, ranked))
    assert {"topk", "max"} <= ranked_ops, ranked_ops
    assert "searchsorted" in unranked_ops and not unranked_ops & {"topk", "max"}, unranked_ops
