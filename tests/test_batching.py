"""Batching across sessions: exactness whatever shares the batch, backpressure, no leaks.

Real servers on loopback, tiny real models (tests/conftest.py). Requests run from
several client threads at once, so the workers' forwards are shared; each test checks
from the responses' stats that they were. Every test that runs a model runs on each device
of the `device` fixture: this CPU, and CUDA where there is one, in float32.
"""
from __future__ import annotations

import asyncio
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import request, start_stack
from draft_service.drafter import Drafter
from specd.sampling import Transform
from specd.steps import DraftRequest, PreDraftRequest
from specd.v1 import gateway_pb2
from specd.worker import attention, lean
from specd.worker.attention import use_paged_attention
from specd.worker.batching import Job, Scheduler
from specd.worker.forwards import forward
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.settings import BatchSettings, ModelSettings
from test_cli import free_port
from test_pipeline import reference_greedy
from verifier_service.scorer import Scorer

PROMPTS = ["def fibonacci(n):", "The acceptance rate is", "class Cache:", "Speculative decoding lets",
           "    a, b = 0, 1", "the target model verifies", "def __init__(self, size):", "When it is high,"]


def in_flight(stub, requests: list[gateway_pb2.GenerateRequest]) -> list[gateway_pb2.GenerateResponse]:
    """Send every request at once, one client thread each; responses in request order."""
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(stub.Generate, requests))


@pytest.mark.parametrize("mode,draft_model", [("FIXED", "close"), ("FIXED", "unrelated"), ("OFF", ""),
                                              ("AUTO", "close")])
def test_greedy_with_eight_in_flight_equals_generate(device_stack, device_target, tokenizer, mode, draft_model):
    reqs = [request(p, max_new_tokens=32, mode=mode, draft_model=draft_model) for p in PROMPTS]
    responses = in_flight(device_stack.stub, reqs)
    for prompt, response in zip(PROMPTS, responses):
        assert list(response.token_ids) == reference_greedy(device_target, tokenizer, prompt, 32), prompt
    # The point of the test: the verifier's forwards were shared.
    assert max(r.stats.mean_verify_batch_size for r in responses) > 1.5


def test_greedy_in_flight_equals_each_request_alone(device_stack):
    reqs = [request(p, max_new_tokens=24, draft_model="close", draft_length=3) for p in PROMPTS]
    alone = [list(device_stack.stub.Generate(r).token_ids) for r in reqs]
    together = in_flight(device_stack.stub, reqs)
    assert [list(r.token_ids) for r in together] == alone


@pytest.mark.parametrize("mode", ["FIXED", "OFF"])
def test_seed_reproduces_whatever_shares_the_batch(device_stack, mode):
    # The unrelated draft: nearly every proposal is rejected, so the seeded request takes
    # about one step per token and is still running while the others join its batches.
    seeded = request(PROMPTS[0], temperature=1.0, top_k=40, seed=1234, max_new_tokens=24, mode=mode,
                     draft_model="unrelated" if mode == "FIXED" else "")
    alone = list(device_stack.stub.Generate(seeded).token_ids)
    # The same request among seven others with other seeds and prompts, twice.
    others = [request(p, temperature=0.8, seed=i + 1, max_new_tokens=24, draft_model="unrelated")
              for i, p in enumerate(PROMPTS[1:])]
    shared = []
    for _ in range(2):
        responses = in_flight(device_stack.stub, [seeded, *others])
        assert list(responses[0].token_ids) == alone
        shared.append(responses[0].stats.mean_verify_batch_size)
    assert max(shared) > 1.0, "the seeded request never shared a forward: the test proved nothing"


def test_long_prompt_is_prefilled_in_chunks_and_stays_exact(model_dirs, device, device_target, tokenizer):
    running = start_stack(model_dirs, batching=BatchSettings(prefill_chunk=8, max_batch_tokens=24), device=device,
                          dtype="float32")
    try:
        long_prompt = " ".join(PROMPTS) * 2
        reqs = [request(long_prompt, max_new_tokens=16, draft_model="close")] + [
            request(p, max_new_tokens=16, draft_model="close") for p in PROMPTS[:3]]
        responses = in_flight(running.stub, reqs)
        for prompt, response in zip([long_prompt, *PROMPTS[:3]], responses):
            assert list(response.token_ids) == reference_greedy(device_target, tokenizer, prompt, 16)
        # No forward held more than max_batch_tokens, however long the prompt.
        assert max(r.stats.mean_verify_batch_tokens for r in responses) <= 24
    finally:
        running.close()


