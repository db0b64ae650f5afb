"""A lean forward for Llama-architecture models (Llama, Mistral, Qwen2, Qwen3, their
mixture-of-experts kin Mixtral and Qwen3-MoE, Phi-3, OLMo 2, Granite, SmolLM3, StarCoder2,
and Gemma 1, 2 and 3): the operators of transformers' own forward, without its per-call
machinery.

Why: on a CPU a small model's forward is mostly Python, not arithmetic. transformers'
Llama forward passes every module call through keyword handling, decorators, output
capture and a causal mask that paged attention never reads. Measured on this project's
2-core CPU, one session feeding one token (docs/serving-path.md, "The lean forward"): the near-free
target's forward fell from about 1.3 to 0.85 ms and the demo draft's from about 2.0 to 1.6.
On a GPU the same Python is what keeps the device waiting at small batches.

What it runs: each layer's own submodules (the `forward` of its norms and MLP, a mixture
of experts' included; a plain linear layer's operator), the model's own rotary embedding,
`BatchCache.update` and `paged_attention`, in the order and with the inputs of the
family's decoder layer. Where a norm or an MLP runs Llama's own code (most families copy
it), its operators are called here instead of its `forward`, some in place, and Llama's
rotation takes four operators, not seven (`_norm`, `_mlp`, `_Rotation`): each gives the
same bits, and the demo draft's forward is 6–7% faster for them (docs/serving-path.md,
"The lean forward").
The families differ from Llama's layer in a few named ways (`_Family`): a sliding window,
norms over the queries and keys, one fused q/k/v projection, a partial rotation, norms
after each sublayer rather than (or as well as) before, layers without rotation or with
a rotation of their own kind, scaled embeddings, residual branches and logits, and
soft-capped scores and logits. So every operator sees what it sees in the model's own
forward, and the logits are the same bit for bit. Two guards keep it so: `install` takes
a model only when its classes are those of a family in `_FAMILIES` (whose forward this
mirrors line for line), with no hooks and no forward set on an instance, and only when a
trial at load gives logits exactly equal to the model's own batched forward. Any other model keeps
transformers' forward (`specd.worker.forwards`), and `--model-forward transformers` keeps
it for every model.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

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

from specd.worker import forwards, trials
from specd.worker.attention import paged_attention
from specd.worker.kvstore import KVPool
from specd.worker.layout import BatchInputs
from specd.worker.packing import PackedLinear, PackedSlice
from specd.worker.sharing import SubsetHead

# A layer packed with its siblings too; an output layer over part of the vocabulary too.
_LINEARS = (nn.Linear, PackedLinear, PackedSlice, SubsetHead)


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


def _same_code(function: Callable, reference: Callable) -> bool:
    """Whether `function` runs `reference`'s bytecode on the same names and constants.
    transformers copies Llama's norm and MLP into most families, each a function of its own."""
    a, b = function.__code__, reference.__code__
    return (a.co_code, a.co_consts, a.co_names, a.co_varnames) == (b.co_code, b.co_consts, b.co_names, b.co_varnames)


Step = Callable[[torch.Tensor], torch.Tensor]

# Each placement's sublayer norms, by where they sit: before attention, on its output,
# before the MLP, on its output (None: the family has none there).
_SUBLAYER_NORMS: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "before": ("input_layernorm", None, "post_attention_layernorm", None),
    "after": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
    "around": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm"),
}


def _norm(norm: Any) -> Step:
    """`norm`'s forward; where that is Llama's RMS norm, its eight operators with the same
    bits and no module call: the epsilon, the root and the weight applied in place (x · w
    is w · x to the bit; out of place where the weight's dtype is not the output's), so
    three fewer tensors are made. On the demo draft its five norms were an eighth of a
    forward."""
    if not _same_code(type(norm).forward, llama.LlamaRMSNorm.forward):
        return norm.forward
    weight, epsilon = norm.weight, norm.variance_epsilon

    def rms_norm(hidden: torch.Tensor) -> torch.Tensor:
        states = hidden.to(torch.float32)
        root = states.pow(2).mean(-1, keepdim=True).add_(epsilon).rsqrt_()
        normed = (states * root).to(hidden.dtype)
        return normed.mul_(weight) if weight.dtype == normed.dtype else weight * normed

    return rms_norm


def _linear(module: Any) -> Step:
    """A linear layer's product with its weights looked up once: for a plain `nn.Linear`
    the operator its forward calls, without the call; any other layer's own forward."""
    if type(module) is nn.Linear:
        return functools.partial(nn.functional.linear, weight=module.weight, bias=module.bias)
    return module.forward


