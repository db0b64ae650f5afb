"""The gateway's text: streamed deltas concatenate to the whole decode, stop strings cut
it, and a step decodes a window of tokens, not the whole output (gateway/step/text.py)."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from gateway.step.text import TextAssembler
from specd.config import DEMO_TARGET

TEXTS = [
    "def café(naïve):\n    return '日本語 → ok' + naïve  # ünïcödé\n",
    "Speculative decoding: the draft proposes, the target verifies — exactly.\n\n  x = 1\n",
    "    for key, value in sorted(items.items()):\n        print(f\"{key!r} → {value}\")\n",
]


def sentencepiece_style(tmp_path) -> PreTrainedTokenizerFast:
    """A Llama-2-style tokenizer: "▁" for spaces, byte fallback for characters it lacks, and
    a decoder that strips the leading space a decode starts with."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    # Trained on a few words: every other character, the multi-byte ones included, comes out
    # as byte tokens, which are in the model's vocabulary (not special: a decode keeps them).
    trained.train_from_iterator(["▁the▁draft▁proposes▁and▁the▁target▁verifies▁def▁return▁for▁key"] * 8,
                                trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    vocab = trained.get_vocab()
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges: list[tuple[str, str]] = [(pair[0], pair[1]) for pair in (
        p.split(" ") if isinstance(p, str) else p for p in json.loads(trained.to_str())["model"]["merges"])]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "<eos>"])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    wrapped.save_pretrained(tmp_path)
    return wrapped


@pytest.fixture(params=["byte-level BPE (the demo's)", "SentencePiece style"])
def tokenizer(request, tmp_path):
    if request.param.startswith("byte"):
        return AutoTokenizer.from_pretrained(DEMO_TARGET)
    return sentencepiece_style(tmp_path)


def stream(assembler: TextAssembler, ids: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """Feed ids in steps of 1–5 tokens, as speculative steps emit them: (streamed text, tokens kept)."""
    text, kept, at = "", [], 0
    while at < len(ids) and not assembler.stopped:
        step = ids[at:at + rng.randint(1, 5)]
        at += len(step)
        delta, step_kept = assembler.add(step)
        text += delta
        kept += step_kept
    return text + assembler.finish(), kept


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_concatenates_to_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        assert stream(TextAssembler(tokenizer, []), ids, rng) == (whole, ids)


@pytest.mark.parametrize("seed", range(4))
def test_a_stop_string_cuts_the_text_and_the_tokens(tokenizer, seed):
    rng = random.Random(seed)
    # A stop string at the very start, longer than the text of the first steps.
    for text, stop in [(TEXTS[0], "→"), (TEXTS[1], "target"), (TEXTS[2], "print"), (TEXTS[1], "Speculative decoding")]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        streamed, kept = stream(TextAssembler(tokenizer, [stop, "never there"]), ids, rng)
        whole_kept = tokenizer.decode(kept, skip_special_tokens=True)
        assert stop in whole_kept and stop not in tokenizer.decode(kept[:-1], skip_special_tokens=True)
        assert streamed == whole_kept[:whole_kept.index(stop)]


def test_half_a_character_does_not_use_up_the_hold_of_a_stop_string(tokenizer):
    """"é" is two bytes, so it may come in two tokens: while half of it is in, "caf" must
    still be held, since it may be the start of the stop string "café"."""
    assembler = TextAssembler(tokenizer, ["café"])
    streamed = "".join(assembler.add([token])[0] for token in tokenizer.encode("the café", add_special_tokens=False))
    assert assembler.stopped and streamed + assembler.finish() == "the "


def test_a_step_decodes_a_window_not_the_whole_output(tokenizer):
    """After 2,000 tokens a step decodes about as many tokens as after 20: the cost of a
    step does not grow with the output."""
    decoded: list[int] = []
    original = tokenizer.decode

    def counting(ids, **kwargs):
        decoded.append(len(ids))
        return original(ids, **kwargs)

    tokenizer.decode = counting
    ids = tokenizer.encode(TEXTS[1] * 200, add_special_tokens=False)[:2000]
    assembler = TextAssembler(tokenizer, ["never there"])
    for at in range(0, len(ids), 2):
        decoded.clear()
        assembler.add(ids[at:at + 2])
    assert max(decoded) <= 8, decoded
    released = assembler.text[:assembler.released]
    assert released + assembler.finish() == original(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(3))
def test_min_tokens_holds_stop_strings_back(tokenizer, seed):
    """As vLLM: a stop string counts only where it ends in the text of min_tokens tokens or
    more; one that ends before is text like any other."""
    text = "stop here, then go on and stop again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    first = len(tokenizer.encode("stop", add_special_tokens=False))
    streamed, kept = stream(TextAssembler(tokenizer, ["stop"], min_tokens=first), ids, random.Random(seed))
    assert streamed == ""  # the first "stop" ends in its own min_tokens-th token: it counts
    streamed, kept = stream(TextAssembler(tokenizer, ["stop"], min_tokens=first + 1), ids, random.Random(seed))
    assert streamed == "stop here, then go on and "
    kept_text = tokenizer.decode(kept, skip_special_tokens=True)
    assert kept_text.count("stop") == 2 and kept_text.rstrip().endswith("stop")  # up to the second


def test_the_stop_string_kept_in_the_text_when_asked(tokenizer):
    """vLLM's include_stop_str_in_output: the text ends after the stop string, streamed or not."""
    text = "first line\nsecond line\nthird"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for seed in range(3):
        streamed, kept = stream(TextAssembler(tokenizer, ["\n"], include_stop=True), ids, random.Random(seed))
        assert streamed == "first line\n"


def test_special_tokens_in_the_text_when_asked(tokenizer):
    special = tokenizer.eos_token
    ids = tokenizer.encode("one", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert stream(TextAssembler(tokenizer, []), ids, random.Random(0))[0] == "one"
    assert stream(TextAssembler(tokenizer, [], skip_special_tokens=False), ids, random.Random(0))[0] == "one" + special