def worker_sessions(port: int) -> float:
    """specd_worker_sessions summed over the models of the worker serving /metrics on port."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith("specd_worker_sessions{"))


def sessions_left(port: int, timeout_s: float = 5.0) -> float:
    """The worker's sessions once they drain, or after timeout_s: a request's sessions end
    when the gateway names them in its next stream message, just after the response."""
    for _ in range(int(timeout_s / 0.05)):
        if worker_sessions(port) == 0:
            break
        time.sleep(0.05)
    return worker_sessions(port)


def test_full_verifier_queue_is_resource_exhausted_and_frees_everything(model_dirs, device):
    metrics_port = free_port()
    running = start_stack(model_dirs, batching=BatchSettings(max_queue=1), verifier_metrics_port=metrics_port,
                          device=device, dtype="float32")
    try:
        reqs = [request(p, max_new_tokens=24, mode="OFF") for p in PROMPTS * 2]

        def outcome(req):
            try:
                return running.stub.Generate(req)
            except grpc.RpcError as exc:
                return exc

        with ThreadPoolExecutor(len(reqs)) as pool:
            outcomes = list(pool.map(outcome, reqs))
        refused = [o for o in outcomes if isinstance(o, grpc.RpcError)]
        assert refused, "16 requests against a queue of 1 should overflow it"
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry in about" in exc.details()
        # The service keeps serving, and nothing is left behind.
        assert len(running.stub.Generate(request(PROMPTS[0], max_new_tokens=8, mode="OFF")).token_ids) == 8
        assert sessions_left(metrics_port) == 0
    finally:
        running.close()


def test_cancelled_requests_leave_the_batch_and_free_their_sessions(model_dirs, device):
    metrics_port = free_port()
    running = start_stack(model_dirs, verifier_metrics_port=metrics_port, device=device, dtype="float32")
    try:
        streams = [running.stub.GenerateStream(request(p, max_new_tokens=200, draft_model="close"))
                   for p in PROMPTS]
        for stream in streams:
            next(stream)  # each request is in the batch
        for stream in streams:
            stream.cancel()
        # The gateway ends the worker sessions of a cancelled request at once.
        assert sessions_left(metrics_port) == 0
        assert len(running.stub.Generate(request(PROMPTS[0], max_new_tokens=8)).token_ids) == 8
    finally:
        running.close()


# -- the KV store --------------------------------------------------------------------------

def _pool(model, blocks: int = 64, block_tokens: int = 8) -> KVPool:
    """A pool for `model`, on its device."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, head_dim, torch.float32,
                  model.device, block_tokens, blocks)


