"""`specd distill` on a tiny pair, and the shipped demo pair's claims."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specd.devices import bf16_is_fast
from specd_cli import distill

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "models" / "demo"

TEXT = "\n".join(
    f"def handle_{w}(request, {a}):\n    \"\"\"Handle the {w} of {a}.\"\"\"\n"
    f"    if {a} is None:\n        return request.{w}()\n    return {a}.{w}(request)\n"
    for w in ("open", "close", "read", "write", "seek", "flush", "send", "recv")
    for a in ("socket", "stream", "buffer", "channel", "path"))


def _tokenizer(tmp: Path, text: str, vocab: int):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=vocab, min_frequency=1,
                            special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|endoftext|>")


def _model(tok, hidden: int, layers: int, seed: int, sharpen: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, eos_token_id=tok.eos_token_id))
    with torch.no_grad():
        # A random model's next-token distributions are nearly uniform, which any
        # draft matches; sharpen the target so there is something to learn.
        model.lm_head.weight.mul_(sharpen)
    return model


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    tok = _tokenizer(tmp, TEXT, 300)
    for name, hidden, layers, seed, sharpen in (("target", 64, 2, 1, 8.0), ("draft", 32, 1, 2, 1.0)):
        _model(tok, hidden, layers, seed, sharpen).save_pretrained(tmp / name)
        tok.save_pretrained(tmp / name)
    (tmp / "data.txt").write_text(TEXT * 3)
    return tmp


def _args(pair: Path, out: Path, **over) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    distill.add_arguments(p)
    argv = ["--target", str(pair / "target"), "--draft", str(pair / "draft"),
            "--data", str(pair / "data.txt"), "--out", str(out), "--time-budget", "12",
            "--samples", "256", "--prompt-tokens", "8", "--new-tokens", "24",
            "--eval-prompts", "32", "--eval-new-tokens", "16", "--batch-size", "32",
            "--lr", "3e-3", "--threads", "1"]
    for k, v in over.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


@pytest.mark.parametrize("divergence", distill.DIVERGENCES)
def test_distill_raises_acceptance_and_resumes(tiny_pair, tmp_path, capsys, divergence):
    out = tmp_path / "distilled"
    assert distill.run(_args(tiny_pair, out, divergence=divergence)) == 0
    report = json.loads((out / "distill_report.json").read_text())
    assert report["divergence"] == divergence
    # bf16 autocast only where this CPU has bfloat16 kernels: emulated, it is 80x slower than float32
    assert report["sampling_dtype"] == ("bf16-autocast" if bf16_is_fast(torch.device("cpu")) else "float32")
    before, after = report["before"]["data"], report["after"]["data"]
    assert after["alpha"] > before["alpha"] + 0.1, report
    assert after["greedy_match"] > before["greedy_match"] + 0.1, report
    assert after["tokens_per_step"] > before["tokens_per_step"], report
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    # The draft's card carries its held-out acceptance, where a gateway first prices its load cap.
    assert json.loads((out / "card.json").read_text())["acceptance_vs_target"] == report["after"]
    # A second run finds every stage checkpointed and only re-measures.
    assert distill.run(_args(tiny_pair, out, divergence=divergence)) == 0
    again = json.loads((out / "distill_report.json").read_text())
    assert again["steps"] == report["steps"] and again["samples"] == report["samples"]
    assert again["after"]["data"]["greedy_match"] == pytest.approx(after["greedy_match"], abs=0.02)
    # Resuming under the other objective would mix two trainings in one report: refused.
    other = next(d for d in distill.DIVERGENCES if d != divergence)
    capsys.readouterr()
    assert distill.run(_args(tiny_pair, out, divergence=other)) == 2
    assert f"trained with --divergence {divergence}" in capsys.readouterr().err


def test_distill_refuses_different_tokenizers(tiny_pair, tmp_path, capsys):
    other = tmp_path / "other"
    tok = _tokenizer(tmp_path, TEXT.upper(), 300)
    _model(tok, 32, 1, 3).save_pretrained(other)
    tok.save_pretrained(other)
    args = _args(tiny_pair, tmp_path / "out")
    args.draft = str(other)
    assert distill.run(args) == 2
    assert "do not share a tokenizer" in capsys.readouterr().err


def test_tvd_loss_is_the_rejection_rate_on_the_partition():
    """The tvd loss is 1 − Σ min(p, q) over the target's top-k tokens plus the tail bucket,
    and with every token kept (k = V) it is exactly 1 − α of speculative sampling."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=gen)
    p_full = torch.softmax(2 * torch.randn(3, 5, 40, generator=gen), -1)
    q_full = torch.softmax(logits, -1)
    for k in (8, 40):
        top_probs, top_ids = p_full.topk(k, -1)
        loss, kl = distill._distill_loss(logits, top_ids, top_probs, "tvd")
        q_top = q_full.gather(-1, top_ids)
        alpha = torch.minimum(top_probs, q_top).sum(-1) + torch.minimum(1 - top_probs.sum(-1), 1 - q_top.sum(-1))
        assert float(loss) == pytest.approx(float((1 - alpha).mean()), abs=1e-5)
        if k == 40:
            assert float(loss) == pytest.approx(float(1 - torch.minimum(p_full, q_full).sum(-1).mean()), abs=1e-5)
            exact_kl = (p_full * (p_full.log() - q_full.log())).sum(-1).mean()
            assert float(kl) == pytest.approx(float(exact_kl), abs=1e-4)
    # Gradients reach the draft's logits.
    logits.requires_grad_(True)
    distill._distill_loss(logits, top_ids, top_probs, "tvd")[0].backward()
    assert logits.grad.abs().sum() > 0


