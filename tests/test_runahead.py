"""The verifier goes on decoding plainly after a plain step that asks it to
(`verifier_service.runahead`), answers those steps unasked, and stops for any other step: a
real Scorer on a tiny model made in the test, with the test as the gateway."""
from __future__ import annotations

import asyncio
import dataclasses
import gc

from specd.rejection import Draws
from specd.sampling import Transform
from specd.steps import Scores
from verifier_service.scorer import Scorer

PROMPT = [5, 6, 7, 8]


class Answers:
    """What a run answered, by index (None: it stopped before that step)."""

    def __init__(self) -> None:
        self.by_index: dict[int, Scores | None] = {}
        self.came = asyncio.Event()

    def __call__(self, index: int, scores: Scores | None) -> None:
        assert index not in self.by_index, "each reserved step is answered once"
        self.by_index[index] = scores
        self.came.set()

    async def wait_for(self, count: int) -> None:
        while len(self.by_index) < count:
            self.came.clear()
            await asyncio.wait_for(self.came.wait(), 10)


async def asked_one_by_one(scorer: Scorer, session_id: str, steps: int) -> list[int]:
    """Plain greedy decoding with every step asked: the reference."""
    tokens: list[int] = []
    for i in range(steps):
        start, new = (0, PROMPT) if i == 0 else (len(PROMPT) + i - 1, [tokens[-1]])
        scores = await scorer.score(session_id, start, new, [], Transform())
        tokens.append(scores.plain_token())
    return tokens


def test_a_run_answers_each_plain_step_as_the_step_asked_would_be(model_dirs):
    scorer = Scorer(model_dirs["target"])
    # The tiny model draws its EOS early; without one the run goes its whole length.
    scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=())
    answers = Answers()

    async def scenario():
        first = await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=11, answer_ahead=answers)
        await answers.wait_for(11)
        await asyncio.sleep(0.1)  # the run's end has put the session back
        left = (len(scorer.run_ahead), scorer.runner.sessions.in_use, scorer.runner.sessions.holds("a"))
        reference = await asked_one_by_one(scorer, "b", 12)
        await scorer.runner.close()
        return first, reference, left

    first, reference, left = asyncio.run(scenario())
    ran = [first.plain_token()] + [answers.by_index[i].plain_token() for i in range(1, 12)]
    assert ran == reference and len(set(reference)) > 2
    assert all(answers.by_index[i].ran_ahead for i in range(1, 12)) and not first.ran_ahead
    assert scorer.run_ahead.answered == 11 and scorer.run_ahead.dropped == 0
    assert left == (0, 0, True)  # the run ended and put the session back


def test_a_run_stops_at_eos(model_dirs):
    """The gateway ends a request at EOS: a run answers the EOS step and scores nothing after it."""
    scorer = Scorer(model_dirs["target"])
    answers = Answers()

    async def scenario():
        scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=())
        reference = await asked_one_by_one(scorer, "b", 6)
        scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=(reference[3],))
        await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=5, answer_ahead=answers)
        await answers.wait_for(1)
        await asyncio.sleep(0.3)  # the run reached EOS, and stopped there
        await scorer.runner.close()
        return reference

    reference = asyncio.run(scenario())
    eos_at = reference.index(reference[3])  # its first appearance
    assert eos_at >= 1 and sorted(answers.by_index) == list(range(1, eos_at + 1))
    assert answers.by_index[eos_at].plain_token() == reference[3] and scorer.run_ahead.dropped == 0


def test_a_sampled_run_draws_each_token_with_the_uniform_sent_for_its_step(model_dirs):
    """Sampled: a step carries the uniforms of the steps ahead, one each, and each answer
    scored ahead is the token its uniform draws from p, as when the step is asked with it."""
    scorer = Scorer(model_dirs["target"])
    scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=())
    transform = Transform(temperature=1.0)
    uniforms = [0.13, 0.92, 0.48, 0.71, 0.05, 0.66, 0.37, 0.84]
    answers = Answers()

    async def scenario():
        first = await scorer.score("a", 0, PROMPT, [], transform, (), Draws((), uniforms[0]),
                                   run_ahead=len(uniforms) - 1, ahead_draws=[Draws((), u) for u in uniforms[1:]],
                                   answer_ahead=answers)
        await answers.wait_for(len(uniforms) - 1)
        asked: list[int] = []
        for i, u in enumerate(uniforms):
            start, new = (0, PROMPT) if i == 0 else (len(PROMPT) + i - 1, [asked[-1]])
            asked.append((await scorer.score("b", start, new, [], transform, (), Draws((), u))).plain_token())
        await scorer.runner.close()
        return first, asked

    first, asked = asyncio.run(scenario())
    ahead = [first.plain_token()] + [answers.by_index[i].plain_token() for i in range(1, len(uniforms))]
    assert ahead == asked and len(set(asked)) > 2  # the uniforms matter


def test_another_step_stops_the_run_and_is_scored_as_asked(model_dirs):
    """The gateway committed something else (a stop string cut, a proposal): the run stops
    after its forward in flight, and the step is scored from the committed tokens."""
    scorer = Scorer(model_dirs["target"])
    answers = Answers()

    async def scenario():
        first = await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=200, answer_ahead=answers)
        other = (first.plain_token() + 1) % scorer.runner.info.vocab_size
        asked = await scorer.score("a", len(PROMPT), [other], [9, 10], Transform())
        fresh = await scorer.score("b", 0, [*PROMPT, other], [9, 10], Transform())
        await scorer.runner.close()
        return asked, fresh

    asked, fresh = asyncio.run(scenario())
    assert asked.argmax == fresh.argmax and not asked.ran_ahead
    assert len(answers.by_index) < 200 and scorer.run_ahead.dropped == 1
    assert None not in answers.by_index.values()  # stopped by the gateway's step: nothing to tell it