def _joined(*layers: Any) -> Step | None:
    """The one product `layers` are consecutive columns of, in order, from the first
    (`packing.pack_linears`' groups); None where they are not."""
    if not all(type(layer) is PackedSlice for layer in layers):
        return None
    product = layers[0].product
    bounds = [0] + [layer.stop for layer in layers]
    if any(layer.product is not product or layer.start != start for layer, start in zip(layers, bounds)) \
            or bounds[-1] != product.out_features:
        return None
    return product.forward


def joinable(model: nn.Module) -> list[tuple[str, ...]]:
    """The sibling layers of `model` the lean forward computes as one product when they are
    packed as one (`packing.pack_linears`' groups): each layer's q, k and v projections, and
    a gated MLP's gate and up projections. No group for a model the lean forward does not mirror:
    its own forward would compute each such product once per sibling."""
    if _unmirrored(model) is not None:
        return []
    family = _FAMILIES[type(model)]
    mirrored: Any = model  # transformers' modules are untyped to mypy here (pyproject.toml)
    groups: list[tuple[str, ...]] = []
    for index, layer in enumerate(mirrored.model.layers[: mirrored.config.num_hidden_layers]):
        prefix = f"model.layers.{index}."
        if not family.fused:
            groups.append(tuple(f"{prefix}self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj")))
        if _same_code(type(layer.mlp).forward, llama.LlamaMLP.forward):
            groups.append((f"{prefix}mlp.gate_proj", f"{prefix}mlp.up_proj"))
    return groups


def _mlp(mlp: Any) -> Step:
    """`mlp`'s forward; where that is Llama's gated MLP, the same products with its
    submodules' forwards looked up once (the gate's and the up projection's as one, where
    they are packed as one) and the gate times the up projection in place."""
    if not _same_code(type(mlp).forward, llama.LlamaMLP.forward):
        return mlp.forward
    gate, up, down = _linear(mlp.gate_proj), _linear(mlp.up_proj), _linear(mlp.down_proj)
    act = mlp.act_fn.forward if isinstance(mlp.act_fn, nn.Module) else mlp.act_fn
    both, inner = _joined(mlp.gate_proj, mlp.up_proj), mlp.gate_proj.out_features

    def gated(hidden: torch.Tensor) -> torch.Tensor:
        if both is not None:
            product = both(hidden)
            activated, upward = act(product[..., :inner]), product[..., inner:]
        else:
            activated, upward = act(gate(hidden)), up(hidden)
        # In place only where that keeps the product's dtype (an in-place product casts to its left side's).
        return down(activated.mul_(upward) if activated.dtype == upward.dtype else activated * upward)

    return gated


