"""Structured output (JSON Schema, JSON object, regex, choice, grammar), exact under
speculation for every proposer.

Greedy output through the three services equals transformers' own `generate` with the
grammar applied by a logits processor built here on llguidance's matcher, token for token,
under FIXED γ=4 with a draft model, under AUTO and with the model-free proposers; it
parses, validates and ends by itself; and draft tokens are still accepted. Sampled output
follows the target's distribution restricted to the grammar (a chi-square test).
"""
from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from conftest import SEEDED_DRAFT_FLOOR_S, assert_follows, request, start_stack
from gateway.grammar import StructureSpec
from specd.sampling import Transform, allowed_from_words, probs_from_logits
from specd.v1 import gateway_pb2

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "size": {"type": "string", "enum": ["small", "large"]},
                                           "id": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "size", "id"], "additionalProperties": False}
REGEX = r"(yes|no) \d{1,3}"
CHOICES = ["def fibonacci", "class Cache", "acceptance"]


def structured(prompt: str, kind: str, value, **fields) -> gateway_pb2.GenerateRequest:
    req = request(prompt, **fields)
    target = req.sampling.structured
    if kind == "json_schema":
        target.json_schema = json.dumps(value)
    elif kind == "json_object":
        target.json_object = True
    elif kind == "choice":
        target.choice.choices.extend(value)
    else:
        setattr(target, kind, value)
    return req


class GrammarProcessor(LogitsProcessor):
    """The reference: llguidance's matcher fed each chosen token, every other token at -inf."""

    def __init__(self, tokenizer, grammar: str, vocab: int, prompt_length: int) -> None:
        lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.matcher = llguidance.LLMatcher(lltokenizer, grammar)
        self.vocab, self.prompt_length = vocab, prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] > self.prompt_length:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        words = llguidance.torch.allocate_token_bitmask(1, self.vocab)
        llguidance.torch.fill_next_token_bitmask(self.matcher, words, 0)
        return scores.masked_fill(~allowed_from_words(words, self.vocab).to(scores.device), float("-inf"))


def reference(target_model, tokenizer, prompt: str, spec: StructureSpec, new_tokens: int) -> list[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=target_model.device)
    processor = GrammarProcessor(tokenizer, spec.grammar(), target_model.config.vocab_size, ids.shape[1])
    out = target_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=new_tokens, logits_processor=LogitsProcessorList([processor]))
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def suffix_stack(model_dirs):
    running = start_stack(model_dirs, model_free=("suffix", "prompt-lookup"))
    yield running
    running.close()


CASES = {
    "json_schema": (SCHEMA, StructureSpec("json", json.dumps(SCHEMA))),
    "json_object": (True, StructureSpec("json_object", "")),
    "regex": (REGEX, StructureSpec("regex", REGEX)),
    "choice": (CHOICES, StructureSpec("choice", json.dumps(CHOICES))),
}


