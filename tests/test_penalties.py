"""Penalties, logit bias, min_p, min_tokens, stop token ids and ignore_eos, exact under
speculation for every proposer.

Greedy output through the three services equals transformers' own `generate` with the
same rule applied by a reference processor written here from the definitions (OpenAI's
presence and frequency penalties over the output, vLLM's repetition penalty over prompt
and output, OpenAI's logit bias), token for token, under FIXED γ=4 with the draft model,
under AUTO, and with a model-free proposer; and the draft's tokens are still accepted.
Sampled output follows the penalized target distribution (a chi-square test)."""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import assert_follows, request, start_stack
from specd.sampling import Transform, penalized, probs_from_logits

PROMPTS = ["def fibonacci(n):", "The acceptance rate is"]
RULES = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.8),
    "logit bias": dict(logit_bias={5: 4.0, 17: -100.0, 40: 6.0}),
    "all": dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={12: 2.5}),
}


class Reference(LogitsProcessor):
    """The rules, one token at a time, as their definitions say."""

    def __init__(self, prompt_length: int, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None) -> None:
        self.prompt_length = prompt_length
        self.presence, self.frequency, self.repetition = presence_penalty, frequency_penalty, repetition_penalty
        self.bias = logit_bias or {}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.Tensor:
        scores = scores.clone()  # type: ignore[assignment]
        for row, ids in enumerate(input_ids.tolist()):
            for token, bias in self.bias.items():
                scores[row, token] += bias
            for token in set(ids):
                logit = float(scores[row, token])
                scores[row, token] = logit / self.repetition if logit > 0 else logit * self.repetition
            for token, count in Counter(ids[self.prompt_length:]).items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def reference(target_model, tokenizer, prompt: str, rule: dict, new_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=target_model.device)
    out = target_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens,
                                logits_processor=LogitsProcessorList([Reference(ids.shape[1], **rule)]))
    return out[0, ids.shape[1]:].tolist()


def penalized_request(prompt: str, rule: dict, **fields):
    req = request(prompt, **fields)
    sampling = req.sampling
    sampling.presence_penalty = rule.get("presence_penalty", 0.0)
    sampling.frequency_penalty = rule.get("frequency_penalty", 0.0)
    sampling.repetition_penalty = rule.get("repetition_penalty", 0.0)
    for token, bias in rule.get("logit_bias", {}).items():
        sampling.logit_bias[token] = bias
    return req


@pytest.fixture(scope="module")
def suffix_stack(model_dirs):
    """The services with the gateway's model-free proposers as well."""
    running = start_stack(model_dirs, model_free=("suffix", "prompt-lookup"))
    yield running
    running.close()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_greedy_with_a_rule_equals_generate_with_it(stack, target_model, tokenizer, rule):
    accepted = 0
    for prompt in PROMPTS:
        expected = reference(target_model, tokenizer, prompt, RULES[rule], 40)
        assert expected != reference(target_model, tokenizer, prompt, {}, 40) or rule == "logit bias"
        for mode in ("FIXED", "AUTO"):
            response = stack.stub.Generate(penalized_request(prompt, RULES[rule], max_new_tokens=40, mode=mode,
                                                             draft_length=4, draft_model="close"))
            assert list(response.token_ids) == expected, (rule, prompt, mode)
            accepted += response.stats.accepted_tokens
    assert accepted > 0  # speculation still pays: the draft proposes under the same rule


def test_model_free_proposals_are_judged_under_the_rule(suffix_stack, target_model, tokenizer):
    """A suffix or prompt-lookup proposal is verified against the penalized target: output
    unchanged, even where the rule makes a copied continuation wrong."""
    rule = RULES["all"]
    prompt = "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    expected = reference(target_model, tokenizer, prompt, rule, 48)
    for _ in range(2):  # the second time, the suffix cache holds the first answer
        response = suffix_stack.stub.Generate(penalized_request(prompt, rule, max_new_tokens=48, mode="AUTO"))
        assert list(response.token_ids) == expected


