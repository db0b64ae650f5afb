"""The verifier scores a plain greedy step ahead (`specd.worker.runahead`), and answers from
it only the step it assumed: a real ModelRunner on a tiny model made in the test, and a
plain decoding loop in the test as the gateway."""
from __future__ import annotations

import asyncio
import dataclasses
import gc

from specd.sampling import Transform
from specd.worker.runtime import ModelRunner

PROMPT = [5, 6, 7, 8]


async def decode(runner: ModelRunner, session_id: str, steps: int, run_ahead: bool) -> tuple[list[int], list[bool]]:
    """Plain greedy decoding as the gateway drives it: each step sends the token the last
    one committed. The tokens, and whether each answer was scored ahead."""
    scores = await runner.score(session_id, 0, PROMPT, [], Transform(), run_ahead=run_ahead)
    assert scores.argmax is not None
    tokens, ahead = [scores.argmax[0]], [scores.ran_ahead]
    for _ in range(steps - 1):
        start = len(PROMPT) + len(tokens) - 1
        scores = await runner.score(session_id, start, [tokens[-1]], [], Transform(), run_ahead=run_ahead)
        assert scores.argmax is not None
        tokens.append(scores.argmax[0])
        ahead.append(scores.ran_ahead)
    return tokens, ahead


def test_a_step_scored_ahead_is_the_step_asked_for(model_dirs):
    runner = ModelRunner(model_dirs["target"])

    async def scenario():
        with_ahead = await decode(runner, "a", 12, run_ahead=True)
        without = await decode(runner, "b", 12, run_ahead=False)
        await runner.close()
        return with_ahead, without

    (tokens, ahead), (reference, none_ahead) = asyncio.run(scenario())
    assert tokens == reference and not any(none_ahead)
    # Every answer but the first was scored ahead, except after EOS (where the gateway stops).
    eos = runner.info.eos_token_ids
    assert ahead == [False] + [token not in eos for token in tokens[:-1]] and sum(ahead) >= 8
    assert runner.run_ahead.answered == sum(ahead) and runner.run_ahead.dropped == 0


def test_a_sampled_step_scored_ahead_draws_the_same_token(model_dirs):
    """Sampled: each step carries the next one's uniform, and the answer scored ahead is the
    token that uniform draws from p, as when the step is scored on request."""
    from specd.rejection import Draws

    runner = ModelRunner(model_dirs["target"])
    transform = Transform(temperature=1.0)
    uniforms = [0.13, 0.92, 0.48, 0.71, 0.05, 0.66, 0.37, 0.84]

    async def sampled(session_id: str, run_ahead: bool) -> tuple[list[int], list[bool]]:
        tokens: list[int] = []
        ahead: list[bool] = []
        for i, u in enumerate(uniforms):
            start, new = (0, PROMPT) if i == 0 else (len(PROMPT) + i - 1, [tokens[-1]])
            following = Draws((), uniforms[i + 1]) if run_ahead and i + 1 < len(uniforms) else None
            scores = await runner.score(session_id, start, new, [], transform, (), Draws((), u),
                                        run_ahead=following is not None, next_draws=following)
            assert scores.verdict is not None and scores.verdict.bonus_token is not None
            tokens.append(scores.verdict.bonus_token)
            ahead.append(scores.ran_ahead)
        return tokens, ahead

    async def scenario():
        with_ahead = await sampled("a", True)
        without = await sampled("b", False)
        await runner.close()
        return with_ahead, without

    (tokens, ahead), (reference, _) = asyncio.run(scenario())
    eos = runner.info.eos_token_ids
    assert tokens == reference
    assert ahead == [False] + [token not in eos for token in tokens[:-1]] and sum(ahead) >= 5


def test_a_step_other_than_the_one_assumed_is_scored_as_asked(model_dirs):
    """The gateway committed something else (a stop string cut, another proposal): the
    verifier waits for its ahead forward, crops it away and scores what was asked."""
    runner = ModelRunner(model_dirs["target"])

    async def scenario():
        first = await runner.score("a", 0, PROMPT, [], Transform(), run_ahead=True)
        other = (first.argmax[0] + 1) % runner.info.vocab_size
        asked = await runner.score("a", len(PROMPT), [other], [9, 10], Transform())
        fresh = await runner.score("b", 0, [*PROMPT, other], [9, 10], Transform())
        await runner.close()
        return asked, fresh

    asked, fresh = asyncio.run(scenario())
    assert asked.argmax == fresh.argmax and not asked.ran_ahead
    assert (runner.run_ahead.answered, runner.run_ahead.dropped) == (0, 1)


