"""The corpus proposer: an n-gram table of the target's own answers (gateway.proposers.corpus),
its file, `specd corpus`, and a gateway drafting from it on loopback."""
from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import LoopThread, request
from gateway.app import create_server as create_gateway
from gateway.proposers.corpus import Corpus, NGramTable, check_corpus, read_corpus, write_corpus
from gateway.settings import GatewaySettings
from specd.config import ServerSettings
from specd.contract import CORPUS
from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd.worker.runtime import tokenizer_fingerprint
from test_sampled_distribution import TRANSFORM, assert_follows_joint, target_joint

PROMPT = "def fibonacci(n):"


def test_the_table_follows_the_most_frequent_continuation_of_the_longest_context():
    table = NGramTable([np.array([1, 2, 3, 4]), np.array([1, 2, 3, 5]), np.array([9, 2, 3, 5]),
                        np.array([7, 8])])
    # After (2, 3): 5 twice, 4 once; the share counts one unseen occurrence beside the three.
    assert table.follow([2, 3], 1, 0.0) == ([5], [2 / 4])
    # (1, 2, 3) was followed by 4 once and 5 once: the longest context decides, not (2, 3)'s
    # 5, and a tie goes to the lower id.
    assert table.follow([1, 2, 3], 1, 0.0) == ([4], [1 / 3])
    # A context seen once says nothing: (7,) is followed only once, and nothing else ends in 7.
    assert table.follow([7], 4, 0.0) == ([], [])
    # From 1 the table walks 2, then 3, then (1, 2, 3)'s 4, and stops: (2, 3, 4) was seen once.
    assert table.follow([1], 5, 0.0) == ([2, 3, 4], [2 / 3, 2 / 3, 1 / 3])
    # It stops where the running product of shares falls below the floor.
    assert table.follow([1], 4, 0.4)[0] == [2, 3]


def test_the_table_keeps_token_ids_of_any_real_vocabulary():
    """Ids past 2^15 (SmolLM2's 49,152 tokens) and 2^17 (Llama 3's 128,256) come back as
    they went in, with their counts."""
    big = [40_000, 150_000, 128_255, 7]
    table = NGramTable([np.array(big), np.array(big)])
    assert table.follow([40_000], 3, 0.0) == ([150_000, 128_255, 7], [2 / 3] * 3)


def test_the_table_drops_contexts_seen_fewer_times_than_its_support():
    sequences = [np.array([1, 2, 3]), np.array([1, 2, 4])]
    assert NGramTable(sequences, min_support=3).follow([1, 2], 2, 0.0) == ([], [])
    assert NGramTable(sequences, min_support=2).follow([1], 1, 0.0) == ([2], [2 / 3])


def test_a_corpus_file_round_trips_and_a_foreign_file_is_refused(tmp_path):
    corpus = Corpus([np.array([5, 6, 7], dtype=np.int32), np.array([8], dtype=np.int32)], "f" * 64, "a test")
    path = tmp_path / "corpus.safetensors"
    write_corpus(path, corpus)
    read = read_corpus(path)
    assert [s.tolist() for s in read.sequences] == [[5, 6, 7], [8]]
    assert (read.tokenizer_fingerprint, read.source, read.tokens) == ("f" * 64, "a test", 4)

    other = tmp_path / "weights.safetensors"
    save_file({"weight": np.zeros(3, dtype=np.float32)}, str(other))
    with pytest.raises(ValueError, match="is not a specd corpus"):
        read_corpus(other)
    text = tmp_path / "notes.txt"
    text.write_text("not tensors")
    with pytest.raises(ValueError, match="cannot read the corpus"):
        read_corpus(text)
    with pytest.raises(ValueError, match="cannot read the corpus"):
        read_corpus(tmp_path / "missing.safetensors")
    damaged = tmp_path / "damaged.safetensors"
    save_file({"tokens": np.zeros(3, dtype=np.int32), "starts": np.array([0, 5])}, str(damaged),
              metadata={"format": "specd-corpus/1"})
    with pytest.raises(ValueError, match="is damaged"):
        read_corpus(damaged)


