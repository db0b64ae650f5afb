"""A lean forward for Llama-architecture models (Llama, Mistral, Qwen2, Qwen3, their
mixture-of-experts kin Mixtral and Qwen3-MoE, Phi-3, OLMo 2, Granite, SmolLM3, StarCoder2,
and Gemma 1, 2 and 3): the operators of transformers' own forward, without its per-call
machinery.

Why: on a CPU a small model's forward is mostly Python, not arithmetic. transformers'
Llama forward passes every module call through keyword handling, decorators, output
capture and a causal mask that paged attention never reads. Measured on this project's
2-core CPU, one session feeding one token (docs/performance.md, item 13): the near-free
target's forward fell from about 1.3 to 0.85 ms and the demo draft's from about 2.0 to 1.6.
On a GPU the same Python is what keeps the device waiting at small batches.

What it runs: each layer's own submodules (`forward` of the norms, projections and MLP,
a mixture of experts' included), the model's own rotary embedding, `BatchCache.update`
and `paged_attention`, in the order and with the inputs of the family's decoder layer.
The families differ from Llama's layer in a few named ways (`_Family`): a sliding window,
norms over the queries and keys, one fused q/k/v projection, a partial rotation, norms
after each sublayer rather than (or as well as) before, layers without rotation or with
a rotation of their own kind, scaled embeddings, residual branches and logits, and
soft-capped scores and logits. So every operator sees what it sees in the model's own
forward, and the logits are the same bit for bit. Two guards keep it so: `install` takes
a model only when its classes are those of a family in `_FAMILIES` (whose forward this
mirrors line for line), with no hooks and no forward set on an instance, and only when a
trial at load gives logits exactly equal to the model's own batched forward. Any other model keeps
transformers' forward (`specd.worker.kvstore`), and `--model-forward transformers` keeps
it for every model.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.models.gemma import modeling_gemma as gemma
from transformers.models.gemma2 import modeling_gemma2 as gemma2
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.granite import modeling_granite as granite
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.olmo2 import modeling_olmo2 as olmo2
from transformers.models.phi3 import modeling_phi3 as phi3
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe
from transformers.models.smollm3 import modeling_smollm3 as smollm3
from transformers.models.starcoder2 import modeling_starcoder2 as starcoder2

from specd.worker import kvstore
from specd.worker.kvstore import BatchInputs, KVPool
from specd.worker.packing import PackedLinear

_LINEARS = (nn.Linear, PackedLinear)


def _config_window(attention: Any) -> int | None:
    """The window of a family whose attention hands the config's `sliding_window` on."""
    return getattr(attention.config, "sliding_window", None)


def _own_window(attention: Any) -> int | None:
    """The window of a family whose attention keeps its own (None on full-attention layers)."""
    return attention.sliding_window


@dataclass(frozen=True)
class _Family:
    """transformers' classes of a family whose decoder layer is Llama's but for what the
    fields name:
    - `window`: the sliding window its attention hands the attention interface;
    - `qk_norms`: an RMS norm over the queries and keys before the rotation, over each
      head ("heads": Qwen3's `q_norm` and `k_norm`; "heads, transposed": Gemma 3's, after
      the heads are moved before the positions) or over the whole projection before it is
      split into heads ("whole": OLMo 2's);
    - `fused`: one `qkv_proj` whose output is cut into q, k and v (Phi-3);
    - `placement`: where the norms of each sublayer sit: before attention and MLP
      ("before", Llama's `input_layernorm` and `post_attention_layernorm`), on each one's
      output before it joins the residual stream ("after", OLMo 2's
      `post_attention_layernorm` and `post_feedforward_layernorm`), or both ("around",
      Gemma 2 and 3, with a `pre_feedforward_layernorm`);
    - `rotated`: whether a layer rotates its queries and keys (SmolLM3 leaves some out);
    - `rotary_by_layer_type`: one rotary embedding per kind of layer (Gemma 3's local and
      global frequencies), as the model's rotary module computes them given the kind;
    - `scaled`: embeddings, residual branches and logits scaled by the config (Granite);
    - `softcap`: the cap its attention hands the attention interface (Gemma 2's scores);
    - `final_softcap`: the logits soft-capped by the config's `final_logit_softcapping`
      (Gemma 2 and 3), when it has one;
    - `embedding`: the class of its token embedding (Gemma's scales what it looks up).
    Every family's rotation is Llama's, over the first dimensions the rotary module's cos
    covers (all of them, but for Phi-3's partial rotation)."""

    base: type
    layer: type
    attention: type
    mlps: tuple[type, ...]
    norms: tuple[type, ...]
    window: Callable[[Any], int | None]
    qk_norms: str = ""
    fused: bool = False
    placement: str = "before"
    rotated: Callable[[Any], bool] = lambda attention: True
    rotary_by_layer_type: bool = False
    scaled: bool = False
    softcap: Callable[[Any], float | None] = lambda attention: None
    final_softcap: bool = False
    embedding: type = nn.Embedding


