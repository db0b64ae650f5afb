"""Every causal-LM family transformers knows is either served exactly or refused at load.

For each model type in transformers' causal-LM auto mapping, a tiny model is built from
its config alone (shrunk to a few layers of 64 wide; a family that cannot be built that
way, or that transformers' own `generate` cannot run, is skipped with the reason). The
runtime then loads it as a worker does: either it refuses the model at load with
`UnsupportedModel` naming the family, or greedy decoding through the batched store, two
sessions sharing every forward, equals `generate` token for token. No family may fail
at a request. A few families also go through the three services.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from conftest import request, start_stack
from specd.errors import UnsupportedModel
from specd.sampling import Transform
from specd.worker import packing
from specd.worker.runtime import ModelRunner
from specd.worker.settings import BatchSettings

# Field names families use for their sizes, and the tiny values they get.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, n_embd=64, n_layer=2, n_head=4, d_model=64, ffn_dim=128,
            n_positions=256, num_layers=2, num_heads=4, word_embed_proj_dim=64, sliding_window=8,
            kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=4, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=2, n_group=1, topk_group=1, tie_word_embeddings=False)
MAX_PARAMETERS = 5_000_000  # more after shrinking: its sizes live in fields we do not know
PROMPTS = [[5, 17, 23, 42, 8, 99], [3, 3, 61, 20]]
# Models of these classes run specd's lean forward (specd.worker.lean); a few other model
# types load as one of them (EXAONE, InternLM3 as Llama).
LEAN_FORWARD = {"LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                "SmolLM3ForCausalLM", "Starcoder2ForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                "Gemma3ForCausalLM"}
NEW_TOKENS = 6


def tiny_config(model_type: str, vocab_size: int):
    """The family's default config, shrunk; its sliding windows (if any) shorter than a test sequence."""
    config = AutoConfig.for_model(model_type)
    for name, value in TINY.items():
        if hasattr(config, name):
            try:
                setattr(config, name, value)
            except AttributeError:  # a property derived from other fields (Falcon's head_dim)
                pass
    if hasattr(config, "qk_rope_head_dim"):  # multi-head latent attention: rotary on qk_rope_head_dim, no GQA
        config.head_dim, config.num_key_value_heads = config.qk_rope_head_dim, config.num_attention_heads
    config.vocab_size = vocab_size
    if getattr(config, "layer_types", None):
        layers = config.num_hidden_layers
        config.layer_types = [config.layer_types[-1 - i % len(config.layer_types)] for i in range(layers)][::-1]
    config.eos_token_id, config.pad_token_id, config.bos_token_id = 0, 0, 1
    return config


def build(model_type: str, directory: Path, tokenizer, dtype: str = "float32") -> list[list[int]]:
    """Save the family's tiny model with the tokenizer; transformers' greedy continuation of
    each prompt in `dtype`. pytest.skip when it cannot be built from its config, or
    generate fails."""
    try:
        config = tiny_config(model_type, len(tokenizer))
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if parameters > MAX_PARAMETERS:
            pytest.skip(f"{model_type}: {parameters:,} parameters after shrinking; its sizes are not in the "
                        f"usual fields")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        # The reference is the model as it loads back: a config re-derives fields when read.
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
    except Exception as exc:
        pytest.skip(f"{model_type}: cannot be built from its config alone: {type(exc).__name__}: {exc}")
    try:
        expected = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    except Exception as exc:
        pytest.skip(f"{model_type}: transformers' own generate fails on it: {type(exc).__name__}: {exc}")
    tokenizer.save_pretrained(directory)
    return expected


async def decode_together(runner: ModelRunner) -> list[list[int]]:
    """Greedy decoding of every prompt, one session each, their steps batched together."""
    async def decode(session: str, prompt: list[int]) -> list[int]:
        tokens, start, out = list(prompt), 0, []
        for _ in range(NEW_TOKENS):
            scores = await runner.score(session, start, tokens[start:], [], Transform())
            assert scores.argmax is not None
            start = len(tokens)
            out.append(scores.argmax[0])
            tokens.append(out[-1])
        return out

    try:
        return list(await asyncio.gather(*(decode(f"s{i}", p) for i, p in enumerate(PROMPTS))))
    finally:
        await runner.close()


# Every linear layer packed, as a worker packs a real model's (the tiny ones here are below
# the size it packs): a family whose own code reads a packed layer's weight is served as
# loaded (specd.worker.packing.packed_model), never refused for it.
@pytest.mark.parametrize("model_type", sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
def test_every_family_is_exact_or_refused_at_load(model_type, tokenizer, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(packing, "MIN_WEIGHTS", 0)
    check_family(model_type, tokenizer, tmp_path, "float32", caplog)


# bfloat16 on this CPU (float16 needs the GPU check): greedy output equals generate in the same dtype.
@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2", "gemma3_text", "qwen3", "opt", "deepseek_v3",
                                        "falcon", "bloom"])
def test_half_precision_is_exact_in_the_same_dtype(model_type, tokenizer, tmp_path, caplog):
    check_family(model_type, tokenizer, tmp_path, "bfloat16", caplog, refusable=False)