def _model(path, device: str):
    """The model at `path` on `device`, in float32, set up for the paged KV store."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    use_paged_attention(model)
    return model


def _ids(tokens: list[int], device) -> torch.Tensor:
    return torch.tensor([tokens], device=device)


def _per_row(result: tuple[torch.Tensor, list[slice]]) -> list[torch.Tensor]:
    logits, kept = result
    return [logits[rows_kept] for rows_kept in kept]


@pytest.mark.parametrize("sdpa", ["torch", "grouped"])
def test_batched_forward_equals_each_session_alone(model_dirs, device, sdpa, monkeypatch):
    """Rows of different lengths and histories, rolled back and fed again, each get the
    logits the model gives their whole sequence alone: with torch's grouped-query SDPA (a
    CPU's) and with the query heads folded into rows (CUDA's, `attention.grouped_sdpa`)."""
    if sdpa == "grouped":
        monkeypatch.setattr(attention, "_sdpa", attention.grouped_sdpa)
    torch.manual_seed(0)
    model = _model(model_dirs["target"], device)
    cfg, on = model.config, model.device
    pool = _pool(model)
    sessions = [SessionKV(pool) for _ in range(3)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (3, 21, 9)]
    steps = [[1, 2], [3], [4, 5, 6, 7]]
    with torch.inference_mode():
        for s, p, e in zip(sessions, prompts, steps):
            assert s.reserve(len(p) + len(e))
        logits = _per_row(forward(model, [BatchRow(s, p, 2) for s, p in zip(sessions, prompts)], on))
        for got, p in zip(logits, prompts):
            torch.testing.assert_close(got, model(input_ids=_ids(p, on)).logits[0, -2:])
        # Roll back the last prompt token of each session (a rejected draft token), go on.
        for s, p in zip(sessions, prompts):
            s.crop(len(p) - 1)
        logits = _per_row(forward(model, [BatchRow(s, e, len(e)) for s, e in zip(sessions, steps)], on))
        for got, p, e in zip(logits, prompts, steps):
            torch.testing.assert_close(got, model(input_ids=_ids(p[:-1] + e, on)).logits[0, -len(e):])
        # Every row feeding one token (the decoding step's layout, with no query padding).
        logits = _per_row(forward(model, [BatchRow(s, [9], 1) for s in sessions], on))
        for got, p, e in zip(logits, prompts, steps):
            torch.testing.assert_close(got, model(input_ids=_ids(p[:-1] + e + [9], on)).logits[0, -1:])


def test_a_session_gives_its_blocks_back_and_a_fork_shares_its_cache_copy_on_write(model_dirs, device):
    model = _model(model_dirs["target"], device)
    on = model.device
    pool = _pool(model, blocks=6, block_tokens=4)  # 5 usable blocks: 20 positions
    session = SessionKV(pool)
    assert session.reserve(9) and pool.free_blocks == 2
    assert not SessionKV(pool).reserve(13)  # more than is left
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    session.tokens = list(prompt)
    with torch.inference_mode():
        forward(model, [BatchRow(session, prompt, 1)], on)
        free, pool_before = pool.free_blocks, (pool.keys.clone(), pool.values.clone())
        fork = session.fork(6, 8)
        assert fork is not None and fork.tokens == prompt[:6] and fork.length == 6
        # Copy on write: both blocks are shared, and the fork (made on the event loop) copies
        # nothing; it holds one spare block for the partial block's copy.
        assert fork.blocks == session.blocks[:2] and len(fork.spare) == 1
        assert torch.equal(pool.keys, pool_before[0]) and torch.equal(pool.values, pool_before[1])
        assert pool.free_blocks == free - 1
        expected = model(input_ids=_ids(prompt[:6] + [3], on)).logits[0, -1:]
        got = _per_row(forward(model, [BatchRow(fork, [3], 1)], on))[0]
        torch.testing.assert_close(got, expected)
        # Its first forward (the model's thread) copied the partial block into the spare.
        assert fork.blocks[0] == session.blocks[0] and fork.blocks[1] != session.blocks[1] and not fork.spare
        assert pool.free_blocks == free - 1
        # The source rolls back into the shared block and writes there: it takes a copy
        # first, and the fork still reads what it shared.
        session.crop(2)
        forward(model, [BatchRow(session, [4, 4], 1)], on)
        assert session.blocks[0] != fork.blocks[0]
        fork.crop(6)
        torch.testing.assert_close(_per_row(forward(model, [BatchRow(fork, [3], 1)], on))[0], expected)
    del session, fork
    assert pool.free_blocks == 5


def test_a_lone_session_reads_the_same_whether_its_blocks_are_consecutive_or_not(model_dirs, device):
    """One row reads consecutive blocks as a view of the pool, scattered ones by a gather."""
    model = _model(model_dirs["target"], device)
    on = model.device
    pool = _pool(model, blocks=12, block_tokens=4)
    consecutive, first, second = SessionKV(pool), SessionKV(pool), SessionKV(pool)
    assert consecutive.reserve(12)
    for needed in (4, 8, 12):  # interleave two sessions block by block
        assert first.reserve(needed) and second.reserve(needed)
    assert consecutive.blocks == [1, 2, 3] and first.blocks == [4, 6, 8]
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    alone = model(input_ids=_ids(prompt, on)).logits[0]
    with torch.inference_mode():
        for session in (consecutive, first):
            torch.testing.assert_close(_per_row(forward(model, [BatchRow(session, prompt[:7], 1)], on))[0],
                                       alone[6:7])
            torch.testing.assert_close(_per_row(forward(model, [BatchRow(session, prompt[7:], 3)], on))[0],
                                       alone[7:])


@pytest.mark.parametrize("lean_forward", [False, True])
def test_operator_calls_per_forward_do_not_grow_with_sessions(model_dirs, device, lean_forward):
    """A forward of 32 sessions runs as many operators as one of a single session: no
    Python loop over sessions inside a layer (counted with the torch profiler), in
    transformers' forward and in the lean one (specd.worker.lean)."""
    model = _model(model_dirs["target"], device)
    on = model.device
    pool = _pool(model, blocks=400)
    if lean_forward:
        assert lean.install(model, pool, model.config.vocab_size, on) is None

    def operators(sessions: int, feed: int) -> int:
        rows = []
        for i in range(sessions):
            session = SessionKV(pool)
            assert session.reserve(40)
            with torch.inference_mode():
                forward(model, [BatchRow(session, list(range(1, 12 + i % 5)), 1)], on)
            rows.append(BatchRow(session, [7] * feed, feed))
        forward(model, rows, on)  # once first: the pool's gather buffers grow to this batch
        for row in rows:
            row.session.crop(row.session.length - feed)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            forward(model, rows, on)
        return sum(event.count for event in prof.key_averages())

    for feed in (1, 3):
        # (One session feeding one token needs no mask: fewer calls. Two is the general case.)
        assert operators(2, feed) == operators(32, feed), feed


