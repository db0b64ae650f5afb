"""Every causal-LM family transformers knows is either served exactly or refused at load.

For each model type in transformers' causal-LM auto mapping, a tiny model is built from
its config alone (shrunk to a few layers of 64 wide). A family that cannot be built that
way, or that transformers' own `generate` cannot run, is skipped only when it is listed
in KNOWN_FAILURES (or NEEDS, an optional library not installed) with the error it stops
on; any other error fails the test, and so does a listed family that now builds. The
runtime then loads it as a worker does: either it refuses the model at load with
`UnsupportedModel` naming the family, or greedy decoding through the batched store, two
sessions sharing every forward, equals `generate` token for token. No family may fail
at a request. A few families also go through the three services.
"""
from __future__ import annotations

import asyncio
import importlib.util
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
from specd.worker.settings import BatchSettings, ModelSettings
from verifier_service.scorer import Scorer

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

# Why a family is not tested, when it is not: each a limit of building the tiny model
# from the family's config alone, or of transformers itself on the shrunk model.
_TOO_LARGE = ("TooLarge", "parameters after shrinking",
              "its sizes live in fields tiny_config does not set (an encoder-decoder's, a multimodal model's, "
              "nested configs), so it stays over MAX_PARAMETERS")
_DEPTH_LISTS = ("StrictDataclassClassValidationError", "mlp_layer_types",
                "its config checks per-layer lists (mlp_layer_types) made for the full depth, which tiny_config "
                "does not cut to 2 layers")
_READ_ONLY_LAYERS = ("AttributeError", "object has no setter",
                     "its layer types are a read-only property derived from fields tiny_config does not set")
_PER_LAYER_CONFIG = ("AmbiguousGlobalPerLayerAttributeError", "is a per-layer attribute",
                     "its sizes are per layer (per_layer_config), which tiny_config does not shrink")
# Checked: these stop the same way on the family's unshrunk default config.
_DEFAULT_CONFIG = "transformers cannot build its causal LM from its default config (AutoConfig.for_model) either"
_VALIDATION = "StrictDataclassClassValidationError"
_LAYOUT = "its config checks layer counts or layouts made for the full depth"
_MAMBA_ONLY_CACHE = ("ValueError", "`get_mask_sizes` can only be called on Attention layers",
                     "transformers' generate: with 2 layers the shrunk model has no attention layer left")
_ROTARY_DIM = ("RuntimeError", "The size of tensor a (16) must match the size of tensor b (64)",
               "transformers' generate: its rotary_dim (64) is kept from the full config, wider than the "
               "shrunk head (16)")
_INDEX_ERROR = ("IndexError", "list index out of range", "transformers' generate fails on the shrunk model "
                "(its unshrunk default builds)")