def test_a_session_ended_during_its_run_leaves_nothing(model_dirs):
    scorer = Scorer(model_dirs["target"])

    async def scenario() -> tuple[int, int, int, int]:
        free = scorer.runner.pool.free_blocks
        await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=200, answer_ahead=Answers())
        held = len(scorer.run_ahead)
        scorer.runner.end_session("a")
        await asyncio.sleep(0.2)  # the forward in flight finishes and is thrown away
        gc.collect()  # a session's blocks go back when it is dropped
        left = (len(scorer.run_ahead), len(scorer.runner.sessions), free - scorer.runner.pool.free_blocks)
        await scorer.runner.close()
        return held, *left

    assert asyncio.run(scenario()) == (1, 0, 0, 0)


def test_no_step_is_scored_past_eos(model_dirs):
    """An answer that is EOS ends the request at the gateway: no run starts after it."""
    scorer = Scorer(model_dirs["target"])
    answers = Answers()

    async def scenario() -> int:
        first = await scorer.score("probe", 0, PROMPT, [], Transform())
        scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=(first.plain_token(),))
        await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=5, answer_ahead=answers)
        held = len(scorer.run_ahead)
        await scorer.runner.close()
        return held

    assert asyncio.run(scenario()) == 0 and answers.by_index == {}


def test_a_session_ended_while_a_step_waits_for_its_run_to_stop_leaves_nothing(model_dirs):
    """The client went away just as its next step arrived: the step waiting for the run to
    stop is cancelled and the session ended. The run must not put it back after."""
    scorer = Scorer(model_dirs["target"])

    async def scenario() -> tuple[int, int, int]:
        free = scorer.runner.pool.free_blocks
        first = await scorer.score("a", 0, PROMPT, [], Transform(), run_ahead=200, answer_ahead=Answers())
        waiting = asyncio.ensure_future(scorer.score("a", len(PROMPT), [first.plain_token()], [1, 2], Transform()))
        await asyncio.sleep(0)  # it is waiting for the run to stop now
        waiting.cancel()
        scorer.runner.end_session("a")
        await asyncio.wait([waiting])
        del waiting  # its traceback holds the frames that held the session
        await asyncio.sleep(0.2)
        gc.collect()
        left = (len(scorer.runner.sessions), free - scorer.runner.pool.free_blocks, scorer.run_ahead.dropped)
        await scorer.runner.close()
        return left

    assert asyncio.run(scenario()) == (0, 0, 1)  # and the run is counted once


def test_a_run_without_room_evicts_nothing_and_tells_the_gateway(model_dirs):
    """A pool of three blocks of 16 positions, all held: the run, a bet, evicts no other
    session; it answers its next step None (the gateway then asks it), and that step takes
    the room it needs, as any asked step does."""
    from specd.worker.settings import BatchSettings, ModelSettings

    scorer = Scorer(model_dirs["target"], ModelSettings(batching=BatchSettings(kv_cache_tokens=48)))
    answers = Answers()

    async def scenario() -> tuple[set[str], Scores | None, int, bool]:
        await scorer.score("b", 0, list(range(5, 36)), [], Transform())  # 31 positions: two blocks
        first = await scorer.score("a", 0, list(range(5, 20)), [], Transform(), run_ahead=5,
                                   answer_ahead=answers)  # 15 positions, the third block; the run needs a fourth
        await answers.wait_for(2)
        held = set(scorer.runner.sessions._sessions)
        asked = await scorer.score("a", 16, [answers.by_index[1].plain_token()], [], Transform())
        await scorer.runner.close()
        return held, answers.by_index[2], first.plain_token(), asked.ran_ahead

    held, second, _, ran_ahead = asyncio.run(scenario())
    assert held == {"a", "b"} and second is None and not ran_ahead
    assert answers.by_index[1] is not None and scorer.run_ahead.dropped == 1  # cut short


def test_plain_requests_through_the_services_are_answered_ahead(model_dirs, target_model, tokenizer):
    """Mode OFF through real gRPC services: the gateway lets each plain step run ahead, the
    verifier answers the steps after it unasked (its /metrics counts them), and the output
    is the target decoding alone."""
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


def test_runs_the_verifier_refuses_leave_the_gateway_asking_each_step(model_dirs, target_model, tokenizer):
    """A verifier whose queue is too short for bets (`max_queue` 1: half of it is none)
    answers every reserved step ABORTED at once; the gateway asks each step itself, and
    the output is still the target decoding alone."""
    from conftest import request, start_stack
    from specd.worker.settings import BatchSettings
    from test_pipeline import reference_greedy

    running = start_stack(model_dirs, batching=BatchSettings(max_queue=1))
    try:
        response = running.stub.Generate(request("def f(x):", max_new_tokens=24, mode="OFF"))
        assert list(response.token_ids) == reference_greedy(target_model, tokenizer, "def f(x):", 24)
        scorer = running.verifier.servicer.scorer
        assert scorer.run_ahead.answered == 0 and scorer.run_ahead.dropped >= response.stats.steps - 2
    finally:
        running.close()
