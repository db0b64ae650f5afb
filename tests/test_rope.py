"""Rotary scalings that rotate by the forward, not the token (specd.worker.rope): a session's
logits must not depend on the sessions that share its forwards.

Tiny real models made in the test (the fixture's tokenizer), the paged store and a worker's
scheduler as serving uses them.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import request, start_stack
from draft_service.drafter import Drafter
from specd.errors import UnsupportedModel
from specd.sampling import Transform
from specd.steps import DraftRequest
from specd.worker import forwards, rope, trials
from specd.worker.attention import use_paged_attention
from specd.worker.batching import Scheduler
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.runtime import ModelRunner
from specd.worker.settings import BatchSettings, ModelSettings
from test_batching import CountedJob
from verifier_service.scorer import Scorer

CPU = torch.device("cpu")
# The tiny Phi-3's original context, longrope's long frequencies past it: longer than the
# load trial's sequences, as a real model's is (a trial across it would refuse the model).
SWITCH = 32
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _model_dir(tmp_path, model_dirs, model_type: str, **config):
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **TINY, **config)).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dirs["target"] / name).read_bytes())
    return tmp_path


def _longrope(tmp_path, model_dirs):
    torch.manual_seed(0)
    return _model_dir(tmp_path, model_dirs, "phi3", pad_token_id=0, original_max_position_embeddings=SWITCH,
                      initializer_range=0.5,  # logits wide enough that rotations change greedy tokens
                      rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8,
                                           long_factor=[4.0] * 8, original_max_position_embeddings=SWITCH))


def _last_logits(model, pool, lengths: list[int]) -> list[torch.Tensor]:
    """Sessions prefilled to `lengths` positions, then one token each in one shared forward:
    each one's logits."""
    sessions = []
    with torch.inference_mode():
        for length in lengths:
            session = SessionKV(pool)
            assert session.reserve(length + 1)
            forwards.forward(model, [BatchRow(session, list(range(1, length + 1)), 1)], CPU)
            session.length = length
            sessions.append(session)
        logits, _ = forwards.forward(model, [BatchRow(session, [7], 1) for session in sessions], CPU)
    return list(logits)


def test_longrope_rotates_a_forward_by_its_last_position_so_only_one_side_shares(tmp_path, model_dirs):
    """Why the worker keeps the two sides apart: a session short of the switch gets other
    logits when a session past it shares its forward, and the same ones beside another
    session on its own side."""
    model = AutoModelForCausalLM.from_pretrained(_longrope(tmp_path, model_dirs)).eval()
    use_paged_attention(model)
    pool = KVPool(*trials.kv_shape(model, CPU), torch.float32, CPU, 4, 64)
    def apart(a: torch.Tensor, b: torch.Tensor) -> float:
        return (a - b).abs().max().item()

    # Beside one short of the switch, the same logits up to the rounding of a wider batch;
    # beside one past it, other rotations.
    short, = _last_logits(model, pool, [5])
    assert apart(_last_logits(model, pool, [9, 5])[1], short) < 1e-5
    assert apart(_last_logits(model, pool, [59, 5])[1], short) > 1e-3
    long, = _last_logits(model, pool, [59])
    assert apart(_last_logits(model, pool, [40, 59])[1], long) < 1e-5
    keys = rope.regime(model)
    assert keys is not None and keys(SWITCH) == keys(5) != keys(SWITCH + 1) == keys(59)


def test_a_worker_shares_forwards_only_between_sessions_on_one_side_of_the_switch(tmp_path, model_dirs):
    """Every forward the scheduler runs, first-come rows or a proposal's forwards that go on
    without the event loop, holds rows of one side only; rows of one side still share."""
    directory, settings = _longrope(tmp_path, model_dirs), ModelSettings(max_sessions=8)
    scorer, drafter = Scorer(directory, settings), Drafter(directory, settings)
    ends: list[list[int]] = []

    def record(runner: ModelRunner) -> None:
        forward = runner.scheduler._forward

        def recording(rows):
            ends.append([row.session.length + len(row.tokens) for row in rows])
            return forward(rows)

        runner.scheduler._forward = recording

    record(scorer.runner)
    record(drafter.runner)

    async def steps() -> None:
        # Plain steps: two sessions short of the switch and one past it, asked together.
        for session, length in (("a", 5), ("b", 7), ("c", 50)):
            await scorer.score(session, 0, list(range(1, length + 1)), [], Transform())
        ends.clear()
        await asyncio.gather(*(scorer.score(session, length, [9], [], Transform())
                               for session, length in (("a", 5), ("b", 7), ("c", 50))))
        assert sorted(ends) == [[6, 8], [51]]
        # Proposals of 4 tokens, one at a time: "d" crosses the switch on its fourth forward,
        # while "e" stays short of it.
        for session, length in (("d", 29), ("e", 3)):
            await drafter.propose(session, 0, list(range(1, length + 1)), DraftRequest(1, Transform()))
        ends.clear()
        await asyncio.gather(drafter.propose("d", 29, [9], DraftRequest(4, Transform())),
                             drafter.propose("e", 3, [9], DraftRequest(4, Transform())))
        assert [30, 4] in ends or [4, 30] in ends  # they shared while both were short of it
        assert [33] in ends  # and "d" went on alone past it
        assert all(len({end > SWITCH for end in forward_ends}) == 1 for forward_ends in ends)

    asyncio.run(steps())