def test_a_session_ended_while_its_step_runs_ahead_leaves_nothing(model_dirs):
    runner = ModelRunner(model_dirs["target"])

    async def scenario() -> tuple[int, int, int, int]:
        free = runner.pool.free_blocks
        await runner.score("a", 0, PROMPT, [], Transform(), run_ahead=True)
        held = len(runner.run_ahead)
        runner.end_session("a")
        await asyncio.sleep(0.2)  # the cancelled ahead step leaves the batch
        gc.collect()  # a session's blocks go back when it is dropped
        left = (len(runner.run_ahead), len(runner.sessions), free - runner.pool.free_blocks)
        await runner.close()
        return held, *left

    assert asyncio.run(scenario()) == (1, 0, 0, 0)


def test_no_step_is_scored_past_eos(model_dirs):
    """An argmax that is EOS ends the request at the gateway: nothing to score ahead."""
    runner = ModelRunner(model_dirs["target"])

    async def scenario() -> int:
        first = await runner.score("probe", 0, PROMPT, [], Transform())
        runner.info = dataclasses.replace(runner.info, eos_token_ids=(first.argmax[0],))
        await runner.score("a", 0, PROMPT, [], Transform(), run_ahead=True)
        held = len(runner.run_ahead)
        await runner.close()
        return held

    assert asyncio.run(scenario()) == 0


def test_a_session_ended_while_a_step_waits_for_its_ahead_step_leaves_nothing(model_dirs):
    """The client went away just as its next step arrived: the step waiting for the ahead
    one is cancelled and the session ended. The ahead step must not put it back after."""
    runner = ModelRunner(model_dirs["target"])

    async def scenario() -> tuple[int, int, int]:
        free = runner.pool.free_blocks
        first = await runner.score("a", 0, PROMPT, [], Transform(), run_ahead=True)
        assert first.argmax is not None
        waiting = asyncio.ensure_future(runner.score("a", len(PROMPT), [first.argmax[0]], [], Transform()))
        await asyncio.sleep(0)  # it is waiting for the ahead step now
        waiting.cancel()
        runner.end_session("a")
        await asyncio.wait([waiting])
        del waiting  # its traceback holds the frames that held the session
        await asyncio.sleep(0.2)
        gc.collect()
        left = (len(runner.sessions), free - runner.pool.free_blocks, runner.run_ahead.dropped)
        await runner.close()
        return left

    assert asyncio.run(scenario()) == (0, 0, 1)  # and the ahead step is counted once


def test_an_ahead_step_with_no_room_evicts_nothing_and_keeps_the_session(model_dirs):
    """A pool of three blocks of 16 positions, all held: the ahead step that needs a fourth
    is a bet, so it evicts no other session and gives its own back; the step asked for then
    takes the room it needs, as any step does."""
    from specd.worker.settings import BatchSettings

    runner = ModelRunner(model_dirs["target"], batching=BatchSettings(kv_cache_tokens=48))

    async def scenario() -> tuple[bool, set[str], bool]:
        await runner.score("b", 0, list(range(5, 36)), [], Transform())  # 31 positions: two blocks
        first = await runner.score("a", 0, list(range(5, 20)), [], Transform(), run_ahead=True)  # the third
        assert first.argmax is not None
        second = await runner.score("a", 15, [first.argmax[0]], [], Transform(), run_ahead=True)
        assert second.argmax is not None
        await asyncio.sleep(0.1)  # the next ahead step needs a fourth block: none is free
        held = set(runner.sessions._sessions)
        assert len(runner.run_ahead) == 0 and runner.run_ahead.dropped == 1  # the failed bet left the table
        third = await runner.score("a", 16, [second.argmax[0]], [], Transform())
        await runner.close()
        return second.ran_ahead, held, third.ran_ahead

    assert asyncio.run(scenario()) == (True, {"a", "b"}, False)


def test_plain_requests_through_the_services_are_answered_ahead(model_dirs, target_model, tokenizer):
    """Mode OFF through real gRPC services: the gateway asks each plain step to run ahead,
    the verifier answers from its ahead steps (its /metrics counts them), and the output is
    the target decoding alone."""
    import urllib.request

    from conftest import request, start_stack
    from test_cli import free_port
    from test_pipeline import reference_greedy

    port = free_port()
    running = start_stack(model_dirs, verifier_metrics_port=port)
    try:
        response = running.stub.Generate(request("def fibonacci(n):", max_new_tokens=24, mode="OFF"))
        assert list(response.token_ids) == reference_greedy(target_model, tokenizer, "def fibonacci(n):", 24)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        answered = sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                       if line.startswith("specd_worker_run_ahead_steps_total{") and 'outcome="answered"' in line)
        assert answered >= response.stats.steps - 2  # all but the first step, and EOS aside
    finally:
        running.close()