def test_a_forward_sends_its_indices_to_the_device_in_one_copy(model_dirs, device, monkeypatch):
    """Token ids, positions, write slots, block tables, kept rows, the rows' starts and ends:
    one host-to-device copy for all of them, however many sessions share the forward, and
    the mask built on the device from them. On a GPU each copy from pageable memory waits
    for the device; counted here at every tensor made with a device or moved to one."""
    from specd.worker import layout

    model = _model(model_dirs["target"], device)
    pool = _pool(model, blocks=400)
    copies = [0]
    make, move = torch.tensor, torch.Tensor.to

    def counted_make(*args, **kwargs):
        copies[0] += kwargs.get("device") is not None
        return make(*args, **kwargs)

    def counted_move(self, *args, **kwargs):
        copies[0] += 1
        return move(self, *args, **kwargs)

    def uploads(sessions: int, feed: int) -> int:
        rows = []
        for i in range(sessions):
            session = SessionKV(pool)
            assert session.reserve(40)
            session.length = 12 + i % 5  # as if its prompt were cached
            rows.append(BatchRow(session, [7] * (feed + i % 2), feed))
        copies[0] = 0
        with monkeypatch.context() as patch:
            patch.setattr(layout.torch, "tensor", counted_make)
            patch.setattr(torch.Tensor, "to", counted_move)
            layout.prepare(rows, model.device)
        return copies[0]

    assert uploads(1, 1) == uploads(8, 1) == uploads(8, 4) == 1


def test_kv_memory_is_the_arithmetic(model_dirs, device):
    """64 sessions of 512 tokens hold what layers × 2 × KV heads × head dim × tokens × bytes says."""
    scorer = Scorer(model_dirs["target"], ModelSettings(max_sessions=64, device=device,
                                                        batching=BatchSettings(kv_cache_tokens=64 * 544)))

    async def fill() -> None:
        for i in range(64):
            await scorer.score(f"s{i}", 0, [5] * 511, [], Transform())
        await scorer.runner.close()

    asyncio.run(fill())
    arithmetic = 64 * 512 * scorer.runner.kv_bytes_per_token()
    assert len(scorer.runner.sessions) == 64
    assert arithmetic <= scorer.runner.sessions.kv_bytes() <= 1.1 * arithmetic


