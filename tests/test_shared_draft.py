"""A draft made from its target alone (`specd distill` with no --draft): it shares the
target's embedding, read at load and checked by digest, and proposes from part of the
vocabulary (`specd.worker.sharing`).

Made here on the suite's tiny target (acceptance does not matter for exactness): served
through the three services on loopback, greedy output is transformers' `generate`'s and
sampled output follows the target's law, although the draft can never propose half the
tokens. Then `specd distill` makes one from a tiny tied target and raises its agreement.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from conftest import CORPUS, make_tokenizer, request, start_stack
from specd.worker import sharing
from specd_cli import distill
from test_sampled_distribution import PROMPT, TRANSFORM, assert_follows_joint, target_joint


@pytest.fixture(scope="module")
def shared_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    """model_dirs with "shared": a one-layer draft built from the target's first layer,
    its embedding shared, proposing only the even token ids (and EOS)."""
    target = AutoModelForCausalLM.from_pretrained(model_dirs["target"], dtype=torch.float32)
    eos = int(target.config.eos_token_id)
    vocabulary = sorted({*range(0, target.config.vocab_size, 2), eos})
    out = tmp_path_factory.mktemp("shared") / "shared"
    draft = sharing.build(target, [0], vocabulary)
    sharing.save(draft, out, model_dirs["target"], "target", torch.float32)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((model_dirs["target"] / name).read_bytes())
    return {**model_dirs, "shared": out}


@pytest.fixture(scope="module")
def shared_stack(shared_dirs):
    stack = start_stack(shared_dirs, drafts=("shared",), draft_base=shared_dirs["target"])
    yield stack
    stack.close()


def test_the_draft_keeps_only_its_own_layers_and_proposes_only_its_vocabulary(shared_dirs):
    with safe_open(str(shared_dirs["shared"] / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" not in names and not any(n.startswith("lm_head") for n in names)
    assert "model.layers.0.mlp.up_proj.weight" in names and "model.layers.1.mlp.up_proj.weight" not in names
    draft = sharing.load(shared_dirs["shared"], torch.float32, shared_dirs["target"])
    logits = draft(torch.tensor([[5, 6, 7]])).logits[0, -1]
    odd = torch.arange(1, logits.shape[0], 2)
    odd = odd[odd != draft.config.eos_token_id]
    assert (logits[odd] == sharing.OUT_OF_VOCABULARY).all() and (logits[::2] > sharing.OUT_OF_VOCABULARY).all()
    assert (logits.softmax(-1)[odd] == 0).all()


def test_a_shared_draft_loads_only_beside_the_target_it_was_made_for(shared_dirs):
    with pytest.raises(ValueError, match="--draft-base TARGET"):
        sharing.load(shared_dirs["shared"], torch.float32, None)
    with pytest.raises(ValueError, match="is not the target the draft .* was made for"):
        sharing.load(shared_dirs["shared"], torch.float32, shared_dirs["close"])


def test_greedy_output_with_a_shared_draft_is_generates(shared_stack, shared_dirs, tokenizer):
    target = AutoModelForCausalLM.from_pretrained(shared_dirs["target"], dtype=torch.float32).eval()
    for prompt in ("def fibonacci(n):", "class Stack:\n    def push(self, item):"):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                    eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
        response = shared_stack.stub.Generate(request(prompt, max_new_tokens=24, draft_length=4))
        assert list(response.token_ids) == expected[:len(response.token_ids)]
        assert len(response.token_ids) == 24 or response.token_ids[-1] == tokenizer.eos_token_id
        assert response.stats.proposed_tokens > 0  # the draft proposed: speculation ran


def test_sampled_output_with_a_shared_draft_follows_the_target(shared_stack, shared_dirs, tokenizer):
    """Half the tokens the target may draw are ones the draft never proposes (q = 0): they
    come only from recovered draws, which must make up exactly the mass q lacks."""
    target = AutoModelForCausalLM.from_pretrained(shared_dirs["target"], dtype=torch.float32).eval()
    joint = target_joint(target, tokenizer)
    assert any(t1 % 2 for t1, _ in joint) and any(t1 % 2 == 0 for t1, _ in joint)
    trials = 1500

    def sample(seed: int) -> tuple[int, int]:
        response = shared_stack.stub.Generate(request(PROMPT, temperature=TRANSFORM.temperature,
                                                      top_k=TRANSFORM.top_k, seed=seed, max_new_tokens=5,
                                                      draft_length=4))
        return tuple(response.token_ids[:2])

    with ThreadPoolExecutor(4) as pool:
        counts = Counter(pool.map(sample, range(1, trials + 1)))
    assert_follows_joint(counts, joint, trials)


# -- specd distill with no --draft ----------------------------------------------------------

CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}>>> {% endif %}")


def test_distill_makes_a_draft_from_the_target_alone(tmp_path):
    tok = make_tokenizer(tmp_path / "tokenizer")
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(1)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True, initializer_range=0.1))
    with torch.no_grad():  # sharpen the target's distributions, so that there is something to learn
        target.model.norm.weight.mul_(6.0)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    # Requests: runs of the corpus's words, 3 to 8 long, from all over it. A random target's
    # answers to other requests follow no pattern a draft could learn, so the draft is
    # measured on the requests it trained on: this checks that it learns what it is shown
    # (sampling, its vocabulary, the loss, saving and loading), not how far that carries.
    words = CORPUS.split()
    lines = [" ".join(words[(7 * i) % (len(words) - 8):][:3 + i % 6]) for i in range(16)]
    (tmp_path / "questions.txt").write_text("\n".join(lines))
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    out = tmp_path / "draft"
    args = parser.parse_args([
        "--target", str(tmp_path / "target"), "--questions", str(tmp_path / "questions.txt"),
        "--eval-questions", str(tmp_path / "questions.txt"), "--out", str(out), "--layers", "1",
        "--draft-vocabulary", "160", "--time-budget", "15", "--samples", "128", "--sample-batch-size", "16",
        "--new-tokens", "24", "--eval-prompts", "16", "--eval-new-tokens", "16", "--batch-size", "16",
        "--lr", "3e-3", "--threads", "1"])
    assert distill.run(args) == 0
    report = json.loads((out / "distill_report.json").read_text())
    before, after = report["before"]["chat"], report["after"]["chat"]
    assert after["greedy_match"] > before["greedy_match"] + 0.1, report
    assert report["kl_last"] < report["kl_first"] / 5
    manifest = json.loads((out / sharing.MANIFEST).read_text())
    # The tokens the target emitted, at most 160, EOS among them.
    assert 40 < len(manifest["vocabulary"]) <= 160 and tok.eos_token_id in manifest["vocabulary"]
    assert manifest["shared"] == ["model.embed_tokens.weight"]
    draft = sharing.load(out, torch.float32, tmp_path / "target")
    assert draft.config.num_hidden_layers == 1
    assert (out / "model.safetensors").stat().st_size < (tmp_path / "target" / "model.safetensors").stat().st_size / 3


def test_the_shipped_smollm2_draft_is_what_its_manifest_says():
    """models/smollm2-draft: four layers of its own in bfloat16, SmolLM2's embedding shared
    (not stored), 8,192 tokens proposed, EOS (<|im_end|>, id 2) among them. Served beside
    the GGUF file from PyPI (scripts/fetch_smollm2.sh), it loads only if that file's
    embedding has the manifest's digest."""
    draft = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"
    manifest = json.loads((draft / sharing.MANIFEST).read_text())
    config = json.loads((draft / "config.json").read_text())
    assert manifest["shared"] == ["model.embed_tokens.weight"] and len(manifest["digest"]) == 64
    assert len(manifest["vocabulary"]) == 8192 and 2 in manifest["vocabulary"]
    assert config["num_hidden_layers"] == 4 and config["vocab_size"] == 49152
    with safe_open(str(draft / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
        assert weights.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert names == {"model.norm.weight"} | {f"model.layers.{i}.{part}" for i in range(4) for part in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight")}