def test_a_corpus_of_another_tokenizer_or_past_the_vocabulary_is_refused():
    corpus = Corpus([np.array([1, 2, 300], dtype=np.int32)], "a" * 64, "")
    assert check_corpus(corpus, Path("c"), "a" * 64, 301) is None
    assert "tokenizer" in check_corpus(corpus, Path("c"), "b" * 64, 301)
    assert "past the target's vocabulary" in check_corpus(corpus, Path("c"), "a" * 64, 300)
    assert "holds no answers" in check_corpus(Corpus([], "a" * 64, ""), Path("c"), "a" * 64, 301)


def test_the_corpus_proposer_needs_a_file():
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0), model_free=(CORPUS,))
    assert any("--corpus FILE" in problem for problem in settings.problems())
    hosted = GatewaySettings(ServerSettings("127.0.0.1", 0), corpus=Path("c.safetensors")).hosted_model_free
    assert hosted == (CORPUS,)


def greedy(model, tokenizer, prompt: str, new_tokens: int) -> list[int]:
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False)
    return out[0, ids["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def corpus_file(model_dirs, tokenizer, tmp_path_factory) -> Path:
    """The target's own greedy answer to PROMPT, with the prompt before it, twice (so every
    context in it is seen twice: the table's support)."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
    answer = tokenizer(PROMPT)["input_ids"] + greedy(model, tokenizer, PROMPT, 48)
    path = tmp_path_factory.mktemp("corpus") / "corpus.safetensors"
    write_corpus(path, Corpus([np.array(answer, dtype=np.int32)] * 2, tokenizer_fingerprint(tokenizer), "test"))
    return path


def start_gateway(stack, **options):
    loop = LoopThread()
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                               verifier_address=f"127.0.0.1:{stack.verifier.port}",
                               draft_address=f"127.0.0.1:{stack.draft.port}", **options)
    return loop, loop.run(create_gateway(settings))


@pytest.fixture(scope="module")
def corpus_gateway(stack, corpus_file):
    """A gateway beside the stack's, on its workers, hosting the corpus proposer alone."""
    loop, server = start_gateway(stack, corpus=corpus_file)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield gateway_pb2_grpc.GatewayStub(channel)
    channel.close()
    loop.run(server.stop(0))
    loop.close()


@pytest.mark.parametrize("mode,draft_model", [("AUTO", ""), ("AUTO", CORPUS), ("FIXED", CORPUS)])
def test_drafting_from_the_corpus_gives_the_targets_greedy_output(corpus_gateway, model_dirs, tokenizer, mode,
                                                                  draft_model):
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"]).eval()
    expected = greedy(model, tokenizer, PROMPT, 40)
    response = corpus_gateway.Generate(request(PROMPT, max_new_tokens=40, mode=mode, draft_model=draft_model))
    assert list(response.token_ids) == expected[:len(response.token_ids)]
    assert len(response.token_ids) == 40 or response.finish_reason == gateway_pb2.FINISH_REASON_EOS
    stats = response.stats
    corpus_steps = [i for i, p in enumerate(stats.proposers) if p == CORPUS]
    # The corpus holds this very answer, so its proposals are mostly the target's tokens (not
    # all: this random target's answer repeats itself, so a context may have been followed
    # two ways).
    proposed = sum(stats.draft_lengths[i] for i in corpus_steps)
    assert corpus_steps and sum(stats.accepted_lengths[i] for i in corpus_steps) >= 0.75 * proposed


def test_gateway_info_lists_the_corpus_proposer(corpus_gateway):
    info = corpus_gateway.GetGatewayInfo(gateway_pb2.GatewayInfoRequest())
    assert {d.name for d in info.drafts if d.model_free} == {CORPUS}


def test_sampled_output_drafted_from_the_corpus_follows_the_target(corpus_gateway, target_model, tokenizer):
    """q is one-hot for a corpus proposal: rejection sampling must still give the target's law."""
    joint = target_joint(target_model, tokenizer, PROMPT)
    trials = 1500
    drafted: list[int] = []

    def sample(seed: int) -> tuple[int, ...]:
        req = request(PROMPT, temperature=TRANSFORM.temperature, top_k=TRANSFORM.top_k, seed=seed,
                      max_new_tokens=3, mode="FIXED", draft_length=2, draft_model=CORPUS)
        response = corpus_gateway.Generate(req)
        drafted.append(response.stats.draft_lengths[0])
        return tuple(response.token_ids[:2])

    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    assert sum(d > 0 for d in drafted) > 0.9 * trials  # the first step verified a proposal
    assert_follows_joint(counts, joint, trials)


def test_a_gateway_refuses_a_corpus_written_with_another_tokenizer(stack, model_dirs, tmp_path):
    alien = AutoTokenizer.from_pretrained(model_dirs["alien"])
    path = tmp_path / "alien.safetensors"
    write_corpus(path, Corpus([np.array([1, 2, 3], dtype=np.int32)], tokenizer_fingerprint(alien), "alien"))
    loop = LoopThread()
    settings = GatewaySettings(ServerSettings("127.0.0.1", 0, grace_s=0.5),
                               verifier_address=f"127.0.0.1:{stack.verifier.port}",
                               draft_address=f"127.0.0.1:{stack.draft.port}", corpus=path)
    try:
        with pytest.raises(ValueError, match="written with tokenizer .* its token ids would mean other tokens"):
            loop.run(create_gateway(settings))
    finally:
        loop.close()
    # The stack's own gateway serves on.
    assert stack.stub.Generate(request(PROMPT, max_new_tokens=4)).token_ids


def test_specd_corpus_writes_the_targets_greedy_answers(model_dirs, tmp_path):
    from specd_cli import corpus as corpus_cli

    target = tmp_path / "chat-target"
    model = AutoModelForCausalLM.from_pretrained(model_dirs["target"])
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}" \
                              "{% if add_generation_prompt %}<assistant>{% endif %}"
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    questions = tmp_path / "questions.txt"
    questions.write_text("def fibonacci(n):\nclass Cache:\n\nreturn a + b\n")
    out = tmp_path / "corpus.safetensors"
    assert corpus_cli.main(["--target", str(target), "--questions", str(questions), "--out", str(out),
                            "--new-tokens", "8", "--prompt-tail", "4", "--batch-size", "2"]) == 0
    corpus = read_corpus(out)
    assert corpus.tokenizer_fingerprint == tokenizer_fingerprint(tokenizer) and len(corpus.sequences) == 3
    model.eval()
    rendered = {}
    for question in ("def fibonacci(n):", "class Cache:", "return a + b"):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            answer = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        if tokenizer.eos_token_id in answer:
            answer = answer[:answer.index(tokenizer.eos_token_id) + 1]
        rendered[json.dumps(prompt[-4:] + answer)] = question
    # Batched and left-padded, each answer is the one generate gives the request alone.
    assert {json.dumps(s.tolist()) for s in corpus.sequences} == set(rendered)


def test_specd_corpus_refuses_what_it_cannot_answer(model_dirs, tmp_path, capsys):
    from specd_cli import corpus as corpus_cli

    questions = tmp_path / "questions.txt"
    questions.write_text("hello\n")
    out = tmp_path / "c.safetensors"
    assert corpus_cli.main(["--target", str(model_dirs["target"]), "--questions", str(questions),
                            "--out", str(out)]) == 2
    assert "no chat template" in capsys.readouterr().err
    assert corpus_cli.main(["--target", str(model_dirs["target"]), "--questions", str(questions),
                            "--out", str(out), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err and not out.exists()