def test_a_step_reports_the_sessions_its_worker_holds(model_dirs, device):
    """The load the gateway's cap is chosen for: sessions held, not just those in the forward."""
    scorer = Scorer(model_dirs["target"], ModelSettings(max_sessions=8, device=device))

    async def steps() -> list[int]:
        held = []
        for i in range(3):
            scores = await scorer.score(f"s{i}", 0, [5, 6, 7], [], Transform())
            held.append(scores.batch.sessions)
        await scorer.runner.close()
        return held

    # Each step runs alone, and each finds one more session open than the last.
    assert asyncio.run(steps()) == [1, 2, 3]


class CountingExecutor(ThreadPoolExecutor):
    """The model's thread, counting the work handed to it from the event loop."""

    def __init__(self) -> None:
        super().__init__(1)
        self.handed = 0

    def submit(self, fn, /, *args, **kwargs):
        self.handed += 1
        return super().submit(fn, *args, **kwargs)


def test_a_proposal_runs_its_forwards_in_one_hand_off_and_a_step_arriving_meanwhile_joins(model_dirs, device):
    """A lone γ = 8 proposal takes 8 forwards and one trip to the model's thread; a step
    that arrives while a long proposal is under way still shares its next forward."""
    drafter = Drafter(model_dirs["close"], ModelSettings(device=device))
    counting = CountingExecutor()
    drafter.runner.scheduler._executor = counting

    async def scenario():
        alone = await drafter.propose("a", 0, [5, 6, 7], DraftRequest(8, Transform()))
        handed_alone = counting.handed
        long = asyncio.ensure_future(drafter.propose("b", 0, [5, 6, 7], DraftRequest(32, Transform())))
        while not drafter.runner.scheduler.busy:  # the long proposal's forwards are under way
            await asyncio.sleep(0)
        late = await drafter.propose("c", 0, [8, 9], DraftRequest(2, Transform()))
        await long
        await drafter.runner.close()
        return alone, handed_alone, late, long.result()

    alone, handed_alone, late, long = asyncio.run(scenario())
    assert alone.batch.forwards == 8 and len(alone.tokens) == 8
    assert handed_alone == 1
    assert late.batch.size == 2, "the late step waited for the long proposal instead of joining it"
    assert len(long.tokens) == 32 and long.batch.forwards == 32

def test_bad_batch_settings_are_named():
    assert "kv_cache_tokens must be >= 0" in " ".join(BatchSettings(kv_cache_tokens=-1).problems())
    assert "prefill_chunk must be >= 1" in BatchSettings(prefill_chunk=0).problems()


def test_an_evicted_session_takes_its_pre_drafted_branches_with_it(model_dirs, device):
    """Pre-drafted branches hold KV blocks: a session evicted from the store must not leave
    them pending for good."""
    drafter = Drafter(model_dirs["close"], ModelSettings(max_sessions=1, device=device))

    async def scenario() -> tuple[int, int]:
        await drafter.propose("a", 0, [5, 6, 7], DraftRequest(3, Transform()), pre_draft=PreDraftRequest(3, 0))
        pending = len(drafter.pre_drafts)
        await drafter.propose("b", 0, [5, 6, 8], DraftRequest(3, Transform()))  # the store keeps one: "a" goes
        left = len(drafter.pre_drafts)
        await drafter.runner.close()
        return pending, left

    assert asyncio.run(scenario()) == (1, 0)


class CountedJob(Job):
    """A job of `forwards` forwards of one token each (of `session`, or of none where the
    scheduler never looks at it), whose forwards a fake model logs."""

    def __init__(self, forwards: int, session: object = None) -> None:
        super().__init__(cast(SessionKV, session), [1], keep=1)
        self.left = forwards

    def consume(self, logits: torch.Tensor) -> bool:
        self.left -= 1
        self.pending = [1]
        return self.left == 0

    def result(self) -> int:
        return self.forwards


