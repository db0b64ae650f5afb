"""Linear layers whose weights oneDNN lays out once, at load, for a CPU's matrix products.

Why: a decoding or verifying forward multiplies each weight matrix by a few rows (one
token per session, or a proposal's γ + 1). For a few rows torch's own CPU matmul costs
about as many matrix-vector products as there are rows: on the demo target a
verification of 5 tokens took 1.4–1.9 plain steps, so speculation paid less on a CPU
than it would on a GPU. oneDNN's product with a weight packed once for this CPU costs
about the same for 1 row as torch's, and 2–5 rows cost little more than one
(docs/performance.md, item 11).

Only matrices of at least `MIN_WEIGHTS` weights are packed: below, oneDNN's fixed cost
per call is more than a one-row product (a small draft's layers stay as they are).

The two operators are torch's own, from its `torch.ops.mkldnn` namespace, which torch does
not document as public: torch is pinned (pyproject.toml), and tests/test_packing.py fails
if they change.
"""
from __future__ import annotations

import torch
from torch import nn

# Weights in a matrix from which packing pays at one row (measured on this project's 2-core
# CPU: 512 × 1,376 level, 768 × 2,048 and larger faster, 256 × 688 slower).
MIN_WEIGHTS = 1 << 19
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):
    """`nn.Linear`'s product, with the weight in oneDNN's layout for this CPU (a buffer:
    inference only, no gradient)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, min_weights: int = MIN_WEIGHTS) -> int:
    """Replace each `nn.Linear` of `model` on a CPU, in float32 or bfloat16, with at least
    `min_weights` weights, by a `PackedLinear`; how many were replaced. A model on another
    device, or a torch without oneDNN, is left as it is.

    A tied output layer (the embedding's matrix) gets a packed copy: the embedding keeps
    its own for looking tokens up, so its weights are held twice.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is nn.Linear and child.weight.device.type == "cpu"
                    and child.weight.dtype in PACKED_DTYPES and child.weight.numel() >= min_weights):
                setattr(parent, name, PackedLinear(child))
                replaced += 1
    return replaced
