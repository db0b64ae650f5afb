"""Log-probabilities, and n completions, through the three services.

Each output token's log-probability, and its alternatives', equal the log-softmax of the
target's own logits (float32 transformers, one forward over prompt and output) within
2e-3, whichever proposer made the step and whether the token was accepted, a bonus, or
recovered after a rejection (drawn by the draft, or by the gateway for a model-free
proposal). They are the raw ones (vLLM's default): before penalties and temperature.
Over HTTP, each chat entry's `bytes` are the token's own, also for a token that holds
part of a character.
"""
from __future__ import annotations

from pathlib import Path

import grpc
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import LoopThread, request, start_stack
from gateway.app import create_server as create_gateway
from gateway.edge.replies import Logprobs
from gateway.settings import GatewaySettings
from gateway.step.engine import TokenLogprob
from gateway.step.text import token_bytes
from specd.config import ServerSettings
from specd.v1 import gateway_pb2

TOLERANCE = 2e-3


def reference_logprobs(target_model, tokenizer, prompt: str, output: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at each output position [len(output), V]."""
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        logits = target_model(torch.tensor([ids + output], device=target_model.device)).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)


def check(response, target_model, tokenizer, prompt: str, top: int, greedy: bool) -> None:
    output = list(response.token_ids)
    assert len(response.logprobs) == len(output) > 0
    expected = reference_logprobs(target_model, tokenizer, prompt, output)
    for i, (token, entry) in enumerate(zip(output, response.logprobs)):
        assert entry.token_id == token
        assert abs(entry.logprob - float(expected[i, token])) < TOLERANCE, (i, entry.logprob, expected[i, token])
        assert len(entry.top_ids) == len(entry.top_logprobs) == top
        best = expected[i].topk(top)
        assert torch.allclose(torch.tensor(list(entry.top_logprobs)), best.values, atol=TOLERANCE)
        if greedy:
            assert entry.top_ids[0] == token  # the chosen token heads the alternatives


def with_logprobs(prompt: str, top: int, **fields) -> gateway_pb2.GenerateRequest:
    req = request(prompt, **fields)
    req.sampling.logprobs = top
    return req


PROMPT = "def fibonacci(n):"


@pytest.mark.parametrize("mode,draft", [("OFF", ""), ("FIXED", "close"), ("AUTO", "close")])
def test_greedy_logprobs_are_the_targets(stack, target_model, tokenizer, mode, draft):
    response = stack.stub.Generate(with_logprobs(PROMPT, 5, max_new_tokens=32, mode=mode, draft_length=4,
                                                 draft_model=draft))
    check(response, target_model, tokenizer, PROMPT, 5, greedy=True)
    if mode == "FIXED":
        assert response.stats.accepted_tokens > 0  # logprobs leave speculation on


@pytest.mark.parametrize("draft", ["unrelated", "close"])
def test_sampled_logprobs_hold_at_accepted_bonus_and_recovered_tokens(stack, target_model, tokenizer, draft):
    """The unrelated draft is rejected often: its recovered tokens come from the draft."""
    rejected = 0
    for seed in range(1, 6):
        response = stack.stub.Generate(with_logprobs(PROMPT, 3, temperature=1.0, seed=seed, max_new_tokens=24,
                                                     draft_length=4, draft_model=draft))
        check(response, target_model, tokenizer, PROMPT, 3, greedy=False)
        rejected += sum(1 for g, a in zip(response.stats.draft_lengths, response.stats.accepted_lengths) if a < g)
    assert rejected > 0


def test_model_free_and_streamed_logprobs(model_dirs, target_model, tokenizer):
    """A model-free proposal's rejected position: the gateway draws the token, from the
    row the verifier sent. A stream's chunks carry the logprobs of their own tokens."""
    running = start_stack(model_dirs, model_free=("suffix", "prompt-lookup"))
    try:
        prompt = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
        for seed in (1, 2):
            req = with_logprobs(prompt, 2, temperature=0.8, seed=seed, max_new_tokens=30, mode="AUTO")
            chunks = list(running.stub.GenerateStream(req))
            whole = gateway_pb2.GenerateResponse(token_ids=[t for c in chunks for t in c.token_ids],
                                                 logprobs=[e for c in chunks for e in c.logprobs])
            assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
            check(whole, target_model, tokenizer, prompt, 2, greedy=False)
    finally:
        running.close()


def test_logprobs_are_raw_under_penalties(stack, target_model, tokenizer):
    req = with_logprobs(PROMPT, 0, max_new_tokens=20, draft_length=4, draft_model="close")
    req.sampling.repetition_penalty = 1.8
    req.sampling.logit_bias[7] = 5.0
    check(stack.stub.Generate(req), target_model, tokenizer, PROMPT, 0, greedy=False)


def test_too_many_alternatives_is_invalid_argument(stack):
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(with_logprobs(PROMPT, 21, max_new_tokens=4))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs must be in [0, 20]" in \
        err.value.details()


def test_n_completions_each_reproduce_from_the_seed(stack):
    req = request(PROMPT, temperature=1.0, seed=40, max_new_tokens=12, draft_length=3, draft_model="close")
    req.n = 3
    response = stack.stub.Generate(req)
    completions = [(response.text, list(response.token_ids))] + [(c.text, list(c.token_ids))
                                                                 for c in response.choices]
    assert [c.index for c in response.choices] == [1, 2] and len(set(t for t, _ in completions)) > 1
    for i, (text, tokens) in enumerate(completions):
        alone = stack.stub.Generate(request(PROMPT, temperature=1.0, seed=40 + i, max_new_tokens=12,
                                            draft_length=3, draft_model="close"))
        assert (alone.text, list(alone.token_ids)) == (text, tokens)
    streamed: dict[int, list[int]] = {}
    for chunk in stack.stub.GenerateStream(req):
        streamed.setdefault(chunk.index, []).extend(chunk.token_ids)
    assert [streamed[i] for i in range(3)] == [tokens for _, tokens in completions]
    req.n = 17
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n may be at most 16" in err.value.details()


# -- OpenAI's `bytes`: each token's own --------------------------------------------------------

TEXT = "é€😀"  # characters of 2, 3 and 4 bytes, which the test tokenizer spells byte by byte


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Llama 2's, Mistral's): a character it has no piece
    for is spelled as byte pieces <0xNN>."""
    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"▁": 256, "a": 257, "▁a": 258}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("family", ["byte-level", "byte-fallback"])
def test_a_tokens_bytes_are_its_own_not_its_texts(tokenizer, family):
    chosen = tokenizer if family == "byte-level" else byte_fallback_tokenizer()
    ids = chosen.encode("a " + TEXT, add_special_tokens=False)
    texts = [chosen.decode([token]) for token in ids]
    assert "\ufffd" in texts  # some tokens hold part of a character
    joined = b"".join(token_bytes(chosen, token, text) for token, text in zip(ids, texts))
    assert joined.decode("utf-8").endswith(TEXT)


def test_chat_logprob_entries_carry_each_tokens_bytes(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    entries = tuple(TokenLogprob(token, -0.1, ((token, -0.1), (ids[0], -2.0))) for token in ids)
    content = Logprobs(tokenizer, chat=True).render(0, entries)["content"]
    assert bytes(b for entry in content for b in entry["bytes"]) == TEXT.encode("utf-8")
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
    assert {tuple(entry["top_logprobs"][1]["bytes"]) for entry in content} == {(TEXT.encode("utf-8")[0],)}


@pytest.fixture(scope="module")
def chat_client(stack):
    """A gateway with an HTTP port on the session's workers, and an OpenAI client of it."""
    loop = LoopThread()
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                               verifier_address=f"127.0.0.1:{stack.verifier.port}",
                               draft_address=f"127.0.0.1:{stack.draft.port}", http_port=0,
                               chat_template=Path(__file__).parent.parent / "models" / "demo" / "chat.jinja")
    server = loop.run(create_gateway(settings))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.servicer.http.port}/v1", api_key="unused",
                        max_retries=0, timeout=120)
    loop.run(server.stop(0))
    loop.close()


def test_a_generated_byte_tokens_bytes_through_http(chat_client, tokenizer):
    """A token that is the first byte of "é" (0xC3), forced by logit_bias: its entry's
    `bytes` is that byte, where its text is U+FFFD."""
    first_byte = tokenizer.encode("é", add_special_tokens=False)[0]
    assert tokenizer.decode([first_byte]) == "\ufffd"
    model = chat_client.models.list().data[0].id
    chat = chat_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=3, temperature=0,
        logprobs=True, top_logprobs=2, logit_bias={str(first_byte): 100})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert entry.token == "\ufffd" and entry.bytes == [0xC3]
        for alt in entry.top_logprobs:  # the raw alternatives (before the bias): whole or part characters
            raw = bytes(alt.bytes)
            assert raw != "\ufffd".encode() and (alt.token == "\ufffd" or raw.decode("utf-8") == alt.token)