# model type: (the exception it stops on, a piece of its message, why).
KNOWN_FAILURES: dict[str, tuple[str, str, str]] = {
    **dict.fromkeys(["bart", "bigbird_pegasus", "blenderbot", "blt", "dots3_note", "emu3", "ergo", "fuyu", "gemma3",
                     "gemma4", "gemma4_unified", "gemma4_unified_assistant", "git", "got_ocr2", "inkling2_loop_text",
                     "inkling2_text", "llama4", "marian", "mbart", "mllama", "moss_transcribe_diarize", "mvp",
                     "pegasus", "phi4_multimodal", "qwen3_5", "qwen3_5_moe", "roc_bert"], _TOO_LARGE),
    **dict.fromkeys(["axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v32", "deepseek_v4", "exaone_moe",
                     "glm_moe_dsa", "hy_v4", "inkling_text", "kimi_linear", "mellum", "mimo_v2_flash",
                     "minimax_m3_vl_text"], _DEPTH_LISTS),
    **dict.fromkeys(["bamba", "falcon_h1", "falcon_mamba", "jamba", "mamba", "mamba2", "recurrent_gemma"],
                    _READ_ONLY_LAYERS),
    **dict.fromkeys(["dots3_note_text", "gemma4_text", "gemma4_unified_text"], _PER_LAYER_CONFIG),
    "musicgen": ("AttributeError", "object has no attribute 'dropout'", _DEFAULT_CONFIG),
    "musicgen_melody": ("AttributeError", "object has no attribute 'dropout'", _DEFAULT_CONFIG),
    "dory": (_VALIDATION, "n_input_layers + n_recurrent_layers + n_output_layers", _LAYOUT),
    "gpt_neo": (_VALIDATION, "len(config.attention_layers)", _LAYOUT),
    "kolibri1_1": (_VALIDATION, "`index_layers` must be increasing", _LAYOUT),
    "laguna": (_VALIDATION, "num_attention_heads_per_layer length", _LAYOUT),
    "gemma4_assistant": (_VALIDATION, "hidden_size_per_layer_input must be 0",
                         "its config rejects the per-layer input size its own defaults give"),
    "granitemoehybrid": (_VALIDATION, "Mamba head state do not match",
                         "its Mamba head sizes are fields tiny_config does not set"),
    "zaya": (_VALIDATION, "supports `num_experts_per_tok=1` only",
             "it takes one expert per token; TINY sets num_experts_per_tok=2"),
    "cohere_compass_text": ("KeyError", "'full_attention'", _DEFAULT_CONFIG),
    "dbrx": ("AttributeError", "has no attribute 'rope_theta'", _DEFAULT_CONFIG),
    "gemma3n_text": ("ValueError", "layer types producing a cache is different",
                     "its KV-sharing layers are laid out for the full depth"),
    "lfm2_moe": ("TypeError", "'NoneType' object is not subscriptable", _DEFAULT_CONFIG),
    "qwen4_exp": ("TypeError", "unsupported operand type(s) for //: 'NoneType'", _DEFAULT_CONFIG),
    "qwen4_exp_text": ("TypeError", "unsupported operand type(s) for //: 'NoneType'", _DEFAULT_CONFIG),
    "plbart": ("ValueError", "embed_dim must be divisible by num_heads",
               "an encoder-decoder: its head counts are encoder_/decoder_attention_heads, not set by tiny_config"),
    "whisper": ("ValueError", "embed_dim must be divisible by num_heads",
                "an encoder-decoder: its head counts are encoder_/decoder_attention_heads, not set by tiny_config"),
    "prophetnet": ("NotImplementedError", "does not support the setting of `num_hidden_layers`",
                   "an encoder-decoder: its depth is num_encoder_layers/num_decoder_layers"),
    "xlnet": ("NotImplementedError", "has no sequence length limit",
              "it has no max_position_embeddings; tiny_config sets one"),
    "reformer": ("AssertionError", "make sure that `is_decoder=True`", _DEFAULT_CONFIG),
    "blenderbot-small": _INDEX_ERROR,
    "hrm_text": _INDEX_ERROR,
    "codegen": _ROTARY_DIM,
    "gptj": _ROTARY_DIM,
    "longcat_flash": ("RuntimeError", "split_with_sizes expects split_sizes to sum exactly to 192",
                      "transformers' generate: its latent-attention sizes are fields tiny_config does not set"),
    "rwkv": ("RuntimeError", "The size of tensor a (64) must match the size of tensor b (4096)",
             "transformers' generate: its attention_hidden_size (4096) is kept from the full config"),
    "xlstm": ("RuntimeError", "The size of tensor a (4096) must match the size of tensor b (64)",
              "transformers' generate: its embedding_dim (4096) is kept from the full config"),
    "xmod": ("ValueError", "Input language unknown",
             "transformers' generate: it needs a default language set on the model first"),
    "zamba": _MAMBA_ONLY_CACHE,
    "zamba2": _MAMBA_ONLY_CACHE,
}
# Families whose transformers classes need a library specd does not depend on: skipped
# when it is not installed, tested (and able to fail) when it is.
NEEDS = {"gemma3n": "timm"}


