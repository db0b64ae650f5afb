"""llguidance (what specd's gateway and draft use) against xgrammar (what vLLM, SGLang and
TensorRT-LLM use by default), on the work a speculative step gives a grammar engine.

    pip install xgrammar    # not one of specd's dependencies
    python scripts/compare_grammar_engines.py [--model models/demo/target] [--gamma 4]

For each structure: the compile time (schema to a matcher ready for the first token), and
the time per output token of what the gateway does each step: the bitmask at each of the
γ + 1 positions of a proposal (walking the proposal, then rolling back), then committing
the accepted tokens. The output is a fixed valid instance, tokenized by the target's
tokenizer; every proposal is taken whole (the most mask work per step). Both engines see
the same tokens and write the same 32-bit bitmask layout; the rows where their masks
differ are counted (their JSON grammars differ at the edges: which characters a string may
hold unescaped, which token splits of a fixed key they allow). Prints the medians of
`--repeats` runs, side by side, with the ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar  # type: ignore[import-not-found]  # not a dependency: installed to compare
from transformers import AutoTokenizer

from gateway.grammar import JSON_OPTIONS
from specd.config import DEMO_TARGET

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "email", "tags"]}
ORDER = {"type": "object", "properties": {
    "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}},
        "required": ["sku", "qty", "price"]}},
    "note": {"type": "string"}}, "required": ["id", "status", "items", "note"]}
CASES: list[tuple[str, dict, dict]] = [
    ("json_schema person", PERSON, {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                                    "tags": ["maths", "engines", "poetry"]}),
    ("json_schema order", ORDER, {"id": 4412, "status": "paid", "items": [
        {"sku": "A-17", "qty": 2, "price": 9.5}, {"sku": "B-3", "qty": 1, "price": 120.25},
        {"sku": "C-99", "qty": 12, "price": 0.75}], "note": "leave at the door, please"}),
    ("json_object", {"type": "object"}, {"city": "Lyon", "population": 522250, "rivers": ["Rhone", "Saone"]}),
]


class Engine:
    """One engine's compile, and one request's matcher: mask a proposal's positions, commit."""

    def __init__(self, name: str, compile_schema, matcher_of) -> None:
        self.name, self.compile_schema, self.matcher_of = name, compile_schema, matcher_of


def llguidance_engine(hf_tokenizer, vocab: int, eos: int) -> Engine:
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=eos)

    def compile_schema(schema: dict):
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]

    def matcher_of(grammar: str):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

        def step(tokens: list[int], words: torch.Tensor) -> None:
            for i, token in enumerate(tokens):
                llguidance.torch.fill_next_token_bitmask(matcher, words, i)
                assert matcher.consume_token(token), matcher.get_error()
            llguidance.torch.fill_next_token_bitmask(matcher, words, len(tokens))
            matcher.rollback(len(tokens))
            assert matcher.consume_tokens(tokens)
        return step

    return Engine("llguidance", compile_schema, matcher_of)


def xgrammar_engine(hf_tokenizer, vocab: int, eos: int) -> Engine:
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile_schema(schema: dict):
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(JSON_OPTIONS["item_separator"],
                                                        JSON_OPTIONS["key_separator"]))

    def matcher_of(compiled):
        matcher = xgrammar.GrammarMatcher(compiled)

        def step(tokens: list[int], words: torch.Tensor) -> None:
            for i, token in enumerate(tokens):
                matcher.fill_next_token_bitmask(words, i)
                assert matcher.accept_token(token)
            matcher.fill_next_token_bitmask(words, len(tokens))
            matcher.rollback(len(tokens))
            for token in tokens:
                assert matcher.accept_token(token)
        return step

    return Engine("xgrammar", compile_schema, matcher_of)


def run(engine: Engine, schema: dict, tokens: list[int], gamma: int, vocab: int) -> tuple[float, float, list]:
    """(ms to compile and make a matcher, ms per output token of the steps, every step's masks)."""
    began = time.perf_counter()
    step = engine.matcher_of(engine.compile_schema(schema))
    compiled = time.perf_counter() - began
    masks = []
    began = time.perf_counter()
    for start in range(0, len(tokens), gamma + 1):
        proposal = tokens[start:start + gamma]
        words = torch.zeros(len(proposal) + 1, (vocab + 31) // 32, dtype=torch.int32)
        step(proposal, words)
        masks.append(words)
        if start + gamma < len(tokens):  # the bonus token
            step_bonus = tokens[start + gamma:start + gamma + 1]
            step(step_bonus, torch.zeros(2, (vocab + 31) // 32, dtype=torch.int32))
    stepped = time.perf_counter() - began
    return compiled * 1e3, stepped * 1e3 / len(tokens), masks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_TARGET))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    hf_tokenizer = AutoTokenizer.from_pretrained(args.model)
    vocab, eos = len(hf_tokenizer), hf_tokenizer.eos_token_id
    engines = [llguidance_engine(hf_tokenizer, vocab, eos), xgrammar_engine(hf_tokenizer, vocab, eos)]
    print(f"{args.model}: vocabulary {vocab}, γ = {args.gamma}, medians of {args.repeats} runs")
    print(f"{'structure':<20} {'tokens':>6} | {'compile ms':>10} {'ll':>8} {'xg':>8} {'ll/xg':>6} | "
          f"{'µs per token':>12} {'ll':>8} {'xg':>8} {'ll/xg':>6}")
    for name, schema, instance in CASES:
        text = json.dumps(instance)
        tokens = hf_tokenizer.encode(text, add_special_tokens=False)
        figures = {}
        for engine in engines:
            runs = [run(engine, schema, tokens, args.gamma, vocab) for _ in range(args.repeats)]
            figures[engine.name] = (statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                                    runs[0][2])
        rows = [(a, b) for x, y in zip(figures["llguidance"][2], figures["xgrammar"][2]) for a, b in zip(x, y)]
        differing = sum(not torch.equal(a, b) for a, b in rows)
        (lc, ls, _), (xc, xs, _) = figures["llguidance"], figures["xgrammar"]
        print(f"{name:<20} {len(tokens):>6} | {'':>10} {lc:>8.2f} {xc:>8.2f} {lc / xc:>6.2f} | "
              f"{'':>12} {ls * 1e3:>8.1f} {xs * 1e3:>8.1f} {ls / xs:>6.2f}   "
              f"mask rows differing: {differing} of {len(rows)}")


if __name__ == "__main__":
    main()
