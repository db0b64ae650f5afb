"""A lean forward for Llama-architecture models (Llama, Mistral, Qwen2, Qwen3): the
operators of transformers' own forward, without its per-call machinery.

Why: on a CPU a small model's forward is mostly Python, not arithmetic. transformers'
Llama forward passes every module call through keyword handling, decorators, output
capture and a causal mask that paged attention never reads. Measured on this project's
2-core CPU, one session feeding one token (docs/performance.md, item 13): the near-free
target's forward fell from about 1.3 to 0.85 ms and the demo draft's from about 2.0 to 1.6.
On a GPU the same Python is what keeps the device waiting at small batches.

What it runs: each layer's own submodules (`forward` of the norms, projections and MLP),
the model's own rotary embedding, `BatchCache.update` and `paged_attention`, in the order
and with the inputs of `LlamaDecoderLayer.forward` (Mistral's, Qwen2's and Qwen3's layers
are the same code, their attention adding a sliding window, and Qwen3's a norm over each
head of the queries and keys). So every operator sees what it sees in the model's own
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
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from specd.worker import kvstore
from specd.worker.kvstore import BatchInputs, KVPool
from specd.worker.packing import PackedLinear

_LINEARS = (nn.Linear, PackedLinear)


@dataclass(frozen=True)
class _Family:
    """transformers' classes of a family whose forward is Llama's line for line but for
    the sliding window its attention hands the attention interface, and, where
    `head_norms`, an RMS norm over each head of the queries and keys before the rotation
    (Qwen3's `q_norm` and `k_norm`)."""

    base: type
    layer: type
    attention: type
    mlp: type
    norm: type
    window: Callable[[Any], int | None]
    head_norms: bool = False


_FAMILIES = {
    llama.LlamaForCausalLM: _Family(llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP,
                                    llama.LlamaRMSNorm, lambda attention: None),
    mistral.MistralForCausalLM: _Family(mistral.MistralModel, mistral.MistralDecoderLayer, mistral.MistralAttention,
                                        mistral.MistralMLP, mistral.MistralRMSNorm,
                                        lambda attention: getattr(attention.config, "sliding_window", None)),
    qwen2.Qwen2ForCausalLM: _Family(qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP,
                                    qwen2.Qwen2RMSNorm, lambda attention: attention.sliding_window),
    qwen3.Qwen3ForCausalLM: _Family(qwen3.Qwen3Model, qwen3.Qwen3DecoderLayer, qwen3.Qwen3Attention, qwen3.Qwen3MLP,
                                    qwen3.Qwen3RMSNorm, lambda attention: attention.sliding_window, head_norms=True),
}


class LeanDecoder:
    """The batched forward of one model of `_FAMILIES` (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        # The model's parts, not the model: the store keys its forwards weakly by the model
        # (`kvstore.use_forward`), and a forward holding the model would keep it alive.
        self.base, self.lm_head = model.model, model.lm_head
        self.layers: list[Any] = list(model.model.layers[: model.config.num_hidden_layers])
        family = _FAMILIES[type(model)]
        self.windows = [family.window(layer.self_attn) for layer in self.layers]
        self.head_norms = family.head_norms

    def __call__(self, inputs: BatchInputs) -> torch.Tensor:
        """The kept logits [1, Σ keep, V] of one batched forward, as the model's own
        forward computes them for the same inputs. Called in inference mode, as the
        store's forwards and trials run (`kvstore.forward`, `kvstore.trial_logits`): not
        entered again here, on every forward."""
        base, cache = self.base, inputs.cache
        hidden = base.embed_tokens.forward(inputs.input_ids)
        # Called as a module: rotary types that rescale with the positions (dynamic, longrope)
        # do it in the call's decorator.
        cos, sin = base.rotary_emb(hidden, position_ids=inputs.position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        tokens = inputs.input_ids.shape
        for layer, window in zip(self.layers, self.windows):
            attention = layer.self_attn
            heads = (*tokens, -1, attention.head_dim)
            normed = layer.input_layernorm.forward(hidden)
            query = attention.q_proj.forward(normed).view(heads)
            key = attention.k_proj.forward(normed).view(heads)
            if self.head_norms:
                query, key = attention.q_norm.forward(query), attention.k_norm.forward(key)
            query, key = query.transpose(1, 2), key.transpose(1, 2)
            value = attention.v_proj.forward(normed).view(heads).transpose(1, 2)
            query = (query * cos) + (llama.rotate_half(query) * sin)
            key = (key * cos) + (llama.rotate_half(key) * sin)
            key, value = cache.update(key, value, attention.layer_idx)
            attended, _ = kvstore.paged_attention(attention, query, key, value, None, scaling=attention.scaling,
                                                  sliding_window=window, batch_cache=cache)
            hidden = hidden + attention.o_proj.forward(attended.reshape(*tokens, -1).contiguous())
            hidden = hidden + layer.mlp.forward(layer.post_attention_layernorm.forward(hidden))
        # Normed whole, then cut to the kept rows, as the model does: a device may split the
        # norm's reduction by the number of rows.
        return self.lm_head.forward(base.norm.forward(hidden)[:, inputs.logits_to_keep, :])


def _unmirrored(model: nn.Module) -> str | None:
    """Why `LeanDecoder` does not mirror `model`'s own forward (None: it does)."""
    family = _FAMILIES.get(type(model))
    if family is None:
        return f"{type(model).__name__} is not one of {', '.join(kind.__name__ for kind in _FAMILIES)}"
    base: Any = model.model  # transformers' modules are untyped to mypy here (pyproject.toml)
    # Each module's kind is checked before its children are looked at.
    norm = (family.norm,)
    parts: list[tuple[Any, tuple[type, ...]]] = [(base, (family.base,)), (base.embed_tokens, (nn.Embedding,)),
                                                 (base.norm, norm), (model.lm_head, _LINEARS)]
    for layer in base.layers:
        parts += [(layer, (family.layer,)), (layer.self_attn, (family.attention,)), (layer.mlp, (family.mlp,)),
                  (layer.input_layernorm, norm), (layer.post_attention_layernorm, norm)]
        if family.head_norms:
            parts += [(layer.self_attn.q_norm, norm), (layer.self_attn.k_norm, norm)]
    for module, kinds in parts:
        if type(module) not in kinds:
            return f"{type(module).__name__} in place of {' or '.join(kind.__name__ for kind in kinds)}"
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj):
            if type(linear) not in _LINEARS:
                return f"{type(linear).__name__} in place of a linear layer"
    # Hooks, and a forward set on the instance (accelerate's offloading does that), would be
    # skipped by calls to the class's `forward`.
    if any(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module)
           for module in model.modules()):
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