class TooLarge(Exception):
    """A shrunk family over MAX_PARAMETERS."""


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
    each prompt in `dtype`. pytest.skip when the family is in KNOWN_FAILURES and stops on
    the error listed there (or needs a library, NEEDS, that is not installed); any other
    error is raised, and a listed family that builds and generates fails."""
    needed = NEEDS.get(model_type)
    if needed and importlib.util.find_spec(needed) is None:
        pytest.skip(f"{model_type}: its transformers classes need {needed}, which is not installed")
    stage = "cannot be built from its config alone"
    try:
        config = tiny_config(model_type, len(tokenizer))
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if parameters > MAX_PARAMETERS:
            raise TooLarge(f"{parameters:,} parameters after shrinking")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        # The reference is the model as it loads back: a config re-derives fields when read.
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()
        stage = "transformers' own generate fails on it"
        expected = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    except Exception as exc:
        known = KNOWN_FAILURES.get(model_type)
        if known is None or type(exc).__name__ != known[0] or known[1] not in str(exc):
            raise  # not a known failure of this family: the test fails with it
        pytest.skip(f"{model_type}: {stage} ({known[2]}): {type(exc).__name__}: {exc}")
    if model_type in KNOWN_FAILURES:
        pytest.fail(f"{model_type} is in KNOWN_FAILURES ({KNOWN_FAILURES[model_type][2]}) but now builds and "
                    f"generates: take it off the list")
    tokenizer.save_pretrained(directory)
    return expected


async def decode_together(scorer: Scorer) -> list[list[int]]:
    """Greedy decoding of every prompt, one session each, their steps batched together."""
    async def decode(session: str, prompt: list[int]) -> list[int]:
        tokens, start, out = list(prompt), 0, []
        for _ in range(NEW_TOKENS):
            scores = await scorer.score(session, start, tokens[start:], [], Transform())
            assert scores.argmax is not None
            start = len(tokens)
            out.append(scores.argmax[0])
            tokens.append(out[-1])
        return out

    try:
        return list(await asyncio.gather(*(decode(f"s{i}", p) for i, p in enumerate(PROMPTS))))
    finally:
        await scorer.runner.close()


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
        scorer = Scorer(tmp_path / model_type, ModelSettings(dtype=dtype, max_sessions=4,
                                                             batching=BatchSettings(kv_cache_tokens=2048)))
    except UnsupportedModel as refused:
        assert refusable and model_type in str(refused), refused
        print(f"refused at load: {refused}")
        return
    runner = scorer.runner
    assert runner.lean_forward == (type(runner.model).__name__ in LEAN_FORWARD), model_type
    if packed:
        assert not any(type(m) is torch.nn.Linear for m in runner.model.modules())
        assert any(isinstance(m, packing.PackedLinear) for m in runner.model.modules()), model_type
    got = [until_eos(tokens) for tokens in asyncio.run(decode_together(scorer))]
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
        ModelRunner(tmp_path / "llama", ModelSettings(max_sessions=4, batching=BatchSettings(kv_cache_tokens=2048)))


def test_latent_attention_with_fewer_kv_heads_than_query_heads_is_refused(tokenizer, tmp_path):
    """A DeepSeek-V3 config whose KV heads are fewer than its query heads: transformers' own
    forward fails on it, so specd refuses it at load, naming the family."""
    config = tiny_config("deepseek_v3", len(tokenizer))
    config.num_key_value_heads = config.num_attention_heads // 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ds")
    tokenizer.save_pretrained(tmp_path / "ds")
    with pytest.raises(UnsupportedModel, match="deepseek_v3"):
        ModelRunner(tmp_path / "ds", ModelSettings(max_sessions=4, batching=BatchSettings(kv_cache_tokens=2048)))