def test_a_dynamic_rotary_scaling_is_refused_at_load(tmp_path, model_dirs):
    """Its frequencies follow the longest sequence the model has seen: one session's output
    would depend on the others'."""
    directory = _model_dir(tmp_path, model_dirs, "llama",
                           rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))
    with pytest.raises(UnsupportedModel, match="rotary scaling is 'dynamic'.*static scaling"):
        ModelRunner(directory, ModelSettings(max_sessions=2))


def test_rotations_by_position_alone_need_no_regime(model_dirs, tmp_path):
    llama = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    assert rope.regime(llama) is None and rope.problem(llama) is None
    gemma3 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3_text", **TINY, head_dim=16))
    assert rope.regime(gemma3) is None and rope.problem(gemma3) is None  # a rotary kind per layer type


class _Session:
    """What the scheduler reads of a session: the positions it holds."""

    def __init__(self, length: int) -> None:
        self.length = length


def test_a_session_of_the_other_regime_is_not_kept_waiting_by_a_stream_of_steps():
    """Two sessions past the switch propose again and again, each step of several forwards
    back at the head of the queue after each forward: a step of a session short of the
    switch still gets a forward of its own soon (a model stand-in that takes 2 ms and
    counts positions as the store does)."""
    ends: list[list[int]] = []

    def forward(rows):
        time.sleep(0.002)
        ends.append([row.session.length + len(row.tokens) for row in rows])
        for row in rows:
            row.session.length += len(row.tokens)
        return torch.zeros(len(rows), 4), [slice(i, i + 1) for i in range(len(rows))]

    async def scenario() -> int:
        scheduler = Scheduler(forward, ThreadPoolExecutor(1), BatchSettings(max_wait_ms=0), lambda: 3,
                              regime=lambda end: end > SWITCH)
        stop = False

        async def proposing(session: _Session, delay: float) -> None:
            await asyncio.sleep(delay)
            while not stop:
                await scheduler.submit(CountedJob(8, session))
                await asyncio.sleep(0.001)  # the gateway's round trip

        streams = [asyncio.create_task(proposing(_Session(100), 0)),
                   asyncio.create_task(proposing(_Session(200), 0.009))]
        await asyncio.sleep(0.02)
        before = len(ends)
        await asyncio.wait_for(scheduler.submit(CountedJob(1, _Session(5))), timeout=5)
        stop = True
        await asyncio.gather(*streams)
        return len(ends) - before

    # At most the steps submitted before it finish first: two of 8 forwards, and its own.
    waited = asyncio.run(scenario())
    assert waited <= 2 * 8 + 2, f"the short session's step waited {waited} forwards"
    assert all(len({end > SWITCH for end in forward_ends}) == 1 for forward_ends in ends)


def _generate_concurrently(stack, prompts: list[str]) -> list[list[int]]:
    futures = [stack.stub.Generate.future(request(prompt, max_new_tokens=16, mode="FIXED", draft_length=4))
               for prompt in prompts]
    return [list(future.result().token_ids) for future in futures]


def test_through_the_services_a_short_request_beside_a_long_one_decodes_as_alone(tmp_path, model_dirs):
    """Greedy, the target as its own draft: a request short of the switch decodes the same
    tokens beside one past it as alone. (That they would not with the regimes turned off is
    shown above at the store's level: whether two requests share a forward through the
    services depends on timing, too loose for a test that must fail.)"""
    directory = _longrope(tmp_path, model_dirs)
    stack = start_stack({"target": directory, "close": directory}, drafts=("close",))
    try:
        long_prompt, short_prompt = "def fibonacci(n): return n " * 6, "x = 1"
        alone = [_generate_concurrently(stack, [prompt])[0] for prompt in (long_prompt, short_prompt)]
        together = [_generate_concurrently(stack, [long_prompt, short_prompt]) for _ in range(3)]
    finally:
        stack.close()
    assert all(pair == alone for pair in together)
