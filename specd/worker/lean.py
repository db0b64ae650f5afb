"""A lean forward for Llama-architecture models: the operators of transformers' own
forward, without its per-call machinery.

Why: on a CPU a small model's forward is mostly Python, not arithmetic. transformers'
Llama forward passes every module call through keyword handling, decorators, output
capture and a causal mask that paged attention never reads. Measured on this project's
2-core CPU, one session feeding one token (docs/performance.md, item 13): the near-free
target's forward fell from about 1.3 to 0.85 ms and the demo draft's from about 2.0 to 1.6.
On a GPU the same Python is what keeps the device waiting at small batches.

What it runs: each layer's own submodules (`forward` of the norms, projections and MLP),
the model's own rotary embedding, `BatchCache.update` and `paged_attention`, in the order
and with the inputs of `LlamaDecoderLayer.forward`. So every operator sees what it sees in
the model's own forward, and the logits are the same bit for bit. Two guards keep it so:
`install` takes a model only when its classes are transformers' Llama classes (whose
forward this mirrors line for line) with no hooks, and only when a trial at load gives
logits exactly equal to the model's own batched forward. Any other model keeps
transformers' forward (`specd.worker.kvstore`), and `--model-forward transformers` keeps
it for every model.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from transformers.models.llama import modeling_llama as llama

from specd.worker import kvstore
from specd.worker.kvstore import BatchInputs, KVPool
from specd.worker.packing import PackedLinear

_LINEARS = (nn.Linear, PackedLinear)


class LeanDecoder:
    """The batched forward of one `LlamaForCausalLM` (see the module's docstring)."""

    def __init__(self, model: llama.LlamaForCausalLM) -> None:
        self.model = model
        self.layers: list[llama.LlamaDecoderLayer] = list(model.model.layers[: model.config.num_hidden_layers])

    @torch.inference_mode()
    def __call__(self, inputs: BatchInputs) -> torch.Tensor:
        """The kept logits [1, Σ keep, V] of one batched forward, as the model's own
        forward computes them for the same inputs."""
        base, cache = self.model.model, inputs.cache
        hidden = base.embed_tokens.forward(inputs.input_ids)
        # Called as a module: rotary types that rescale with the positions (dynamic, longrope)
        # do it in the call's decorator.
        cos, sin = base.rotary_emb(hidden, position_ids=inputs.position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        tokens = inputs.input_ids.shape
        for layer in self.layers:
            attention = layer.self_attn
            heads = (*tokens, -1, attention.head_dim)
            normed = layer.input_layernorm.forward(hidden)
            query = attention.q_proj.forward(normed).view(heads).transpose(1, 2)
            key = attention.k_proj.forward(normed).view(heads).transpose(1, 2)
            value = attention.v_proj.forward(normed).view(heads).transpose(1, 2)
            query = (query * cos) + (llama.rotate_half(query) * sin)
            key = (key * cos) + (llama.rotate_half(key) * sin)
            key, value = cache.update(key, value, attention.layer_idx)
            attended, _ = kvstore.paged_attention(attention, query, key, value, None, scaling=attention.scaling,
                                                  batch_cache=cache)
            hidden = hidden + attention.o_proj.forward(attended.reshape(*tokens, -1).contiguous())
            hidden = hidden + layer.mlp.forward(layer.post_attention_layernorm.forward(hidden))
        # The final norm works row by row, so norming only the kept rows changes no bit of them.
        return self.model.lm_head.forward(base.norm.forward(hidden[:, inputs.logits_to_keep]))


def _unmirrored(model: nn.Module) -> str | None:
    """Why `LeanDecoder` does not mirror `model`'s own forward (None: it does)."""
    if type(model) is not llama.LlamaForCausalLM or type(model.model) is not llama.LlamaModel:
        return f"{type(model).__name__} is not transformers' LlamaForCausalLM"
    base: Any = model.model  # transformers' modules are untyped to mypy here (pyproject.toml)
    # Each module's kind is checked before its children are looked at.
    norm = (llama.LlamaRMSNorm,)
    parts: list[tuple[Any, tuple[type, ...]]] = [(base.embed_tokens, (nn.Embedding,)), (base.norm, norm),
                                                 (model.lm_head, _LINEARS)]
    for layer in base.layers:
        parts += [(layer, (llama.LlamaDecoderLayer,)), (layer.self_attn, (llama.LlamaAttention,)),
                  (layer.mlp, (llama.LlamaMLP,)), (layer.input_layernorm, norm), (layer.post_attention_layernorm, norm)]
    for module, kinds in parts:
        if type(module) not in kinds:
            return f"{type(module).__name__} in place of {' or '.join(kind.__name__ for kind in kinds)}"
    for layer in base.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                       mlp.up_proj, mlp.down_proj):
            if type(linear) not in _LINEARS:
                return f"{type(linear).__name__} in place of a linear layer"
    if any(module._forward_hooks or module._forward_pre_hooks for module in model.modules()):
        return "hooks on its modules (the lean forward would skip them)"
    return None


def install(model: nn.Module, pool: KVPool, vocab_size: int, device: torch.device) -> str | None:
    """Route `model`'s batched forwards through a `LeanDecoder`, when it mirrors the model
    and a trial forward at load agrees with the model's own to the bit; else why not."""
    problem = _unmirrored(model)
    if problem is not None:
        return problem
    assert isinstance(model, llama.LlamaForCausalLM)
    lean = LeanDecoder(model)
    own = kvstore.trial_logits(functools.partial(kvstore.own_forward, model), pool, vocab_size, device)
    mirrored = kvstore.trial_logits(lean, pool, vocab_size, device)
    if isinstance(own, str):
        return own
    if isinstance(mirrored, str):
        return mirrored
    if not all(torch.equal(a, b) for a, b in zip(own, mirrored)):
        return "its trial logits differ from the model's own forward"
    kvstore.use_forward(model, lean)
    return None
