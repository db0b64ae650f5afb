"""End to end through the three services on loopback: exactness, seeds, streaming."""
from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import request

PROMPTS = ["def fibonacci(n):", "The acceptance rate is", "class Cache:\n    def"]


def reference_greedy(target_model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=target_model.device)
    out = target_model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("draft_model", ["close", "unrelated"])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_greedy_equals_target_generate(stack, target_model, tokenizer, draft_model, gamma):
    for prompt in PROMPTS:
        expected = reference_greedy(target_model, tokenizer, prompt, 40)
        response = stack.stub.Generate(request(prompt, max_new_tokens=40, draft_length=gamma,
                                               draft_model=draft_model))
        assert list(response.token_ids) == expected, prompt
        assert response.text == tokenizer.decode(expected, skip_special_tokens=True)
        stats = response.stats
        assert stats.generated_tokens == len(expected)
        assert stats.proposed_tokens == sum(stats.draft_lengths) and max(stats.draft_lengths) <= gamma
        assert stats.accepted_tokens == sum(stats.accepted_lengths)
        assert stats.steps == len(stats.draft_lengths)
        # Every step emits its accepted tokens plus one recovered or bonus token
        # (fewer only on the last step, when EOS cuts it).
        assert stats.accepted_tokens + stats.steps >= stats.generated_tokens


def test_close_draft_is_accepted_more_than_unrelated(stack):
    rates = {}
    for draft_model in ("close", "unrelated"):
        response = stack.stub.Generate(request(PROMPTS[0], max_new_tokens=40, draft_model=draft_model))
        rates[draft_model] = response.stats.acceptance_rate
    assert rates["close"] > rates["unrelated"] + 0.2, rates


def test_off_mode_is_plain_decoding(stack, target_model, tokenizer):
    expected = reference_greedy(target_model, tokenizer, PROMPTS[1], 30)
    response = stack.stub.Generate(request(PROMPTS[1], max_new_tokens=30, mode="OFF"))
    assert list(response.token_ids) == expected
    assert response.stats.proposed_tokens == 0 and response.stats.steps == len(expected)
    assert response.stats.draft_model == ""


def test_stream_concatenates_to_generate(stack):
    req = request(PROMPTS[2], temperature=0.9, seed=7, max_new_tokens=40)
    whole = stack.stub.Generate(req)
    chunks = list(stack.stub.GenerateStream(req))
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
    assert chunks[-1].stats.steps == whole.stats.steps and len(chunks) == whole.stats.steps
    assert all(not c.HasField("stats") for c in chunks[:-1])


def test_same_seed_same_output(stack):
    req = request(PROMPTS[0], temperature=1.0, top_p=0.95, seed=1234, max_new_tokens=32, draft_model="unrelated")
    first, second = stack.stub.Generate(req), stack.stub.Generate(req)
    assert list(first.token_ids) == list(second.token_ids)
    assert first.stats.seed == 1234
    other = stack.stub.Generate(request(PROMPTS[0], temperature=1.0, top_p=0.95, seed=4321,
                                        max_new_tokens=32, draft_model="unrelated"))
    assert list(other.token_ids) != list(first.token_ids)


def test_unset_seed_is_reported_and_replays(stack):
    first = stack.stub.Generate(request(PROMPTS[0], temperature=1.0, max_new_tokens=16))
    assert first.stats.seed != 0
    replay = stack.stub.Generate(request(PROMPTS[0], temperature=1.0, max_new_tokens=16, seed=first.stats.seed))
    assert list(replay.token_ids) == list(first.token_ids)


def test_stop_string_cuts_text_and_tokens(stack, tokenizer):
    free = stack.stub.Generate(request(PROMPTS[0], max_new_tokens=40))
    stop = free.text[10:13]
    assert len(stop) == 3
    cut = stack.stub.Generate(request(PROMPTS[0], max_new_tokens=40, stop=[stop]))
    assert cut.finish_reason == 3  # FINISH_REASON_STOP
    assert cut.text == free.text[: free.text.index(stop)]
    assert list(cut.token_ids) == list(free.token_ids[: len(cut.token_ids)])
    assert stop in tokenizer.decode(list(cut.token_ids)) and stop not in tokenizer.decode(list(cut.token_ids[:-1]))


@pytest.mark.parametrize("policy", ["ema", "cost", "confidence"])
def test_adaptive_policies_stay_exact(stack, target_model, tokenizer, policy):
    for prompt in PROMPTS[:2]:
        expected = reference_greedy(target_model, tokenizer, prompt, 40)
        req = request(prompt, max_new_tokens=40, mode="AUTO", draft_model="close")
        req.speculation.policy = policy
        response = stack.stub.Generate(req)
        assert list(response.token_ids) == expected
        assert response.stats.policy == policy