def test_speculative_steps():
    assert distill.speculative_steps([True] * 10, 4) == 2     # 5 + 5
    assert distill.speculative_steps([False] * 10, 4) == 10   # 1 per step
    assert distill.speculative_steps([True, True, False, True], 4) == 2  # 3, then 1


# ------------------------------------------------------------------- shipped pair

needs_demo = pytest.mark.skipif(not (DEMO / "target" / "config.json").exists(),
                                reason="models/demo not built")


@needs_demo
def test_shipped_pair_loads_and_shares_a_tokenizer():
    from transformers import AutoModelForCausalLM

    tok = distill.check_same_tokenizer(DEMO / "target", DEMO / "draft-generic")
    distill.check_same_tokenizer(DEMO / "target", DEMO / "draft-distilled")
    total = 0
    for name in ("target", "draft-generic", "draft-distilled"):
        card = json.loads((DEMO / name / "card.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(DEMO / name)
        assert model.config.vocab_size == len(tok)
        assert sum(p.numel() for p in model.parameters()) == card["parameters"]
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        total += sum(f.stat().st_size for f in (DEMO / name).iterdir())
        assert (DEMO / name / "README.md").exists()
    assert total <= 80 * 2**20


@functools.cache
def _held_out_losses(task: str) -> dict[str, float]:
    """Loss of the target and the generic draft on one task type's held-out text (the
    script's own split), over windows spread across the whole split."""
    sys.path.insert(0, str(REPO / "scripts"))
    import make_demo_pair
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    tok = distill.check_same_tokenizer(DEMO / "target", DEMO / "draft-generic")
    ids = torch.tensor(tok(make_demo_pair.held_out_text(task), add_special_tokens=False)["input_ids"])
    # The card's windows exactly: 64 spread evenly over the whole held-out split.
    starts = np.linspace(0, len(ids) - 257, 64).astype(np.int64)
    windows = torch.stack([ids[i:i + 257] for i in starts])
    losses = {}
    for name in ("target", "draft-generic"):
        model = AutoModelForCausalLM.from_pretrained(DEMO / name, dtype=torch.float32).eval()
        total = 0.0
        with torch.no_grad():
            for batch in windows.split(8):
                logits = model(batch[:, :-1]).logits
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"))
        losses[name] = total / (len(windows) * 256)
    return losses


@needs_demo
@pytest.mark.parametrize("task", ["code", "prose"])
def test_shipped_val_losses_are_as_claimed(task):
    for name, loss in _held_out_losses(task).items():
        card = json.loads((DEMO / name / "card.json").read_text())
        assert loss == pytest.approx(card["val_loss"][task], abs=0.01), (name, loss)


@needs_demo
@pytest.mark.parametrize("task", ["code", "prose"])
def test_shipped_target_is_clearly_better_than_the_draft(task):
    losses = _held_out_losses(task)
    assert losses["target"] <= losses["draft-generic"] - 0.3, losses