def test_bad_rules_are_invalid_argument(stack):
    import grpc

    for rule, says in ((dict(presence_penalty=3.0), "presence_penalty must be in [-2, 2]"),
                       (dict(repetition_penalty=-1.0), "repetition_penalty must be in (0, 100]"),
                       (dict(logit_bias={5: 101.0}), "logit_bias for token 5 must be in [-100, 100]"),
                       (dict(logit_bias={10 ** 6: 1.0}), "outside the target's vocabulary")):
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(penalized_request("x", rule, max_new_tokens=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details()


def test_min_tokens_beyond_max_new_tokens_is_invalid_argument(stack):
    """An output held open for more tokens than the request may generate is refused, as
    vLLM refuses it, rather than quietly cut at max_new_tokens; the gateway keeps serving."""
    import grpc

    req = request("x", max_new_tokens=2)
    req.sampling.min_tokens = 5
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "min_tokens=5 asks for more than the 2 tokens this request may generate" in err.value.details()
    req.sampling.min_tokens = 2
    assert len(stack.stub.Generate(req).token_ids) == 2


TRANSFORM = Transform(temperature=1.5, top_k=6, presence_penalty=1.2, frequency_penalty=0.5,
                      repetition_penalty=1.4, logit_bias=((7, 1.0),), min_p=0.15)


def penalized_joint(target_model, tokenizer, prompt: str) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the penalized target: the second token's rule counts the first."""
    ids = tokenizer(prompt)["input_ids"]
    transform = Transform(**{**TRANSFORM.__dict__, "output_start": len(ids)})
    with torch.no_grad():
        def probs(tokens: list[int]) -> torch.Tensor:
            logits = target_model(torch.tensor([tokens], device=target_model.device)).logits[:, -1]
            return probs_from_logits(penalized(logits, transform, tokens), transform)[0]

        first, joint = probs(ids), {}
        for t1 in first.nonzero().flatten().tolist():
            second = probs(ids + [t1])
            for t2 in second.nonzero().flatten().tolist():
                joint[(t1, t2)] = float(first[t1]) * float(second[t2])
    return joint


@pytest.mark.parametrize("draft_model,gamma,overlap", [("unrelated", 2, False), ("close", 2, False),
                                                       ("close", 1, True)])
def test_sampled_with_penalties_follows_the_penalized_target(stack, target_model, tokenizer, draft_model, gamma,
                                                             overlap):
    """With overlap, second tokens may come from a branch pre-drafted under the rule."""
    prompt = "def fibonacci(n):"
    joint = penalized_joint(target_model, tokenizer, prompt)
    rule = dict(presence_penalty=TRANSFORM.presence_penalty, frequency_penalty=TRANSFORM.frequency_penalty,
                repetition_penalty=TRANSFORM.repetition_penalty, logit_bias=dict(TRANSFORM.logit_bias))

    def sample(seed: int) -> tuple[int, int]:
        req = penalized_request(prompt, rule, temperature=TRANSFORM.temperature, top_k=TRANSFORM.top_k, seed=seed,
                                max_new_tokens=gamma + 1 + overlap, draft_length=gamma, draft_model=draft_model)
        req.sampling.min_p = TRANSFORM.min_p
        req.speculation.overlap = overlap
        return tuple(stack.stub.Generate(req).token_ids[:2])

    trials = 1500
    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    assert_follows(counts, joint, trials)


def manual_greedy(target_model, ids: list[int], processor: LogitsProcessor, new_tokens: int,
                  ends: set[int]) -> list[int]:
    """Greedy decoding one forward at a time, no cache: the plainest reference there is."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = target_model(torch.tensor([tokens], device=target_model.device)).logits[:, -1]
            token = int(processor(torch.tensor([tokens]), logits).argmax())
            tokens.append(token)
            if token in ends:
                break
    return tokens[len(ids):]


class HoldBack(Reference):
    """The reference rules, and `held` tokens at -inf until `min_tokens` are out."""

    def __init__(self, prompt_length: int, min_tokens: int, held: set[int], **rule) -> None:
        super().__init__(prompt_length, **rule)
        self.min_tokens, self.held = min_tokens, held

    def __call__(self, input_ids, scores):
        scores = super().__call__(input_ids, scores)
        if input_ids.shape[1] - self.prompt_length < self.min_tokens:
            scores[:, sorted(self.held)] = float("-inf")
        return scores


EOS = 0  # the test tokenizer's <eos>


@pytest.mark.parametrize("mode", ["FIXED", "AUTO"])
def test_min_tokens_stop_token_ids_and_ignore_eos(stack, target_model, tokenizer, mode):
    """EOS made likely by a bias: it ends the output at once, unless min_tokens holds it
    back, or ignore_eos lets the output run on past it; a stop token id ends the output
    after its first occurrence, with finish reason STOP."""
    from specd.v1 import gateway_pb2

    prompt = "def fibonacci(n):"
    ids = tokenizer(prompt)["input_ids"]
    rule = dict(logit_bias={EOS: 6.0})

    def ours(rule: dict = rule, **fields):
        extra = {k: fields.pop(k) for k in ("min_tokens", "stop_token_ids", "ignore_eos") if k in fields}
        req = penalized_request(prompt, rule, max_new_tokens=30, mode=mode, draft_length=4, draft_model="close",
                                **fields)
        req.sampling.min_tokens = extra.get("min_tokens", 0)
        req.sampling.stop_token_ids.extend(extra.get("stop_token_ids", []))
        req.sampling.ignore_eos = extra.get("ignore_eos", False)
        return stack.stub.Generate(req)

    plain = manual_greedy(target_model, ids, Reference(len(ids), **rule), 30, {EOS})
    assert plain[-1] == EOS and len(plain) < 10, plain  # the bias makes EOS come early
    response = ours()
    assert list(response.token_ids) == plain and response.finish_reason == gateway_pb2.FINISH_REASON_EOS

    held = manual_greedy(target_model, ids, HoldBack(len(ids), 12, {EOS}, **rule), 30, {EOS})
    response = ours(min_tokens=12)
    assert list(response.token_ids) == held and len(held) > 12 and EOS not in held[:12]

    running_on = manual_greedy(target_model, ids, Reference(len(ids), **rule), 30, set())
    response = ours(ignore_eos=True)
    assert list(response.token_ids) == running_on and len(running_on) == 30 and EOS in running_on
    assert response.finish_reason == gateway_pb2.FINISH_REASON_LENGTH

    unbiased = manual_greedy(target_model, ids, Reference(len(ids)), 30, {EOS})
    stop = unbiased[4]  # the fifth token of the plain output
    assert stop != EOS and len(unbiased) > 12, unbiased
    expected = manual_greedy(target_model, ids, Reference(len(ids)), 30, {EOS, stop})
    response = ours({}, stop_token_ids=[stop])
    assert list(response.token_ids) == expected and response.finish_reason == gateway_pb2.FINISH_REASON_STOP

    held = manual_greedy(target_model, ids, HoldBack(len(ids), 12, {EOS, stop}), 30, {EOS, stop})
    response = ours({}, stop_token_ids=[stop], min_tokens=12)
    assert list(response.token_ids) == held and stop not in held[:12] and len(held) > 12