def check_shape(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("kind", sorted(CASES))
def test_greedy_under_a_structure_equals_generate_with_it(stack, target_model, tokenizer, kind):
    value, spec = CASES[kind]
    accepted = 0
    for prompt in ("def fibonacci(n):", "The acceptance rate is"):
        expected = reference(target_model, tokenizer, prompt, spec, 60)
        for mode, draft in (("OFF", ""), ("FIXED", "close"), ("AUTO", "close"), ("FIXED", "unrelated")):
            response = stack.stub.Generate(structured(prompt, kind, value, max_new_tokens=60, mode=mode,
                                                      draft_length=4, draft_model=draft))
            assert list(response.token_ids) == expected, (kind, prompt, mode, draft)
            if expected[-1] == tokenizer.eos_token_id:  # it ended by itself: the structure is whole
                assert response.finish_reason == gateway_pb2.FINISH_REASON_EOS
                check_shape(kind, response.text)
            accepted += response.stats.accepted_tokens
    assert accepted > 0  # proposals are still accepted under the structure
    if kind in ("json_schema", "regex", "choice"):  # bounded structures: they end by themselves
        assert expected[-1] == tokenizer.eos_token_id


def test_model_free_proposals_are_cut_to_the_structure(suffix_stack, target_model, tokenizer):
    """A suffix match that leaves the structure is cut at its first forbidden token; the
    second request, whose answer the suffix cache holds, proposes that answer whole."""
    spec = CASES["json_schema"][1]
    prompt = "The acceptance rate is"
    expected = reference(target_model, tokenizer, prompt, spec, 60)
    for _ in range(2):
        response = suffix_stack.stub.Generate(structured(prompt, "json_schema", SCHEMA, max_new_tokens=60,
                                                         mode="AUTO"))
        assert list(response.token_ids) == expected
    assert response.stats.accepted_tokens > 0


def test_bad_structures_are_invalid_argument_and_the_gateway_serves_on(stack):
    for kind, value, says in (("json_schema", "{not json", "not valid JSON"),
                              ("json_schema", {"type": "nonsense"}, "does not compile"),
                              ("regex", "(a|b", "does not compile"),
                              ("grammar", "start: foo\nfoo: 'x", "does not compile"),
                              ("choice", [], "one or more")):
        req = structured("x", kind, value if kind != "json_schema" or isinstance(value, dict) else None,
                         max_new_tokens=4)
        if kind == "json_schema" and isinstance(value, str):
            req.sampling.structured.json_schema = value
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(req)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.value.details(), \
            err.value.details()
    req = structured("x", "regex", "a+", max_new_tokens=4)
    req.sampling.ignore_eos = True
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Generate(req)
    assert "cannot be combined with structured output" in err.value.details()
    assert stack.stub.Generate(request("x", max_new_tokens=3)).stats.generated_tokens == 3


def test_a_gbnf_grammar_is_read_as_vllm_users_write_it(stack):
    gbnf = 'root ::= "yes" | "no"'
    response = stack.stub.Generate(structured("def fibonacci(n):", "grammar", gbnf, max_new_tokens=8))
    assert response.text in ("yes", "no") and response.finish_reason == gateway_pb2.FINISH_REASON_EOS


TRANSFORM = Transform(temperature=1.3)


def restricted_joint(target_model, tokenizer, prompt: str, grammar: str,
                     transform: Transform = TRANSFORM) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the target restricted to the grammar, under `transform`."""
    ids = tokenizer(prompt)["input_ids"]
    vocab = target_model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar)

    def probs(tokens: list[int]) -> torch.Tensor:
        words = llguidance.torch.allocate_token_bitmask(1, vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, words, 0)
        with torch.no_grad():
            logits = target_model(torch.tensor([tokens], device=target_model.device)).logits[:, -1]
        return probs_from_logits(logits.masked_fill(~allowed_from_words(words, vocab), float("-inf")), transform)[0]

    first, joint = probs(ids), {}
    for t1 in first.nonzero().flatten().tolist():
        assert matcher.consume_token(t1)
        second = probs(ids + [t1])
        matcher.rollback(1)
        for t2 in second.nonzero().flatten().tolist():
            joint[(t1, t2)] = float(first[t1]) * float(second[t2])
    return joint


@pytest.mark.parametrize("draft_model,gamma", [("unrelated", 2), ("close", 3)])
def test_sampled_under_a_structure_follows_the_restricted_target(stack, target_model, tokenizer, draft_model,
                                                                   gamma):
    prompt = "def fibonacci(n):"
    regex = r"[a-f]{1,2}[0-9 ]{1,3}"
    joint = restricted_joint(target_model, tokenizer, prompt, StructureSpec("regex", regex).grammar())

    def sample(seed: int) -> tuple[int, int]:
        req = structured(prompt, "regex", regex, temperature=TRANSFORM.temperature, seed=seed,
                         max_new_tokens=gamma + 1, draft_length=gamma, draft_model=draft_model)
        return tuple(stack.stub.Generate(req).token_ids[:2])

    trials = 1500
    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    assert_follows(counts, joint, trials)


@pytest.fixture(scope="module")
def unguided_stack(model_dirs):
    """A stack whose draft proposes unguided by the request's grammar (a mask budget of 0
    ms: every cursor gives up at its first mask), as a draft with another EOS would."""
    running = start_stack(model_dirs, draft_step_floor_s=SEEDED_DRAFT_FLOOR_S, draft_grammar_mask_budget_ms=0.0)
    yield running
    running.close()


def test_sampled_under_a_structure_is_exact_when_the_draft_proposes_forbidden_tokens(
        unguided_stack, target_model, tokenizer, model_dirs):
    """Rejecting a forbidden proposed token draws from norm(max(0, p − q)), as for any
    rejection. Ending the step before it and drawing from p instead is biased whenever q
    also has mass on allowed tokens. Here the draft's top token (under top_k=4) is
    forbidden and the grammar allows its next ranks: the cut's law is off by a total
    variation of about 0.16 on the first token."""
    prompt, transform = "def fibonacci(n):", Transform(temperature=1.3, top_k=4)
    ids = tokenizer(prompt)["input_ids"]
    draft = AutoModelForCausalLM.from_pretrained(model_dirs["unrelated"])
    with torch.no_grad():
        q = probs_from_logits(draft(torch.tensor([ids])).logits[:, -1], transform)[0]
    ranked = q.argsort(descending=True).tolist()
    top = tokenizer.decode([ranked[0]])
    allowed = [text for text in (tokenizer.decode([t]) for t in ranked[1:4])
               if text.strip() and "\ufffd" not in text and not text.startswith(top) and not top.startswith(text)]
    assert allowed, "the draft's next ranks decode to no usable text"
    grammar = "start: " + " | ".join(json.dumps(text) for text in allowed)
    joint = restricted_joint(target_model, tokenizer, prompt, grammar, transform)

    def sample(seed: int) -> tuple[int, ...]:
        req = structured(prompt, "grammar", grammar, temperature=transform.temperature, top_k=transform.top_k,
                         seed=seed, max_new_tokens=2, draft_length=1, draft_model="unrelated")
        return tuple(unguided_stack.stub.Generate(req).token_ids[:2])

    trials = 1500
    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    assert_follows(counts, joint, trials)


# A 150-byte grammar whose every string has many parses: each token's mask costs more than
# the last (Earley items over every parse), about 20 ms at 200 tokens on this tokenizer.
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | "ab" | "ba" | "aab"\n'


@pytest.fixture(scope="module")
def tight_grammar_stack(model_dirs):
    running = start_stack(model_dirs, grammar_step_budget_ms=10.0)
    yield running
    running.close()


def test_an_ambiguous_grammar_ends_its_request_with_an_error_and_the_gateway_serves_on(tight_grammar_stack,
                                                                                        tokenizer):
    """The step budget ends a request whose grammar costs more at every token: an error that
    says why, never output cut short and called finished. Its work runs on the grammar
    threads, so a request without a grammar is served meanwhile."""
    stub = tight_grammar_stack.stub
    req = structured("x", "grammar", AMBIGUOUS, temperature=1.0, seed=5, max_new_tokens=240)
    req.sampling.logit_bias[tokenizer.eos_token_id] = -100.0  # the grammar lets it end anywhere: keep it going
    with ThreadPoolExecutor(2) as pool:
        grammar_call = pool.submit(stub.Generate, req, timeout=120)
        plain = [stub.Generate(request("def fibonacci(n):", max_new_tokens=4)) for _ in range(3)]
        with pytest.raises(grpc.RpcError) as err:
            grammar_call.result()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "--grammar-step-budget-ms" in err.value.details() and "ambiguous" in err.value.details()
    assert all(reply.stats.generated_tokens == 4 for reply in plain)
    # The gateway and its grammar threads serve on: the same grammar, kept short, completes.
    req.sampling.max_new_tokens = 8
    assert len(stub.Generate(req).token_ids) == 8