def check_family(model_type: str, tokenizer, tmp_path: Path, dtype: str, caplog, refusable: bool = True,
                 packed: bool = False) -> None:
    """Refused at load naming the family (when `refusable`), or greedy-exact against generate;
    `packed`: every linear layer is expected to be a `PackedLinear`."""
    caplog.set_level(logging.ERROR)
    expected = build(model_type, tmp_path / model_type, tokenizer, dtype)
    try:
        runner = ModelRunner(tmp_path / model_type, dtype=dtype, max_sessions=4,
                             batching=BatchSettings(kv_cache_tokens=2048))
    except UnsupportedModel as refused:
        assert refusable and model_type in str(refused), refused
        print(f"refused at load: {refused}")
        return
    assert runner.lean_forward == (type(runner.model).__name__ in LEAN_FORWARD), model_type
    if packed:
        assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())
        assert any(isinstance(m, packing.PackedLinear) for m in runner.model.modules()), model_type
    got = [until_eos(tokens) for tokens in asyncio.run(decode_together(runner))]
    for prompt, ours, theirs in zip(PROMPTS, got, expected):
        if ours != theirs:  # allowed only where the reference's top two logits tie in float32 rounding
            at = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            reference = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, dtype=getattr(torch, dtype)).eval()
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
            top = logits.topk(2).values
            assert top[0] - top[1] <= 1e-4 * logits.abs().max(), (model_type, at, ours, theirs)


# A CPU worker multiplies its large linear layers with oneDNN, the weights packed at load
# (specd.worker.packing). The tiny models here are below the size that is packed, so this
# packs every `nn.Linear` of the common families and of those whose own modules build
# attention (Falcon's own linear class is left as it is), in both dtypes packing serves:
# each must be packed and stay exact.
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bfloat16 kernels"))])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3_moe", "mixtral", "phi3", "olmo2", "granite",
                                        "starcoder2", "gpt_neox", "gemma2", "gemma3_text", "falcon", "opt", "bloom",
                                        "deepseek_v3"])
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")
def test_packed_linear_layers_are_exact(model_type, dtype, tokenizer, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(packing, "MIN_WEIGHTS", 0)
    check_family(model_type, tokenizer, tmp_path, dtype, caplog, refusable=False, packed=True)


def until_eos(tokens: list[int]) -> list[int]:
    """The tokens up to the first end of sequence (id 0), which `generate` stops at."""
    return tokens[:tokens.index(0) + 1] if 0 in tokens else tokens


# The 19 families users bring most, through the three services with FIXED γ=4 and with
# OFF: the twelve of the plain kind, sliding-window hybrids with soft-capped scores
# (Mistral, Gemma 2 and 3), positions read from a learned table (OPT), a compressed latent
# cache (DeepSeek-V3), and models that compute attention themselves on what the cache
# hands them (Falcon; BLOOM, with ALiBi). The draft is the target itself, so its tokens
# must be accepted.
COMMON_FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "olmo2", "granite", "starcoder2",
                   "smollm3", "gpt2", "gpt_neox", "mistral", "gemma2", "gemma3_text", "falcon", "opt", "bloom",
                   "deepseek_v3"]


@pytest.mark.parametrize("model_type", COMMON_FAMILIES)
def test_common_families_through_the_services(model_type, tokenizer, tmp_path):
    directory = tmp_path / model_type
    build(model_type, directory, tokenizer)
    prompt = "def fibonacci(n): return n"  # with the new tokens, longer than the tiny sliding window
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                  do_sample=False)[0, ids.shape[1]:].tolist()
    stack = start_stack({"target": directory, "close": directory}, drafts=("close",))
    try:
        fixed = stack.stub.Generate(request(prompt, max_new_tokens=12, mode="FIXED", draft_length=4))
        assert list(fixed.token_ids) == until_eos(expected)
        assert fixed.stats.accepted_tokens > 0.9 * fixed.stats.proposed_tokens > 0
        off = stack.stub.Generate(request(prompt, max_new_tokens=12, mode="OFF"))
        assert list(off.token_ids) == until_eos(expected) and off.stats.proposed_tokens == 0
    finally:
        stack.close()


def test_a_model_whose_own_forward_fails_is_refused_naming_the_family(tokenizer, tmp_path, monkeypatch):
    """The load-time trial's reference (the model's own eager forward) raising is a refusal
    with the reason, not a worker that dies with a traceback."""
    from transformers.models.llama import modeling_llama

    build("llama", tmp_path / "llama", tokenizer)

    def broken(*args, **kwargs):
        raise RuntimeError("the eager kernel is broken here")

    monkeypatch.setattr(modeling_llama, "eager_attention_forward", broken)
    with pytest.raises(UnsupportedModel, match=r"\(llama\) cannot be served: its own forward fails: RuntimeError"):
        ModelRunner(tmp_path / "llama", max_sessions=4, batching=BatchSettings(kv_cache_tokens=2048))


def test_latent_attention_with_fewer_kv_heads_than_query_heads_is_refused(tokenizer, tmp_path):
    """A DeepSeek-V3 config whose KV heads are fewer than its query heads: transformers' own
    forward fails on it, so specd refuses it at load, naming the family."""
    config = tiny_config("deepseek_v3", len(tokenizer))
    config.num_key_value_heads = config.num_attention_heads // 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ds")
    tokenizer.save_pretrained(tmp_path / "ds")
    with pytest.raises(UnsupportedModel, match="deepseek_v3"):
        ModelRunner(tmp_path / "ds", max_sessions=4, batching=BatchSettings(kv_cache_tokens=2048))
