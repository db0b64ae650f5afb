"""Structured output: the grammar a request's output must match, held by the gateway.

llguidance (the guidance project's matcher, also a backend of vLLM and llama.cpp)
compiles a JSON Schema, a regular expression, a list of choices or a Lark grammar, and
tells, token by token, what may come next. The gateway owns one matcher per request and
keeps it at the committed tokens; each step:

- the proposal, a draft model's or a model-free one, is cut before its first token the
  grammar forbids (`allowed_prefix`). This is exact: the target gives such a token
  probability 0, so it would be rejected for certain, and the positions after it would
  never be reached; cut, the step ends at that position with the bonus token drawn from
  the target's restricted distribution, which is the same law;
- the verifier gets, for each of the γ + 1 positions, the tokens the grammar allows there
  (`masks`: the matcher walks the proposal, then rolls back), and forbids the rest after
  the penalties, greedy or sampled. So the output is the target's own under the grammar,
  whatever proposed it;
- the committed tokens advance the matcher (`commit`).

The draft model proposes under the same grammar (`draft_service.grammar`: the compiled
grammar travels with each proposal request), so its tokens mostly survive the cut; a
model-free proposal is cut like any other. docs/sampling.md has the design and figures.
No gRPC here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

# vLLM's structured_outputs kinds, and OpenAI's response_format ones mapped onto them.
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 256 * 1024
# JSON as `json.dumps` writes it, with no whitespace of the model's choosing: flexible
# whitespace lets a model write blanks forever, and JSON's meaning does not depend on it
# (vLLM's --structured-outputs-config.disable_any_whitespace, xgrammar's any_whitespace=False).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructureSpec:
    """What a request's output must match: a kind of KINDS and its text (the schema as JSON,
    the regex, the choices as a JSON list, the grammar)."""

    kind: str
    source: str

    def grammar(self) -> str:
        """llguidance's grammar for the structure; ValueError naming what is wrong with it."""
        if self.kind == "json":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from exc
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                  defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not isinstance(choices, list):
                raise ValueError("choice needs a list of one or more non-empty strings")
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice needs a list of one or more non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        if self.kind == "grammar":
            # vLLM users send GBNF (xgrammar's EBNF, "::="); llguidance reads Lark.
            lark = gbnf_to_lark(self.source) if "::=" in self.source else self.source
            return llguidance.LLMatcher.grammar_from_lark(lark)
        raise ValueError(f"unknown structure kind {self.kind!r}; use one of {list(KINDS)}")


def tokenizer_for(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of the target's tokenizer, over the target's whole vocabulary (its
    logits may have more rows than the tokenizer has tokens: those are never allowed)."""
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))


def compile_structure(spec: StructureSpec, tokenizer: llguidance.LLTokenizer) -> str:
    """The checked grammar of a request's structure; ValueError with what a person can fix."""
    if len(spec.source.encode("utf-8")) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {spec.kind} is over {MAX_GRAMMAR_BYTES} bytes")
    try:
        grammar = spec.grammar()
    except ValueError:
        raise
    except Exception as exc:  # the converters' own complaints, of any type: a bad structure, not a fault
        raise ValueError(f"the {spec.kind} does not compile: {exc}") from exc
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(f"the {spec.kind} does not compile: {messages[0] if messages else 'no reason given'}")
    return grammar


class Grammar:
    """One request's matcher, kept at its committed output."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error())
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of a proposal the grammar allows after the committed ones,
        up to and with its first EOS (nothing after EOS is ever committed)."""
        if not tokens:
            return 0
        allowed = self.matcher.validate_tokens(tokens)
        return next((i + 1 for i, t in enumerate(tokens[:allowed]) if t in self.eos_token_ids), allowed)

    def masks(self, tokens: list[int]) -> torch.Tensor:
        """The allowed tokens at each of the len(tokens) + 1 positions after the committed
        ones, the proposal fed in between: int32 bitmask words [len + 1, ceil(V / 32)].
        `tokens` must be allowed (`allowed_prefix`). The row after an EOS is never read
        (the output ends there) and allows everything: the matcher does not take the EOS,
        since rolling back over it leaves it unable to take it again."""
        words = llguidance.torch.allocate_token_bitmask(len(tokens) + 1, self.vocab_size)
        taken = 0
        for i, token in enumerate(tokens):
            llguidance.torch.fill_next_token_bitmask(self.matcher, words, i)
            if token in self.eos_token_ids:
                break
            if not self.matcher.consume_token(token):
                raise AssertionError(f"the grammar refused token {token} it allowed: {self.matcher.get_error()}")
            taken += 1
        else:
            llguidance.torch.fill_next_token_bitmask(self.matcher, words, len(tokens))
        if taken:
            self.matcher.rollback(taken)
        return words

    def commit(self, tokens: list[int]) -> None:
        """The step's emitted tokens (each one allowed where it was chosen). An EOS ends the
        output: the matcher is not made to take it (after a rollback, a stopped matcher
        refuses it)."""
        tokens = [t for t in tokens if t not in self.eos_token_ids]
        if tokens and not self.matcher.consume_tokens(tokens):
            raise AssertionError(f"the grammar refused committed tokens: {self.matcher.get_error()}")
