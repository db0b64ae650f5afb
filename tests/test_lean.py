"""The lean forward of Llama-architecture models (specd.worker.lean): the model's own
logits to the bit, only where it mirrors the model, and what a worker runs by default.

Tiny real models made in the test (tests/conftest.py), the paged store as serving uses it.
"""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma import modeling_gemma as gemma
from transformers.models.llama import modeling_llama as llama
from transformers.models.olmo2 import modeling_olmo2 as olmo2
from transformers.models.phi3 import modeling_phi3 as phi3
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from specd.worker import forwards, lean, trials
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow, prepare
from specd.worker.runtime import ModelRunner
from specd.worker.settings import ModelSettings

CPU = torch.device("cpu")


def _loaded(directory):
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    use_paged_attention(model)
    layers, kv_heads, key_dim, value_dim = trials.kv_shape(model, CPU)
    return model, KVPool(layers, kv_heads, key_dim, value_dim, torch.float32, CPU, 4, 64)


def _steps(pool: KVPool, forward) -> list[torch.Tensor]:
    """Three sessions through prefills of different lengths, a rolled-back verification of
    a few tokens each, and two decoding steps, every forward shared: each forward's logits."""
    torch.manual_seed(0)
    sessions = [SessionKV(pool) for _ in range(3)]
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (3, 21, 9)]
    for session, prompt in zip(sessions, prompts):
        assert session.reserve(len(prompt) + 8)
    feeds = [[BatchRow(s, p, 2) for s, p in zip(sessions, prompts)],
             [BatchRow(s, e, len(e)) for s, e in zip(sessions, ([1, 2], [3], [4, 5, 6, 7]))],
             [BatchRow(s, [9], 1) for s in sessions], [BatchRow(s, [11], 1) for s in sessions[1:]]]
    logits = []
    with torch.inference_mode():
        for phase, rows in enumerate(feeds):
            logits.append(forward(prepare(rows, CPU)))
            for row in rows:
                row.session.length += len(row.tokens)
            if phase == 0:  # a rejected draft token: roll each session back by one
                for session in sessions:
                    session.crop(session.length - 1)
    return logits


def test_lean_forward_gives_the_models_own_logits_to_the_bit(model_dirs):
    model, pool = _loaded(model_dirs["target"])
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    own = _steps(pool, lambda inputs: forwards.own_forward(model, inputs))
    mirrored = _steps(pool, lean.LeanDecoder(model))
    for got, want in zip(mirrored, own, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    # Installed, the store's forward is the lean one: still the same logits.
    session = SessionKV(pool)
    assert session.reserve(8)
    with torch.inference_mode():
        stored, _ = forwards.forward(model, [BatchRow(session, [5, 6, 7], 3)], CPU)
    assert torch.equal(stored, model(input_ids=torch.tensor([[5, 6, 7]])).logits[0])


# Families whose layers are Llama's but for named differences (`lean._Family`), each with
# what sets it apart on, so that leaving that out would change the logits (checked below):
# sliding windows shorter than the trial's and `_steps`' sequences, Qwen2's and
# StarCoder2's biases and every norm trained away from their defaults, Qwen3's per-head
# and OLMo 2's whole-projection query and key norms, experts (Mixtral; Qwen3-MoE with one
# dense layer), Phi-3's fused projection and half rotation, a SmolLM3 layer without
# rotation, Granite's scales, Gemma 2's soft-capped scores and logits, Gemma 3's norms
# over each head and its two rotary frequencies.
FAMILIES = {
    "mistral": dict(sliding_window=6),
    "mixtral": dict(sliding_window=6, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"]),
    "qwen3": dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"], head_dim=16),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                      head_dim=16, use_sliding_window=True, sliding_window=6),  # a window on every layer
    "phi3": dict(sliding_window=6, partial_rotary_factor=0.5, pad_token_id=0),
    "olmo2": dict(),
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    "smollm3": dict(no_rope_layers=[1, 0], pad_token_id=0),
    "starcoder2": dict(sliding_window=6),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                        final_logit_softcapping=20.0,
                        rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e6),
                                         "sliding_attention": dict(rope_type="default", rope_theta=1e4)}),
}
# Families whose differences from Llama's layer are all code (where the norms sit, the
# embedding's scale inside its module): nothing to leave out as data.
NOTHING_BUT_CODE = {"olmo2", "gemma"}