def test_a_run_of_forwards_lets_other_model_thread_work_in_and_stops_at_close():
    """A job's forwards run on the model's thread back to back, but work handed to that
    thread meanwhile (an accelerator's recovered-token draw) waits one forward, not the
    whole job; and closing the scheduler stops the run at the next forward."""
    log: list[str] = []

    def fake_forward(rows):
        time.sleep(0.005)
        log.append("forward")
        return torch.zeros(len(rows), 4), [slice(i, i + 1) for i in range(len(rows))]

    async def scenario() -> tuple[int, int]:
        scheduler = Scheduler(fake_forward, ThreadPoolExecutor(1), BatchSettings())
        job = asyncio.ensure_future(scheduler.submit(CountedJob(40)))
        while not scheduler.busy:
            await asyncio.sleep(0)
        await asyncio.sleep(0.012)
        await scheduler.on_model_thread(log.append, "other work")
        before_other = log.index("other work")
        await job
        started = len(log)
        second = asyncio.ensure_future(scheduler.submit(CountedJob(40)))
        while len(log) == started:  # its forwards are under way on the model's thread
            await asyncio.sleep(0.001)
        at_close = len(log)
        await scheduler.close()
        await asyncio.sleep(0.3)
        second.cancel()
        return before_other, len(log) - at_close

    before_other, after_close = asyncio.run(scenario())
    assert before_other <= 6, f"the other work waited for {before_other} of 40 forwards"
    assert after_close <= 1, f"{after_close} forwards ran after close()"


@pytest.mark.parametrize("max_wait_ms,forwards_a_step", [(1.0, 1), (0.0, 2)])
def test_a_session_just_answered_is_waited_for_beside_a_run_ahead(max_wait_ms, forwards_a_step):
    """Beside a session whose forwards follow each other unasked (a run ahead), a session
    asked step by step comes back a round trip (4 ms) after each answer: longer than
    `max_wait_ms`, shorter than a quarter of a forward (80 ms). The forward waits for it, so
    each of its steps takes the next forward, not the one after; with `max_wait_ms` 0
    nothing waits, and each step misses a forward. (A model stand-in that sleeps.)"""
    forwards: list[int] = []

    def fake_forward(rows):
        time.sleep(0.08)
        forwards.append(len(rows))
        return torch.zeros(len(rows), 4), [slice(i, i + 1) for i in range(len(rows))]

    async def scenario() -> list[int]:
        scheduler = Scheduler(fake_forward, ThreadPoolExecutor(1), BatchSettings(max_wait_ms=max_wait_ms), lambda: 2)
        run = asyncio.ensure_future(scheduler.submit(CountedJob(10_000, object())))
        while len(forwards) < 15:  # the scheduler learns what a forward takes
            await asyncio.sleep(0.01)
        asked, taken = object(), []
        for _ in range(6):
            before = len(forwards)
            await scheduler.submit(CountedJob(1, asked))
            taken.append(len(forwards) - before)
            await asyncio.sleep(0.004)  # the gateway's round trip
        await scheduler.close()
        run.cancel()
        return taken

    taken = asyncio.run(scenario())
    # The first step may land mid-forward; each later one follows its round trip.
    assert taken[1:] == [forwards_a_step] * 5, f"forwards each asked step waited through: {taken}"


def test_a_rejected_row_leaves_the_device_on_the_model_thread_not_the_event_loop(model_dirs, device, monkeypatch):
    """A sampled verification that rejects: p's row at the rejection reaches the host on the
    model's thread (`ScoreJob.consume`), so packing it for the gateway on the event loop
    copies nothing from a device; on a GPU, a copy there would stall every session's gRPC
    traffic behind the forward in flight. Recorded at every `Tensor.cpu` call."""
    import threading

    from specd import wire
    from specd.rejection import Draws

    scorer = Scorer(model_dirs["target"], ModelSettings(max_sessions=4, device=device))
    threads: list[str] = []
    original = torch.Tensor.cpu

    def recording(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", recording)

    async def step():
        # q = 1 for each proposed token, and uniforms near 1: the first test fails unless p is 1 there.
        scores = await scorer.score("s", 0, [5, 6, 7, 8], [9, 10, 11], Transform(temperature=1.0),
                                    draft_token_probs=[1.0, 1.0, 1.0], draws=Draws((0.999,) * 3, 0.5))
        event_loop = threading.current_thread().name
        assert scores.verdict is not None and scores.verdict.rejected_row is not None
        wire.pack_distributions(scores.verdict.rejected_row[None], False)
        return event_loop

    event_loop = asyncio.run(step())
    assert threads and event_loop not in threads, threads
