"""A draft that reads its target's features: EAGLE's design, on the target's own weights.

A draft made of the target's first layers (`specd.worker.sharing`) sees only tokens. On
SmolLM2-135M it agrees with the target about a third of the time, and no two hours of
distillation on a CPU bring it near the 0.6-0.7 that makes speculation pay there
(docs/models.md). EAGLE's draft reads more: at position t it takes the target's last
hidden state (its *feature*) at t - 1 beside token t's embedding, and predicts the
target's feature at t, which the target's own output layer turns into the next token's
distribution. Drafting further, it feeds its own predicted features back in place of the
target's.

Its parts:
- `fc`, which folds [embedding, feature] (2H wide) into H;
- one decoder layer of the target's family, started from a copy of the target's last one,
  and a final norm, the target's copied: the features it predicts are normed, as the
  target's are;
- the target's embedding, shared and frozen, and an output layer over part of the
  vocabulary (`SubsetHead`), as the layer-copy draft has.

`unroll` runs the draft over whole sequences the way it drafts: depth k at position t is
the k-th token of a proposal that started at t - k + 1, attending to the target's features
up to its start and to its own predictions after it (the "training-time test" of EAGLE-3
and HASS). So one call gives the acceptance at every depth of a proposal, and training on
every depth teaches the draft to read its own predictions.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from specd.worker.sharing import SubsetHead


class FeatureDraft(nn.Module):
    """fc + one decoder layer over a shared embedding, read out by a `SubsetHead`."""

    def __init__(self, target: Any, vocabulary: list[int]) -> None:
        """A new draft for `target` (a float32 Llama-family causal LM with tied embeddings):
        its embedding shared, its last decoder layer and final norm copied, and an `fc`."""
        super().__init__()
        config = target.config
        width = config.hidden_size
        self.embedding = target.get_input_embeddings()  # shared, frozen
        self.embedding.weight.requires_grad_(False)
        # It starts as "the next feature is this one": fc passes the feature through, and the
        # layer (the target's last, copied) adds nothing until its two output projections
        # learn to. A random fc fed the copied layer inputs of the wrong scale, and the head
        # logits tens of nats off (a forward KL of 15 at the start).
        self.fc = nn.Linear(2 * width, width, bias=True)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, width:].copy_(torch.eye(width))
            self.fc.bias.zero_()
        self.layer = copy.deepcopy(target.model.layers[-1])
        self.layer.self_attn.layer_idx = 0
        with torch.no_grad():
            self.layer.self_attn.o_proj.weight.zero_()
            self.layer.mlp.down_proj.weight.zero_()
        self.norm = copy.deepcopy(target.model.norm)  # features are the target's normed states
        self.rotary = copy.deepcopy(target.model.rotary_emb)
        index = torch.tensor(vocabulary, dtype=torch.long)
        self.head = SubsetHead(self.embedding.weight.detach()[index], index, int(config.vocab_size))
        self.head.linear.weight.requires_grad_(False)

    def _inputs(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.embedding(ids), features.to(self.fc.weight.dtype)], dim=-1))

    def unroll(self, ids: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """The draft's predicted features at depths 1..`depth`, each [B, n, H].

        ids [B, n]: the tokens x_1..x_n; features [B, n, H]: the target's features f_0..f_{n-1}
        (f_t is its last hidden state at x_t, whose output layer gives x_{t+1}). Depth k at
        index i predicts f_{i+1} (so x_{i+2}) for a proposal that started at index i - k + 1:
        its input is x_{i+1} with depth k - 1's prediction at i - 1 (depth 1: the target's
        f_i), and it attends to depth 1's keys up to i - k + 1, then to depth j's at
        i - k + j. Indices below k - 1 start no proposal; their outputs mean nothing.
        """
        attention = self.layer.self_attn
        batch, n = ids.shape
        positions = torch.arange(1, n + 1, device=ids.device).unsqueeze(0).expand(batch, -1)
        cos, sin = self.rotary(features, positions)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        fed = features
        for k in range(1, depth + 1):
            if k > 1:  # depth k at i reads depth k - 1's prediction at i - 1
                fed = torch.cat([torch.zeros_like(outputs[-1][:, :1]), outputs[-1][:, :-1]], dim=1)
            hidden = self._inputs(ids, fed)
            normed = self.layer.input_layernorm(hidden)
            shape = (batch, n, -1, attention.head_dim)
            query = attention.q_proj(normed).view(shape).transpose(1, 2)
            key = attention.k_proj(normed).view(shape).transpose(1, 2)
            value = attention.v_proj(normed).view(shape).transpose(1, 2)
            query, key = _rotate(query, key, cos, sin)
            keys.append(key)
            values.append(value)
            groups = attention.num_key_value_groups
            all_keys = torch.cat(keys, dim=2).repeat_interleave(groups, dim=1)
            all_values = torch.cat(values, dim=2).repeat_interleave(groups, dim=1)
            mixed = F.scaled_dot_product_attention(query, all_keys, all_values,
                                                   attn_mask=_unroll_mask(n, k, ids.device),
                                                   scale=attention.scaling)
            mixed = attention.o_proj(mixed.transpose(1, 2).reshape(batch, n, -1))
            hidden = hidden + mixed
            hidden = hidden + self.layer.mlp(self.layer.post_attention_layernorm(hidden))
            outputs.append(self.norm(hidden))
        return outputs

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary from predicted features (`OUT_OF_VOCABULARY`
        outside the draft's)."""
        return self.head(predicted)


def _rotate(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(query, key, cos, sin)


def _unroll_mask(n: int, depth: int, device: torch.device) -> torch.Tensor:
    """[n, depth * n] bool: which keys (depth 1's n, then depth 2's, ...) depth `depth`'s
    query at index i sees: depth 1's up to i - depth + 1, then depth j's at i - depth + j."""
    i = torch.arange(n, device=device).unsqueeze(1)
    u = torch.arange(n, device=device).unsqueeze(0)
    blocks = [u <= i - depth + 1] + [u == i - depth + j for j in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)  # the last block's diagonal: every query sees its own key
