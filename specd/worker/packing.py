"""Linear layers whose weights are laid out once, at load, for a CPU's matrix products.

Why: a decoding or verifying forward multiplies each weight matrix by a few rows (one
token per session, or a proposal's γ + 1). For a few rows torch's own CPU matmul costs
about as many matrix-vector products as there are rows: on the demo target a
verification of 5 tokens took 1.4–1.9 plain steps, so speculation paid less on a CPU
than it would on a GPU. oneDNN's product with a weight packed once for this CPU costs
about the same for 1 row as torch's, and 2–5 rows cost little more than one
(docs/serving-path.md, "Packed linear layers").

Only matrices of at least `MIN_WEIGHTS` weights are packed: below, oneDNN's fixed cost
per call is more than a one-row product (a small draft's narrow layers stay as they are).

A draft may hold its weights in float16 instead (layout "float16", fbgemm's product:
float32 arithmetic on weights rounded to float16). A token's forward on a CPU reads every
weight once, so half the bytes is about half the time of the products: SmolLM2's 4-layer
draft's forward took 4.6 ms a token against 7.1 on one thread of a 2-core AMD EPYC
(docs/serving-path.md, "A draft's weights in float16"). Only a draft: its proposals move a little, and the target,
which verifies every one, decides the output; the target's own products stay as loaded.

The operators are torch's own, from its `torch.ops.mkldnn` and `torch.ops.quantized`
namespaces, which torch does not document as public: torch is pinned (pyproject.toml),
and tests/test_packing.py fails if they change.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from specd.devices import bf16_is_fast

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=nn.Module)

# Weights in a matrix from which packing pays (measured on this project's 2-core CPU):
# 256 × 688 is slower packed at one row, in cache; SmolLM2's 576 × 576 output projection,
# read from memory in a whole forward, is faster packed at every width (one session's
# forward of 1, 2 and 3 tokens 19.7, 23.3, 24.1 ms unpacked against 18.7, 20.5, 20.8).
MIN_WEIGHTS = 1 << 18
# The same for fbgemm's float16 product, against torch's float32 one at one row, 60 matrices
# in turn (the AMD EPYC, one thread): 256 × 256 23 µs against 15, 256 × 688 38 against 67.
MIN_FLOAT16_WEIGHTS = 1 << 17

# How a packed layer holds its weight: oneDNN's layout of it as loaded, or rounded to
# float16 in fbgemm's (a draft's).
LAYOUTS = ("onednn", "float16")


def float16_available() -> bool:
    """Whether this torch has fbgemm's float16 product (x86 builds do; ARM's do not)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


def draft_layout(dtype: torch.dtype) -> str:
    """The layout a draft's packed layers take: float16 for a float32 draft where this torch
    has fbgemm; otherwise oneDNN's (a bfloat16 draft keeps its own kernels)."""
    return "float16" if dtype == torch.float32 and float16_available() else "onednn"


