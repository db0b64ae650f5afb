"""Compiled grammars (`specd.grammars`): each grammar text compiled once, refusals kept,
llguidance's limits on every matcher; and the gateway's per-request matcher
(`gateway.grammar.Grammar`) keeping a forbidden proposed token as a certain rejection."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import llguidance
import pytest

import specd.grammars
from gateway.grammar import Grammar, tokenizer_for
from specd.grammars import CompiledGrammars, GrammarError
from specd.sampling import allowed_from_words

CHOICES = 'start: "ab" | "abba"'


@pytest.fixture
def compiled(tokenizer) -> CompiledGrammars:
    return CompiledGrammars(lambda: tokenizer_for(tokenizer, len(tokenizer), (tokenizer.eos_token_id,)),
                            len(tokenizer))


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The grammars llguidance is asked to compile, in order."""
    made: list[str] = []
    real = llguidance.LLMatcher

    def counting(tokenizer, grammar, **options):
        made.append(grammar)
        return real(tokenizer, grammar, **options)

    monkeypatch.setattr(specd.grammars.llguidance, "LLMatcher", counting)
    return made


def test_a_repeated_grammar_compiles_once_and_each_caller_gets_its_own_matcher(compiled, compiles, tokenizer):
    first, second = compiled.matcher(CHOICES), compiled.matcher(CHOICES)
    assert compiles == [CHOICES]
    ab = tokenizer.encode("ab")
    assert first.consume_tokens(ab)
    assert second.validate_tokens(tokenizer.encode("abba")) == len(tokenizer.encode("abba"))  # still at the start
    with ThreadPoolExecutor(4) as pool:  # callers on several threads at once still compile it once
        list(pool.map(compiled.matcher, ['start: "x"'] * 8))
    assert compiles == [CHOICES, 'start: "x"']


def test_a_refused_grammar_stays_refused_without_compiling_again(tokenizer, compiles):
    over_budget = CompiledGrammars(lambda: tokenizer_for(tokenizer, len(tokenizer), (tokenizer.eos_token_id,)),
                                   len(tokenizer), compile_budget_s=0.0)
    for _ in range(2):
        with pytest.raises(GrammarError, match="over this server's budget of 0 s"):
            over_budget.matcher(CHOICES)
    assert compiles == [CHOICES]


def test_a_grammar_past_a_limit_mid_output_is_an_error_not_an_end(compiled, tokenizer, monkeypatch):
    """A matcher past one of llguidance's limits would allow nothing but EOS: the output
    would end early and look finished. The gateway's matcher raises instead."""
    monkeypatch.setattr(specd.grammars, "LIMITS", llguidance.LLParserLimits(max_items_in_row=20))
    ambiguous = 'start: s\ns: s s | s s s | "a" | "b"\n'
    grammar = Grammar(compiled.matcher(ambiguous), len(tokenizer), frozenset([tokenizer.eos_token_id]), 1e9,
                      ThreadPoolExecutor(1))
    a = tokenizer.convert_tokens_to_ids("a")
    with pytest.raises(GrammarError, match="max is 20"):
        for _ in range(50):
            grammar.follow([a])
            grammar.commit([a])


def test_a_forbidden_proposed_token_is_kept_as_the_last_one_verified(compiled, tokenizer):
    """Kept, the target rejects it for certain and the step draws from the residual; the
    rows after it are never read. Allowed tokens after the first EOS are dropped."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    grammar = Grammar(compiled.matcher('start: "ab" "ba"'), vocab, frozenset([eos]), 1e9, ThreadPoolExecutor(1))
    a, b = tokenizer.convert_tokens_to_ids(["a", "b"])
    kept, words = grammar.follow([a, b, b, b, a])  # "abb", then a forbidden "b"
    assert kept == 4 and words.shape[0] == 5
    rows = allowed_from_words(words, vocab)
    assert rows[0, a] and not rows[0, b] and rows[3, a] and not rows[3, b]
    assert rows[4].all()  # after the forbidden token: never read
    grammar.commit([a, b])
    kept, words = grammar.follow([b, a, eos, a])
    assert kept == 3 and allowed_from_words(words, vocab)[2, eos]