_FAMILIES = {
    llama.LlamaForCausalLM: _Family(llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention,
                                    (llama.LlamaMLP,), (llama.LlamaRMSNorm,), lambda attention: None),
    mistral.MistralForCausalLM: _Family(mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
                                        (mistral.MistralMLP,), (mistral.MistralRMSNorm,), _config_window),
    mixtral.MixtralForCausalLM: _Family(mixtral.MixtralModel, mixtral.MixtralDecoderLayer, mixtral.MixtralAttention,
                                        (mixtral.MixtralSparseMoeBlock,), (mixtral.MixtralRMSNorm,), _config_window),
    qwen2.Qwen2ForCausalLM: _Family(qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention,
                                    (qwen2.Qwen2MLP,), (qwen2.Qwen2RMSNorm,), _own_window),
    qwen3.Qwen3ForCausalLM: _Family(qwen3.Qwen3Model, qwen3.Qwen3DecoderLayer, qwen3.Qwen3Attention,
                                    (qwen3.Qwen3MLP,), (qwen3.Qwen3RMSNorm,), _own_window, qk_norms="heads"),
    qwen3_moe.Qwen3MoeForCausalLM: _Family(qwen3_moe.Qwen3MoeModel, qwen3_moe.Qwen3MoeDecoderLayer,
                                           qwen3_moe.Qwen3MoeAttention,
                                           (qwen3_moe.Qwen3MoeSparseMoeBlock, qwen3_moe.Qwen3MoeMLP),
                                           (qwen3_moe.Qwen3MoeRMSNorm,), _own_window, qk_norms="heads"),
    phi3.Phi3ForCausalLM: _Family(phi3.Phi3Model, phi3.Phi3DecoderLayer, phi3.Phi3Attention, (phi3.Phi3MLP,),
                                  (phi3.Phi3RMSNorm,), _config_window, fused=True),
    olmo2.Olmo2ForCausalLM: _Family(olmo2.Olmo2Model, olmo2.Olmo2DecoderLayer, olmo2.Olmo2Attention,
                                    (olmo2.Olmo2MLP,), (olmo2.Olmo2RMSNorm,), lambda attention: None,
                                    qk_norms="whole", placement="after"),
    granite.GraniteForCausalLM: _Family(granite.GraniteModel, granite.GraniteDecoderLayer, granite.GraniteAttention,
                                        (granite.GraniteMLP,), (granite.GraniteRMSNorm,), lambda attention: None,
                                        scaled=True),
    smollm3.SmolLM3ForCausalLM: _Family(smollm3.SmolLM3Model, smollm3.SmolLM3DecoderLayer,
                                        smollm3.SmolLM3Attention, (smollm3.SmolLM3MLP,), (smollm3.SmolLM3RMSNorm,),
                                        _own_window, rotated=lambda attention: bool(attention.use_rope)),
    starcoder2.Starcoder2ForCausalLM: _Family(starcoder2.Starcoder2Model, starcoder2.Starcoder2DecoderLayer,
                                              starcoder2.Starcoder2Attention, (starcoder2.Starcoder2MLP,),
                                              (nn.LayerNorm,), _config_window),
    gemma.GemmaForCausalLM: _Family(gemma.GemmaModel, gemma.GemmaDecoderLayer, gemma.GemmaAttention, (gemma.GemmaMLP,),
                                    (gemma.GemmaRMSNorm,), lambda attention: None,
                                    embedding=gemma.GemmaTextScaledWordEmbedding),
    gemma2.Gemma2ForCausalLM: _Family(gemma2.Gemma2Model, gemma2.Gemma2DecoderLayer, gemma2.Gemma2Attention,
                                      (gemma2.Gemma2MLP,), (gemma2.Gemma2RMSNorm,), _own_window, placement="around",
                                      softcap=lambda attention: attention.attn_logit_softcapping, final_softcap=True,
                                      embedding=gemma2.Gemma2TextScaledWordEmbedding),
    gemma3.Gemma3ForCausalLM: _Family(gemma3.Gemma3TextModel, gemma3.Gemma3DecoderLayer, gemma3.Gemma3Attention,
                                      (gemma3.Gemma3MLP,), (gemma3.Gemma3RMSNorm,), _own_window,
                                      qk_norms="heads, transposed", placement="around", rotary_by_layer_type=True,
                                      final_softcap=True, embedding=gemma3.Gemma3TextScaledWordEmbedding),
}


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotation of queries or keys [B, heads, T, D], over the first dimensions that
    cos and sin cover (a partial rotation passes the rest through, as Phi-3's does)."""
    width = cos.shape[-1]
    if width == states.shape[-1]:
        return (states * cos) + (llama.rotate_half(states) * sin)
    turned, passed = states[..., :width], states[..., width:]
    return torch.cat([(turned * cos) + (llama.rotate_half(turned) * sin), passed], dim=-1)


class LeanDecoder:
    """The batched forward of one model of `_FAMILIES` (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        # The model's parts, not the model: the store keys its forwards weakly by the model
        # (`kvstore.use_forward`), and a forward holding the model would keep it alive.
        self.base, self.lm_head = model.model, model.lm_head
        self.layers: list[Any] = list(model.model.layers[: model.config.num_hidden_layers])
        family = self.family = _FAMILIES[type(model)]
        self.windows = [family.window(layer.self_attn) for layer in self.layers]
        self.rotated = [family.rotated(layer.self_attn) for layer in self.layers]
        # Granite's scales; other families have none (None: no operator at all).
        self.embedding_multiplier = model.model.embedding_multiplier if family.scaled else None
        self.logits_scaling = model.config.logits_scaling if family.scaled else None
        self.final_softcap = model.config.final_logit_softcapping if family.final_softcap else None
        self.softcaps = [family.softcap(layer.self_attn) for layer in self.layers]
        # Gemma 3: each layer rotates with the embedding of its kind (None: one for all layers).
        self.layer_types = [model.config.layer_types[i] for i in range(len(self.layers))] \
            if family.rotary_by_layer_type else None

    def _project(self, attention: Any, normed: torch.Tensor,
                 heads: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, T, heads, D], as the family's attention makes them."""
        family = self.family
        if family.fused:
            qkv = attention.qkv_proj.forward(normed)
            queries = attention.config.num_attention_heads * attention.head_dim
            keys = queries + attention.num_key_value_heads * attention.head_dim
            return qkv[..., :queries].view(heads), qkv[..., queries:keys].view(heads), qkv[..., keys:].view(heads)
        value = attention.v_proj.forward(normed).view(heads)
        if family.qk_norms == "whole":
            return (attention.q_norm.forward(attention.q_proj.forward(normed)).view(heads),
                    attention.k_norm.forward(attention.k_proj.forward(normed)).view(heads), value)
        query = attention.q_proj.forward(normed).view(heads)
        key = attention.k_proj.forward(normed).view(heads)
        if family.qk_norms == "heads":
            query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
        return query, key, value

    def _rotations(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's cos and sin [B, 1, T, D], from the model's rotary module: called as a
        module (rotary types that rescale with the positions, dynamic or longrope, do it in
        the call's decorator), once per kind of layer where the kinds rotate differently."""
        rotary = self.base.rotary_emb
        if self.layer_types is None:
            cos, sin = rotary(hidden, position_ids=position_ids)
            return [(cos.unsqueeze(1), sin.unsqueeze(1))] * len(self.layers)
        kinds = {}
        for kind in set(self.layer_types):
            cos, sin = rotary(hidden, position_ids, kind)
            kinds[kind] = (cos.unsqueeze(1), sin.unsqueeze(1))
        return [kinds[kind] for kind in self.layer_types]

    def _residual(self, hidden: torch.Tensor, branch: torch.Tensor, layer: Any) -> torch.Tensor:
        """The residual stream with a sublayer's output added (scaled first, in Granite)."""
        if self.family.scaled:
            return hidden + branch * layer.residual_multiplier
        return hidden + branch

    def __call__(self, inputs: BatchInputs) -> torch.Tensor:
        """The kept logits [1, Σ keep, V] of one batched forward, as the model's own
        forward computes them for the same inputs. Called in inference mode, as the
        store's forwards and trials run (`kvstore.forward`, `kvstore.trial_logits`): not
        entered again here, on every forward."""
        base, cache, placement = self.base, inputs.cache, self.family.placement
        transposed_norms = self.family.qk_norms == "heads, transposed"
        hidden = base.embed_tokens.forward(inputs.input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        rotations = self._rotations(hidden, inputs.position_ids)
        # OLMo 2's rotary module keeps cos and sin in float32; its rotation casts back.
        cast = rotations[0][0].dtype != hidden.dtype
        tokens = inputs.input_ids.shape
        for layer, window, rotated, (cos, sin), softcap in zip(self.layers, self.windows, self.rotated, rotations,
                                                               self.softcaps):
            attention = layer.self_attn
            normed = hidden if placement == "after" else layer.input_layernorm.forward(hidden)
            query, key, value = self._project(attention, normed, (*tokens, -1, attention.head_dim))
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            if transposed_norms:
                query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
            if rotated:
                query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
                if cast:
                    query, key = query.to(hidden.dtype), key.to(hidden.dtype)
            key, value = cache.update(key, value, attention.layer_idx)
            attended, _ = kvstore.paged_attention(attention, query, key, value, None, scaling=attention.scaling,
                                                  sliding_window=window, softcap=softcap, batch_cache=cache)
            attended = attention.o_proj.forward(attended.reshape(*tokens, -1).contiguous())
            if placement == "before":
                hidden = self._residual(hidden, attended, layer)
                hidden = self._residual(hidden, layer.mlp.forward(layer.post_attention_layernorm.forward(hidden)),
                                        layer)
                continue
            # OLMo 2, Gemma 2 and 3: each sublayer's output normed, then added; Gemma's MLP
            # input normed too.
            hidden = hidden + layer.post_attention_layernorm.forward(attended)
            fed = hidden if placement == "after" else layer.pre_feedforward_layernorm.forward(hidden)
            hidden = hidden + layer.post_feedforward_layernorm.forward(layer.mlp.forward(fed))
        # Normed whole, then cut to the kept rows, as the model does: a device may split the
        # norm's reduction by the number of rows.
        logits = self.lm_head.forward(base.norm.forward(hidden)[:, inputs.logits_to_keep, :])
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:  # three operators, as the model runs them
            logits = logits / self.final_softcap
            logits = torch.tanh(logits)
            logits = logits * self.final_softcap
        return logits


def _unmirrored(model: nn.Module) -> str | None:
    """Why `LeanDecoder` does not mirror `model`'s own forward (None: it does)."""
    family = _FAMILIES.get(type(model))
    if family is None:
        return f"{type(model).__name__} is not one of {', '.join(kind.__name__ for kind in _FAMILIES)}"
    if any(module.training for module in model.modules()):
        return "a module of it is in training mode (its dropout would be skipped)"
    base: Any = model.model  # transformers' modules are untyped to mypy here (pyproject.toml)
    # Each module's kind is checked before its children are looked at.
    norms = family.norms
    parts: list[tuple[Any, tuple[type, ...]]] = [(base, (family.base,)), (base.embed_tokens, (family.embedding,)),
                                                 (base.norm, norms), (model.lm_head, _LINEARS)]
    sublayer_norms = {"before": ("input_layernorm", "post_attention_layernorm"),
                      "after": ("post_attention_layernorm", "post_feedforward_layernorm"),
                      "around": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                 "post_feedforward_layernorm")}[family.placement]
    projections = ("qkv_proj", "o_proj") if family.fused else ("q_proj", "k_proj", "v_proj", "o_proj")
    for layer in base.layers:
        parts += [(layer, (family.layer,)), (layer.self_attn, (family.attention,)), (layer.mlp, family.mlps)]
        parts += [(getattr(layer, name), norms) for name in sublayer_norms]
        if family.qk_norms:
            parts += [(layer.self_attn.q_norm, norms), (layer.self_attn.k_norm, norms)]
        parts += [(getattr(layer.self_attn, name), _LINEARS) for name in projections]
    for module, kinds in parts:
        if type(module) not in kinds:
            return f"{type(module).__name__} in place of {' or '.join(kind.__name__ for kind in kinds)}"
    # Hooks (a module's own, or global ones that torch runs for every module), and a forward
    # set on the instance (accelerate's offloading does that), would be skipped by calls to
    # the class's `forward`.
    if (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks
            or any(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
                   for module in model.modules())):
        return "hooks or a forward of its own on its modules (the lean forward would skip them)"
    return None


def install(model: nn.Module, pool: KVPool, vocab_size: int, device: torch.device) -> str | None:
    """Route `model`'s batched forwards through a `LeanDecoder`, when it mirrors the model
    and a trial forward at load agrees with the model's own to the bit; else why not."""
    problem = _unmirrored(model)
    if problem is not None:
        return problem
    own = kvstore.trial_logits(functools.partial(kvstore.own_forward, model), pool, vocab_size, device)
    if isinstance(own, str):
        return own
    lean = LeanDecoder(model)
    try:
        mirrored = kvstore.trial_logits(lean, pool, vocab_size, device)
    except Exception as exc:  # whatever it raises, the model keeps its own forward
        return f"the lean forward fails its trial: {type(exc).__name__}: {exc}"
    if isinstance(mirrored, str):
        return mirrored
    if not all(torch.equal(a, b) for a, b in zip(own, mirrored)):
        return "its trial logits differ from the model's own forward"
    kvstore.use_forward(model, lean)
    return None