class PackedLinear(nn.Module):
    """`nn.Linear`'s product, with the weight laid out once for this CPU (inference only,
    no gradient): in oneDNN's layout as loaded, or rounded to float16 in fbgemm's
    (`layout`, one of `LAYOUTS`)."""

    packed: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, training: bool,
                 layout: str = "onednn") -> None:
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.out_features, self.in_features = weight.shape
        self.layout = layout
        weight, bias = weight.detach(), None if bias is None else bias.detach()
        self.register_buffer("bias", bias)
        if layout == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.register_buffer("packed", packed)
            self.prepacked = None
            self.held_bytes = packed.numel() * packed.element_size()
        else:
            # fbgemm keeps its packed weight (and the bias) in an object of its own, not a tensor.
            self.register_buffer("packed", None)
            self.prepacked = torch.ops.quantized.linear_prepack_fp16(weight.float(), bias)
            self.held_bytes = weight.numel() * 2
        self.held_bytes += 0 if bias is None else bias.numel() * bias.element_size()
        self.train(training)  # a layer of a model in evaluation stays in evaluation

    @classmethod
    def of(cls, linear: nn.Linear, layout: str = "onednn") -> PackedLinear:
        """`linear`'s product, packed."""
        return cls(linear.weight, linear.bias, linear.training, layout)

    @classmethod
    def joined(cls, linears: Sequence[nn.Linear], layout: str = "onednn") -> PackedLinear:
        """One product whose output is the outputs of `linears` side by side, in order (all
        with a bias or all without)."""
        bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        return cls(torch.cat([linear.weight.detach() for linear in linears]), bias, linears[0].training, layout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.prepacked is not None:
            return torch.ops.quantized.linear_dynamic_fp16(hidden, self.prepacked)
        return torch.ops.mkldnn._linear_pointwise(hidden, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={self.layout}")


class PackedSlice(nn.Module):
    """One linear layer packed with its siblings (`pack_linears`' `groups`): its columns
    [start, stop) of their one product. The model's own forward computes the product once
    for each sibling; the lean forward (`specd.worker.lean`) computes it once for all."""

    def __init__(self, product: PackedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.product, self.start, self.stop = product, start, stop
        self.in_features, self.out_features = product.in_features, stop - start
        self.train(product.training)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.product(hidden)[..., self.start:self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop} of {self.product.out_features}"


def _packable(module: nn.Module, min_weights: int, layout: str) -> bool:
    """A plain `nn.Linear` (not a subclass with a product of its own) on the CPU, large
    enough, in float32, or (oneDNN's layout) in bfloat16 where this CPU has oneDNN's
    bfloat16 kernels."""
    if type(module) is not nn.Linear or module.weight.device.type != "cpu" or module.weight.numel() < min_weights:
        return False
    dtype = module.weight.dtype
    return dtype == torch.float32 or (layout == "onednn" and dtype == torch.bfloat16
                                      and bf16_is_fast(module.weight.device))


def pack_linears(model: nn.Module, min_weights: int | None = None,
                 groups: Sequence[Sequence[str]] = (), layout: str = "onednn") -> int:
    """Replace each `nn.Linear` of `model` that `_packable` admits (at least `min_weights`
    weights; default `MIN_WEIGHTS`, or `MIN_FLOAT16_WEIGHTS` in float16) by a
    `PackedLinear` of `layout`; how many were replaced. A model on another device, or a
    torch without the layout's library (oneDNN; fbgemm for "float16"), is left as it is.

    `groups` names sibling layers that always read the same input (a layer's q, k and v
    projections; a gated MLP's gate and up): each group whose layers are all packable,
    with the same input width, dtype and kind of bias, is packed as one product of their
    weights stacked, and each layer becomes its `PackedSlice`. One product of a few rows
    reads the stacked weights in one pass: on a 2-core AMD EPYC, 30 layers' q, k and v
    took 3.0 ms a token joined against 5.4 ms apart, their gate and up 7.2 against 8.7
    (docs/serving-path.md, "Packed linear layers"). A group is judged against
    `min_weights` as a whole.

    One layer at a time, so that each one's weights are freed before the next is packed. A
    tied output layer (the embedding's matrix) gets a packed copy: the embedding keeps its
    own for looking tokens up, so vocabulary × width weights are held twice.
    """
    if not (torch.backends.mkldnn.is_available() if layout == "onednn" else float16_available()):
        return 0
    least = min_weights if min_weights is not None else MIN_WEIGHTS if layout == "onednn" else MIN_FLOAT16_WEIGHTS
    replaced = sum(_pack_group(model, group, least, layout) for group in groups)
    # Names, not modules: holding the layers here would hold every old weight to the end.
    names = [name for name, module in model.named_modules(remove_duplicate=False)
             if _packable(module, least, layout)]
    packed: dict[int, PackedLinear] = {}  # a layer shared by two parents is packed once
    for name in names:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = getattr(parent, attribute)
        if id(linear) not in packed:
            packed[id(linear)] = PackedLinear.of(linear, layout)
        setattr(parent, attribute, packed[id(linear)])
        del linear
    return replaced + len(names)


def _pack_group(model: nn.Module, group: Sequence[str], least: int, layout: str) -> int:
    """Pack the layers named by `group` as one product, each replaced by its `PackedSlice`,
    where `pack_linears` admits them; how many were replaced."""
    linears = [module for module in map(model.get_submodule, group)
               if isinstance(module, nn.Linear) and _packable(module, 0, layout)]
    if len(linears) != len(group) \
            or len({(linear.in_features, linear.weight.dtype, linear.bias is None) for linear in linears}) != 1 \
            or sum(linear.weight.numel() for linear in linears) < least:
        return 0
    product = PackedLinear.joined(linears, layout)
    start = 0
    for name, linear in zip(group, linears):
        parent_name, _, attribute = name.rpartition(".")
        stop = start + linear.out_features
        setattr(model.get_submodule(parent_name), attribute, PackedSlice(product, start, stop))
        start = stop
    return len(group)


def packed_model(load: Callable[[], Model],
                 groups: Callable[[nn.Module], Sequence[Sequence[str]]] | None = None,
                 layout: str = "onednn") -> Model:
    """The model `load` returns, its large linear layers packed in `layout` (`groups(model)`:
    the sibling layers to pack as one product, `pack_linears`), unless its own code then
    fails on a forward of two tokens (a family whose forward reads a layer's `weight`): then
    a fresh load, as it is, and a warning."""
    model = load()
    if not pack_linears(model, groups=groups(model) if groups is not None else (), layout=layout):
        return model
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(torch.zeros((1, 2), dtype=torch.long, device=device))
    except Exception as exc:
        log.warning("%s: its forward fails with packed linear layers (%s: %s); serving it with torch's own "
                    "products, as --cpu-linear torch", type(model).__name__, type(exc).__name__, exc)
        del model
        return load()
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights `model` holds: its parameters and its packed layers' own."""
    return (sum(p.numel() * p.element_size() for p in model.parameters())
            + sum(module.held_bytes for module in model.modules() if isinstance(module, PackedLinear)))