class _Rotation(NamedTuple):
    """The cos and sin [B, 1, T, width] of one kind of layer, and the sin with its first
    half negated (`signed_sin`; None for a partial rotation). A named tuple, not a frozen
    dataclass: torch 2.11's graph tracer (the GPU image's) cannot build the latter."""

    cos: torch.Tensor
    sin: torch.Tensor
    signed_sin: torch.Tensor | None

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> _Rotation:
        width = cos.shape[-1]
        if width != head_dim or width % 2:  # a partial rotation (Phi-3) rotates as Llama writes it
            return cls(cos, sin, None)
        half = width // 2
        return cls(cos, sin, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        """Llama's rotation of queries or keys [B, heads, T, D], over the first dimensions
        that cos covers (a partial rotation passes the rest through, as Phi-3's does).

        Llama's `rotate_half(x) · sin` is (−x₂, x₁) · (s₁, s₂); with the halves of x swapped
        (one `roll`) and the sign moved onto sin, it is (x₂ · −s₁, x₁ · s₂): the same bits,
        since negation is exact. Four operators a rotation, not seven; `of` negates the
        half of sin once a forward."""
        cos, sin = self.cos, self.sin
        if self.signed_sin is not None:
            rotated = states * cos
            return rotated.add_(states.roll(cos.shape[-1] // 2, -1) * self.signed_sin)
        width = cos.shape[-1]
        turned, passed = states[..., :width], states[..., width:]
        return torch.cat([(turned * cos) + (llama.rotate_half(turned) * sin), passed], dim=-1)


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, looked up once: each module attribute read in a forward
    goes through torch's `Module.__getattr__`. The four norms, by where they sit (None: the
    family has none there): before attention, on its output, before the MLP, on its output."""

    attention: Any
    project: tuple[Step, ...]  # q, k, v; or one product of all three (Phi-3's, or packed so)
    output: Step
    q_norm: Step | None
    k_norm: Step | None
    before_attention: Step | None
    after_attention: Step | None
    before_mlp: Step | None
    after_mlp: Step | None
    mlp: Step
    residual_multiplier: float | None  # Granite's


def _layer(layer: Any, family: _Family) -> _Layer:
    """`layer`'s parts, by its family's placement of norms and kind of projection."""
    attention = layer.self_attn
    names = ("qkv_proj",) if family.fused else ("q_proj", "k_proj", "v_proj")
    project = tuple(_linear(getattr(attention, name)) for name in names)
    joined = _joined(*(getattr(attention, name) for name in names))
    before_attention, after_attention, before_mlp, after_mlp = (
        None if name is None else _norm(getattr(layer, name)) for name in _SUBLAYER_NORMS[family.placement])
    return _Layer(attention=attention, project=project if joined is None else (joined,),
                  output=_linear(attention.o_proj),
                  q_norm=_norm(attention.q_norm) if family.qk_norms else None,
                  k_norm=_norm(attention.k_norm) if family.qk_norms else None,
                  before_attention=before_attention, after_attention=after_attention, before_mlp=before_mlp,
                  after_mlp=after_mlp, mlp=_mlp(layer.mlp),
                  residual_multiplier=layer.residual_multiplier if family.scaled else None)


class LeanDecoder:
    """The batched forward of one model of `_FAMILIES` (see the module's docstring)."""

    def __init__(self, model: Any) -> None:
        # The model's parts, not the model: the store keys its forwards weakly by the model
        # (`forwards.use_forward`), and a forward holding the model would keep it alive.
        self.base, self.lm_head = model.model, _linear(model.lm_head)
        layers: list[Any] = list(model.model.layers[: model.config.num_hidden_layers])
        family = self.family = _FAMILIES[type(model)]
        self.layers = [_layer(layer, family) for layer in layers]
        self.head_dim = layers[0].self_attn.head_dim  # one for all layers: the KV store holds one shape
        self.final_norm = _norm(model.model.norm)
        self.windows = [family.window(layer.self_attn) for layer in layers]
        self.rotated = [family.rotated(layer.self_attn) for layer in layers]
        # Granite's scales; other families have none (None: no operator at all).
        self.embedding_multiplier = model.model.embedding_multiplier if family.scaled else None
        self.logits_scaling = model.config.logits_scaling if family.scaled else None
        self.final_softcap = model.config.final_logit_softcapping if family.final_softcap else None
        self.softcaps = [family.softcap(layer.self_attn) for layer in layers]
        # Gemma 3: each layer rotates with the embedding of its kind (None: one for all layers).
        self.layer_types = [model.config.layer_types[i] for i in range(len(layers))] \
            if family.rotary_by_layer_type else None

    def _project(self, layer: _Layer, normed: torch.Tensor,
                 heads: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [B, T, heads, D], as the family's attention makes them."""
        family, attention = self.family, layer.attention
        if len(layer.project) == 1:  # one product, cut into q, k and v
            qkv = layer.project[0](normed)
            queries = attention.config.num_attention_heads * attention.head_dim
            keys = queries + (qkv.shape[-1] - queries) // 2  # as many values as keys
            query, key, value = qkv[..., :queries], qkv[..., queries:keys], qkv[..., keys:]
        else:
            project_query, project_key, project_value = layer.project
            query, key, value = project_query(normed), project_key(normed), project_value(normed)
        if family.qk_norms == "whole":
            query, key = layer.q_norm(query), layer.k_norm(key)  # type: ignore[misc]  # set for this family
        query, key, value = query.view(heads), key.view(heads), value.view(heads)
        if family.qk_norms == "heads":
            query, key = layer.q_norm(query), layer.k_norm(key)  # type: ignore[misc]
        return query, key, value

    def _rotations(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[_Rotation]:
        """Each layer's rotation, from the model's rotary module: called as a module
        (rotary types that rescale with the positions, dynamic or longrope, do it in the
        call's decorator), once per kind of layer where the kinds rotate differently."""
        rotary = self.base.rotary_emb
        if self.layer_types is None:
            cos, sin = rotary(hidden, position_ids=position_ids)
            return [_Rotation.of(cos.unsqueeze(1), sin.unsqueeze(1), self.head_dim)] * len(self.layers)
        kinds = {}
        for kind in set(self.layer_types):
            cos, sin = rotary(hidden, position_ids, kind)
            kinds[kind] = _Rotation.of(cos.unsqueeze(1), sin.unsqueeze(1), self.head_dim)
        return [kinds[kind] for kind in self.layer_types]

    @staticmethod
    def _residual(hidden: torch.Tensor, branch: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The residual stream with a sublayer's output added (scaled first, in Granite)."""
        if layer.residual_multiplier is not None:
            return hidden + branch * layer.residual_multiplier
        return hidden + branch

    def __call__(self, inputs: BatchInputs) -> torch.Tensor:
        """The kept logits [1, Σ keep, V] of one batched forward, as the model's own
        forward computes them for the same inputs. Called in inference mode, as the
        store's forwards and trials run (`forwards.forward`, `trials.trial_logits`): not
        entered again here, on every forward."""
        # Normed whole, then cut to the kept rows, as the model does: a device may split the
        # norm's reduction by the number of rows.
        return self.head(self.body(inputs)[:, inputs.logits_to_keep, :])

    def body(self, inputs: BatchInputs) -> torch.Tensor:
        """The final norm's output [1, Σ T, H] at every position of one batched forward:
        all but the output layer (a CUDA graph captures this part, `specd.worker.graphs`)."""
        base, cache = self.base, inputs.cache
        transposed_norms = self.family.qk_norms == "heads, transposed"
        hidden = base.embed_tokens.forward(inputs.input_ids)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        rotations = self._rotations(hidden, inputs.position_ids)
        # OLMo 2's rotary module keeps cos and sin in float32; its rotation casts back.
        cast = rotations[0].cos.dtype != hidden.dtype
        tokens = inputs.input_ids.shape
        for layer, window, rotated, rotate, softcap in zip(self.layers, self.windows, self.rotated, rotations,
                                                           self.softcaps):
            attention = layer.attention
            normed = hidden if layer.before_attention is None else layer.before_attention(hidden)
            query, key, value = self._project(layer, normed, (*tokens, -1, attention.head_dim))
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            if transposed_norms:
                query, key = layer.q_norm(query), layer.k_norm(key)  # type: ignore[misc]  # set for this family
            if rotated:
                query, key = rotate(query), rotate(key)
                if cast:
                    query, key = query.to(hidden.dtype), key.to(hidden.dtype)
            key, value = cache.update(key, value, attention.layer_idx)
            attended, _ = paged_attention(attention, query, key, value, None, scaling=attention.scaling,
                                          sliding_window=window, softcap=softcap, batch_cache=cache)
            attended = layer.output(attended.reshape(*tokens, -1).contiguous())
            # Llama and most others norm each sublayer's input; OLMo 2 its output, before
            # it joins the residual stream; Gemma 2 and 3 both.
            if layer.after_attention is not None:
                attended = layer.after_attention(attended)
            hidden = self._residual(hidden, attended, layer)
            fed = hidden if layer.before_mlp is None else layer.before_mlp(hidden)
            branch = layer.mlp(fed)
            if layer.after_mlp is not None:
                branch = layer.after_mlp(branch)
            hidden = self._residual(hidden, branch, layer)
        return self.final_norm(hidden)

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """The logits of final-normed rows [..., H] → [..., V], scaled and soft-capped as the
        family does."""
        logits = self.lm_head(normed)
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_softcap is not None:  # three operators, as the model runs them
            logits = logits / self.final_softcap
            logits = torch.tanh(logits)
            logits = logits * self.final_softcap
        return logits


def of_a_family(model: nn.Module) -> bool:
    """Whether `model`'s class is one whose forward `LeanDecoder` mirrors."""
    return type(model) in _FAMILIES


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
    sublayer_norms = [name for name in _SUBLAYER_NORMS[family.placement] if name is not None]
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


def decoder_of(model: nn.Module) -> LeanDecoder | None:
    """The lean forward `install` gave `model` (None: it runs transformers' own)."""
    installed = forwards.stand_in(model)
    return installed if isinstance(installed, LeanDecoder) else None


def install(model: nn.Module, pool: KVPool, vocab_size: int, device: torch.device) -> str | None:
    """Route `model`'s batched forwards through a `LeanDecoder`, when it mirrors the model
    and a trial forward at load agrees with the model's own to the bit; else why not."""
    problem = _unmirrored(model)
    if problem is not None:
        return problem
    own = trials.trial_logits(functools.partial(forwards.own_forward, model), pool, vocab_size, device)
    if isinstance(own, str):
        return own
    try:
        lean = LeanDecoder(model)
        mirrored = trials.trial_logits(lean, pool, vocab_size, device)
    except Exception as exc:  # whatever it raises, the model keeps its own forward
        return f"the lean forward fails its trial: {type(exc).__name__}: {exc}"
    if isinstance(mirrored, str):
        return mirrored
    if not all(torch.equal(a, b) for a, b in zip(own, mirrored)):
        return "its trial logits differ from the model's own forward"
    forwards.use_forward(model, lean)
    return None
