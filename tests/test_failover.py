"""Workers are caches: a worker that restarts or evicts a session mid-request does not
change the output, because the gateway re-opens the session from the committed tokens."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import SEEDED_DRAFT_FLOOR_S, request, start_stack
from test_pipeline import reference_greedy


@pytest.mark.parametrize("worker", ["draft", "verifier"])
def test_worker_restarted_mid_request(stack, target_model, tokenizer, worker):
    prompt = "The acceptance rate is"
    expected = reference_greedy(target_model, tokenizer, prompt, 40)
    sampled = request(prompt, temperature=1.0, top_k=20, seed=99, max_new_tokens=40)
    undisturbed = stack.stub.Generate(sampled)
    for req, want in ((request(prompt, max_new_tokens=40), expected), (sampled, list(undisturbed.token_ids))):
        stream = stack.stub.GenerateStream(req)
        got = list(next(stream).token_ids)
        getattr(stack, f"restart_{worker}")()
        chunks = list(stream)
        got += [t for c in chunks for t in c.token_ids]
        assert got == want
        assert chunks[-1].stats.session_reopens >= 1


def test_evicted_sessions_are_reopened(model_dirs, target_model, tokenizer):
    # Every concurrent request evicts the other.
    small = start_stack(model_dirs, max_sessions=1, draft_step_floor_s=SEEDED_DRAFT_FLOOR_S)
    try:
        prompts = ["def fibonacci(n):", "class Cache:", "The gateway accepts", "Speculative decoding"]
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(lambda p: small.stub.Generate(request(p, max_new_tokens=30)), prompts))
        for prompt, response in zip(prompts, responses):
            assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 30)
        assert sum(r.stats.session_reopens for r in responses) > 0
        # Sampled: a draft session evicted between a proposal and its recovery is rebuilt, and
        # its forward finds the same q, so a seed gives the same output as alone.
        sampled = [request(p, temperature=1.0, seed=21 + i, max_new_tokens=30) for i, p in enumerate(prompts)]
        alone = [small.stub.Generate(r) for r in sampled]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(small.stub.Generate, sampled))
        assert [list(r.token_ids) for r in together] == [list(r.token_ids) for r in alone]
        assert sum(r.stats.session_reopens for r in together) > 0
    finally:
        small.close()


def test_lost_draft_service_falls_back_to_plain_decoding(model_dirs, target_model, tokenizer):
    lone = start_stack(model_dirs, worker_timeout_s=5.0)
    try:
        prompt = "def fibonacci(n):"
        stream = lone.stub.GenerateStream(request(prompt, max_new_tokens=40))
        got = list(next(stream).token_ids)
        lone.loop.run(lone.draft.stop(0))  # gone for good: nothing comes back on its port
        chunks = list(stream)
        got += [t for c in chunks for t in c.token_ids]
        assert got == reference_greedy(target_model, tokenizer, prompt, 40)
        assert chunks[-1].stats.draft_lengths[-1] == 0  # the end was decoded plainly
    finally:
        lone.close()


def test_cancelled_request_frees_its_admission_slot(model_dirs):
    import time

    import grpc

    small = start_stack(model_dirs, max_concurrent_requests=1)
    try:
        stream = small.stub.GenerateStream(request("def fibonacci(n):", max_new_tokens=200))
        next(stream)
        stream.cancel()  # the client goes away mid-request
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # its slot frees up: a new request is admitted
            try:
                assert len(small.stub.Generate(request("x", max_new_tokens=2)).token_ids) == 2
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                time.sleep(0.2)
        else:
            raise AssertionError("the cancelled request never released its slot")
    finally:
        small.close()