def _without_what_sets_it_apart(decoder: lean.LeanDecoder) -> lean.LeanDecoder:
    """The same decoder with its family's differences from Llama's layer left out where
    they are data: windows, skipped rotations, Granite's scales, soft caps."""
    decoder.windows = [None] * len(decoder.windows)
    decoder.rotated = [True] * len(decoder.rotated)
    decoder.softcaps = [None] * len(decoder.softcaps)
    decoder.embedding_multiplier = decoder.logits_scaling = decoder.final_softcap = None
    return decoder


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_families_with_llamas_layers_get_the_lean_forward_to_the_bit(tmp_path, model_type):
    config = AutoConfig.for_model(model_type, vocab_size=320, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, **FAMILIES[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.normal_()
    model.save_pretrained(tmp_path)
    model, pool = _loaded(tmp_path)
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    own = _steps(pool, lambda inputs: forwards.own_forward(model, inputs))
    for got, want in zip(_steps(pool, lean.LeanDecoder(model)), own, strict=True):
        assert torch.equal(got, want)
    if model_type in NOTHING_BUT_CODE:
        return
    # What sets the family apart matters over these sequences: without it the logits differ.
    decoder = _without_what_sets_it_apart(lean.LeanDecoder(model))
    if model_type == "phi3":  # the rotation covers half of each head
        with torch.inference_mode():
            cos, _ = model.model.rotary_emb(torch.zeros(1, 1, 64), position_ids=torch.tensor([[0]]))
        assert cos.shape[-1] == model.model.layers[0].self_attn.head_dim // 2
    assert not all(torch.equal(got, want) for got, want in zip(_steps(pool, decoder), own))


def test_olmo2_in_bfloat16_gets_the_lean_forward_to_the_bit(tmp_path):
    """OLMo 2's rotary module keeps cos and sin in float32, and its rotation casts the
    queries and keys back: in bfloat16 the lean forward must too (in float32 there is
    nothing to cast)."""
    config = AutoConfig.for_model("olmo2", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    use_paged_attention(model)
    pool = KVPool(*trials.kv_shape(model, CPU), torch.bfloat16, CPU, 4, 64)
    with torch.inference_mode():
        cos, _ = model.model.rotary_emb(torch.zeros(1, 1, 64, dtype=torch.bfloat16), position_ids=torch.tensor([[0]]))
    assert cos.dtype == torch.float32
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    own = _steps(pool, lambda inputs: forwards.own_forward(model, inputs))
    for got, want in zip(_steps(pool, lean.LeanDecoder(model)), own, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_a_llama_in_bfloat16_gets_the_lean_forward_to_the_bit(tmp_path):
    """In bfloat16 the shortened norm casts to float32 and back, and applies its weight
    in place (`lean._norm`), and the rotation runs in bfloat16: still the model's bits."""
    config = AutoConfig.for_model("llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_()
    model.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    use_paged_attention(model)
    pool = KVPool(*trials.kv_shape(model, CPU), torch.bfloat16, CPU, 4, 64)
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    decoder = lean.LeanDecoder(model)
    assert decoder.final_norm != model.model.norm.forward  # the shortened norm is what runs
    own = _steps(pool, lambda inputs: forwards.own_forward(model, inputs))
    for got, want in zip(_steps(pool, decoder), own, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_only_llamas_own_norm_and_mlp_code_is_shortened():
    """A family's norm or MLP runs through its operators only where its code is Llama's
    (most families copy it); one that differs keeps its module's forward."""
    assert lean._same_code(qwen2.Qwen2RMSNorm.forward, llama.LlamaRMSNorm.forward)
    assert lean._same_code(gemma.GemmaMLP.forward, llama.LlamaMLP.forward)
    for other in (olmo2.Olmo2RMSNorm, gemma.GemmaRMSNorm):  # the weight before the cast; 1 + weight
        assert not lean._same_code(other.forward, llama.LlamaRMSNorm.forward)
        norm = other(8)
        assert lean._norm(norm) == norm.forward
    # Phi-3's MLP: one fused gate and up projection, its own forward.
    config = AutoConfig.for_model("phi3", hidden_size=16, intermediate_size=32)
    mlp = phi3.Phi3MLP(config)
    assert not lean._same_code(phi3.Phi3MLP.forward, llama.LlamaMLP.forward) and lean._mlp(mlp) == mlp.forward


# Rotary scalings a Llama checkpoint may carry: Llama 3's, and YaRN's, whose attention
# scaling multiplies cos and sin (both come from the model's own rotary module).
ROPES = {
    "llama3": dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
}


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_a_llama_with_scaled_rotary_positions_gets_the_lean_forward_to_the_bit(tmp_path, rope):
    config = AutoConfig.for_model("llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  rope_parameters=ROPES[rope])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model, pool = _loaded(tmp_path)
    assert model.model.rotary_emb.rope_type == rope
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    own = _steps(pool, lambda inputs: forwards.own_forward(model, inputs))
    for got, want in zip(_steps(pool, lean.LeanDecoder(model)), own, strict=True):
        assert torch.equal(got, want)


def test_models_it_does_not_mirror_keep_transformers_forward(model_dirs):
    config = AutoConfig.for_model("gpt_neox", vocab_size=320, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4)
    neox = AutoModelForCausalLM.from_config(config).eval()
    assert "GPTNeoXForCausalLM is not one of LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM" \
        in lean._unmirrored(neox)

    llama, _ = _loaded(model_dirs["target"])
    llama.model.layers[1].train()  # its dropout (were there any) would be skipped
    assert "training mode" in lean._unmirrored(llama)

    llama, _ = _loaded(model_dirs["target"])
    llama.model.layers[1].mlp = torch.nn.Sequential().eval()  # a part the lean forward would not call as the model does
    assert "Sequential in place of LlamaMLP" in lean._unmirrored(llama)

    llama, pool = _loaded(model_dirs["target"])
    llama.model.layers[0].input_layernorm.register_forward_hook(lambda *args: None)
    assert "hooks" in lean.install(llama, pool, llama.config.vocab_size, CPU)
    assert llama not in forwards._FORWARDS

    # A hook torch runs for every module (a profiler's, say): it changes no output, so
    # only this check would see that the lean forward skips it.
    llama, pool = _loaded(model_dirs["target"])
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:
        assert "hooks" in lean.install(llama, pool, llama.config.vocab_size, CPU)
    finally:
        handle.remove()
    assert llama not in forwards._FORWARDS


def test_a_lean_forward_that_raises_in_its_trial_leaves_the_model_its_own(model_dirs, monkeypatch):
    model, pool = _loaded(model_dirs["target"])

    def fails(self, inputs):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(lean.LeanDecoder, "__call__", fails)
    assert lean.install(model, pool, model.config.vocab_size, CPU) == \
        "the lean forward fails its trial: RuntimeError: no kernel for this"
    assert model not in forwards._FORWARDS


def test_an_instance_forward_keeps_transformers_forward(model_dirs):
    """accelerate's offloading sets `forward` on module instances; the lean forward would skip it."""
    model, pool = _loaded(model_dirs["target"])
    mlp = model.model.layers[0].mlp
    mlp.forward = mlp.forward
    assert "a forward of its own" in lean.install(model, pool, model.config.vocab_size, CPU)


def test_an_installed_lean_forward_lets_its_model_go(model_dirs):
    model, pool = _loaded(model_dirs["target"])
    assert lean.install(model, pool, model.config.vocab_size, CPU) is None
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_a_trial_that_differs_by_one_ulp_keeps_transformers_forward(model_dirs, monkeypatch):
    model, pool = _loaded(model_dirs["target"])
    mirrored = lean.LeanDecoder.__call__

    def one_ulp_off(self, inputs):
        logits = mirrored(self, inputs)
        return torch.nextafter(logits, torch.full_like(logits, float("inf")))

    monkeypatch.setattr(lean.LeanDecoder, "__call__", one_ulp_off)
    assert lean.install(model, pool, model.config.vocab_size, CPU) == \
        "its trial logits differ from the model's own forward"
    session = SessionKV(pool)
    assert session.reserve(4)
    with torch.inference_mode():
        stored, _ = forwards.forward(model, [BatchRow(session, [5, 6, 7], 3)], CPU)
    assert torch.equal(stored, model(input_ids=torch.tensor([[5, 6, 7]])).logits[0])  # not one ulp off


def test_a_family_the_lean_forward_mirrors_that_fails_its_trial_is_a_warning(model_dirs, monkeypatch, caplog):
    """A Llama whose lean trial differs (a device's kernels rounding apart) keeps
    transformers' forward, and the worker warns: it is unexpected, and slower."""
    mirrored = lean.LeanDecoder.__call__

    def one_ulp_off(self, inputs):
        logits = mirrored(self, inputs)
        return torch.nextafter(logits, torch.full_like(logits, float("inf")))

    monkeypatch.setattr(lean.LeanDecoder, "__call__", one_ulp_off)
    with caplog.at_level(logging.INFO, logger="specd.worker.runtime"):
        runner = ModelRunner(model_dirs["target"], ModelSettings(max_sessions=2))
    assert not runner.lean_forward
    warned = [r for r in caplog.records if "keeps transformers' forward" in r.getMessage()]
    assert warned and warned[0].levelno == logging.WARNING and "differ" in warned[0].getMessage()


def test_a_worker_runs_the_lean_forward_by_default_and_the_setting_turns_it_off(model_dirs):
    runner = ModelRunner(model_dirs["target"], ModelSettings(max_sessions=2))
    assert runner.lean_forward and isinstance(forwards._FORWARDS[runner.model], lean.LeanDecoder)
    plain = ModelRunner(model_dirs["target"], ModelSettings(max_sessions=2, forward="transformers"))
    assert not plain.lean_forward and plain.model not in forwards._FORWARDS
    with pytest.raises(ValueError, match="forward must be one of"):
        ModelRunner(model_dirs["target"], ModelSettings(max_sessions=2, forward="compiled"))


def test_a_worker_says_why_a_model_keeps_transformers_forward(tmp_path, model_dirs, caplog):
    config = AutoConfig.for_model("gpt_neox", vocab_size=320, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dirs["target"] / name).read_bytes())
    with caplog.at_level(logging.INFO, logger="specd.worker.runtime"):
        runner = ModelRunner(tmp_path, ModelSettings(max_sessions=2))
    assert not runner.lean_forward
    assert "keeps transformers' forward: GPTNeoXForCausalLM is not one of" in caplog.text
    assert all(r.levelno == logging.INFO for r in caplog.records if "keeps transformers' forward" in r.getMessage())