def test_confidence_threshold_stops_the_draft_early(model_dirs):
    from draft_service.drafter import Drafter
    from specd.sampling import Transform
    from specd.steps import DraftRequest

    async def scenario():
        drafter = Drafter(model_dirs["close"])
        prompt = [5, 6, 7]
        full = await drafter.propose("a", 0, prompt, DraftRequest(6, Transform()))
        assert len(full.tokens) == 6
        cautious = await drafter.propose("b", 0, prompt, DraftRequest(6, Transform(), min_confidence=1.0))
        assert cautious.tokens == full.tokens[:1]  # at least one token, then stop
        # The session stays consistent after an early stop: continue from it.
        after = await drafter.propose("b", len(prompt) + 1, [9], DraftRequest(2, Transform()))
        assert len(after.tokens) == 2
        await drafter.runner.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("policy", ["fixed", "ema", "confidence"])
def test_seed_reproduces_under_auto_with_deterministic_policies(stack, policy):
    req = request(PROMPTS[0], temperature=1.0, top_k=50, seed=77, max_new_tokens=32, mode="AUTO",
                  draft_model="close")
    req.speculation.policy = policy
    first, second = stack.stub.Generate(req), stack.stub.Generate(req)
    assert list(first.token_ids) == list(second.token_ids)
    assert list(first.stats.draft_lengths) == list(second.stats.draft_lengths)


def test_draft_with_a_larger_embedding_than_the_target(stack, target_model, tokenizer):
    expected = reference_greedy(target_model, tokenizer, PROMPTS[0], 24)
    assert list(stack.stub.Generate(request(PROMPTS[0], max_new_tokens=24, draft_model="padded")).token_ids) == expected
    sampled = stack.stub.Generate(request(PROMPTS[0], temperature=1.0, seed=3, max_new_tokens=24,
                                          draft_model="padded"))
    ids = list(sampled.token_ids)
    assert max(ids) < target_model.config.vocab_size
    assert len(ids) == 24 or (len(ids) < 24 and ids[-1] == tokenizer.eos_token_id)  # a random model may end early


class ScriptedPolicy:
    """γ from a fixed script: speculative steps interleaved with plain ones."""

    name = "scripted"

    def __init__(self, script):
        self.script = list(script)

    def next_draft_length(self, bound):
        return self.script.pop(0) if self.script else 3

    def plain_steps_ahead(self, limit):
        zeros = next((i for i, gamma in enumerate(self.script) if gamma), len(self.script))
        return min(zeros, limit)  # the script's end proposes 3

    def bound(self):
        return None  # no load cap

    def recovery_draft_length(self, gamma, accepted):
        return gamma

    def observe(self, record):
        pass


@pytest.mark.parametrize("draft_name", ["close", "unrelated"])
def test_draft_proposes_from_the_committed_sequence_after_plain_steps(stack, model_dirs, draft_name):
    """After steps the draft sat out (γ = 0), its proposals must still continue exactly the
    committed sequence: compare every proposal with the draft model's own greedy decoding.
    (The unrelated draft is rejected at once, so its cache holds stale proposals to crop.)"""
    from transformers import AutoModelForCausalLM

    from gateway.core import open_links
    from gateway.request import Generation, Stopping
    from gateway.settings import GatewaySettings
    from gateway.step.engine import ModelBounds, speculate
    from gateway.workers.backend import connect
    from specd.config import ServerSettings
    from specd.sampling import Transform

    draft_model = AutoModelForCausalLM.from_pretrained(model_dirs[draft_name]).eval()
    settings = GatewaySettings(ServerSettings(), verifier_address=f"127.0.0.1:{stack.verifier.port}",
                               draft_address=f"127.0.0.1:{stack.draft.port}")
    proposals = []

    async def scenario():
        backend = await connect(settings)
        draft, verifier = open_links(backend, settings, draft_name)
        hop = draft.draft

        async def recording_hop(committed, *args):
            proposal = await hop(committed, *args)
            proposals.append((list(committed), proposal.tokens))
            return proposal

        draft.draft = recording_hop
        prompt = backend.tokenizer(PROMPTS[0])["input_ids"]
        request_ = Generation(prompt, Transform(), seed=1, stopping=Stopping(40), draft_model=draft_name)
        bounds = ModelBounds(draft_context=256, vocab_size=backend.target.vocab_size,
                        eos_token_ids=frozenset(backend.target.eos_token_ids))
        async for _ in speculate(request_, ScriptedPolicy([3, 0, 0, 2, 0, 3, 0, 0, 0, 4]), draft, verifier,
                                 bounds):
            pass
        draft.close()
        verifier.close()
        await backend.close()

    stack.loop.run(scenario())
    assert len(proposals) >= 4
    for committed, tokens in proposals:
        own = draft_model.generate(torch.tensor([committed]), do_sample=False, max_new_tokens=len(tokens))
        assert tokens == own[0, len(committed):].tolist()
