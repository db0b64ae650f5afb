"""Linear layers packed for oneDNN at load (specd.worker.packing), or for fbgemm in float16
(a draft's): the same products as `nn.Linear`, only where they pay, and what a worker loads
by default."""
from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from draft_service.drafter import Drafter
from specd.config import DEMO_DRAFT, DEMO_TARGET
from specd.sampling import Transform
from specd.worker import lean, packing
from specd.worker.runtime import ModelRunner
from specd.worker.settings import ModelSettings
from verifier_service.scorer import Scorer

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

# A float32 product in another order of summation: a few ulps of the output's scale.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                                             reason="this CPU has no oneDNN bfloat16 kernels"))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_computes_what_linear_does(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    if bias:  # transformers starts biases at zero; a packed layer must add a trained one
        nn.init.normal_(linear.bias)
    packed = packing.PackedLinear.of(linear)
    inputs = [torch.randn(1, 1, 96), torch.randn(1, 5, 96), torch.randn(7, 96), torch.randn(5, 3, 96).transpose(0, 1)]
    with torch.inference_mode():
        for hidden in inputs:
            hidden = hidden.to(dtype)
            expected, got = linear(hidden), packed(hidden)
            assert got.shape == expected.shape and got.dtype == dtype
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= TOLERANCE[dtype] * scale, tuple(hidden.shape)


FLOAT16 = pytest.mark.skipif(not packing.float16_available(), reason="this torch has no fbgemm")


@FLOAT16
@pytest.mark.parametrize("bias", [True, False])
def test_a_float16_layer_computes_linear_on_its_weights_rounded_to_float16(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias)
    if bias:  # a trained bias, which fbgemm's prepacked product must add
        nn.init.normal_(linear.bias)
    half = packing.PackedLinear.of(linear, "float16")
    rounded = linear.weight.detach().half().float()
    inputs = [torch.randn(1, 1, 96), torch.randn(1, 5, 96), torch.randn(7, 96), torch.randn(5, 3, 96).transpose(0, 1)]
    with torch.inference_mode():
        for hidden in inputs:
            expected, got = nn.functional.linear(hidden, rounded, linear.bias), half(hidden)
            assert got.shape == expected.shape and got.dtype == torch.float32
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= 1e-5 * scale, tuple(hidden.shape)
            # Not float32's product: the rounding shows (float16 keeps 11 bits of each weight).
            assert not torch.equal(got, linear(hidden))
    assert packing.weight_bytes(nn.Sequential(half)) == 96 * 160 * 2 + (160 * 4 if bias else 0)


def test_only_large_cpu_layers_in_packed_dtypes_are_replaced():
    rows = packing.MIN_WEIGHTS // 1024
    model = nn.ModuleDict({
        "large": nn.Linear(1024, rows),                       # the threshold's weights
        "small": nn.Linear(1024, rows - 1),                   # one row short of it
        "float16": nn.Linear(1024, 1024).to(torch.float16),   # a dtype oneDNN is not used for here
        "nested": nn.Sequential(nn.Linear(2048, rows, bias=False)),
    })
    shared = nn.Linear(1024, 1024)
    model["first"], model["second"] = nn.Sequential(shared), nn.Sequential(shared)
    loaded_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert packing.pack_linears(model) == 4
    assert isinstance(model["large"], packing.PackedLinear)
    assert isinstance(model["nested"][0], packing.PackedLinear)
    assert type(model["small"]) is nn.Linear and type(model["float16"]) is nn.Linear
    # A layer two parents share is packed once, and both hold that one.
    assert model["first"][0] is model["second"][0] and isinstance(model["first"][0], packing.PackedLinear)
    # The weights held are what was loaded, packed or not, a shared layer's once.
    assert packing.weight_bytes(model) == loaded_bytes


def test_sibling_layers_packed_as_one_product_give_each_its_own_columns():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "q": nn.Linear(512, 1024), "k": nn.Linear(512, 128), "v": nn.Linear(512, 128),
        "gate": nn.Linear(512, 1024, bias=False), "up": nn.Linear(512, 1024, bias=False),
        "odd": nn.Linear(512, 1024, bias=False), "wider": nn.Linear(1024, 1024, bias=False),  # another input
        "alone": nn.Linear(512, 1024, bias=False),
        "tiny": nn.Linear(64, 64), "tinier": nn.Linear(64, 32),  # joined, still under the threshold
    }).eval()
    for name in ("q", "k", "v"):  # trained biases, which the product must add in the right columns
        nn.init.normal_(model[name].bias)
    inputs = {name: torch.randn(3, layer.in_features) for name, layer in model.items()}
    inputs.update({name: inputs["q"] for name in ("k", "v", "gate", "up", "odd", "alone")})
    with torch.inference_mode():
        expected = {name: layer(inputs[name]) for name, layer in model.items()}
    loaded_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    groups = [("q", "k", "v"), ("gate", "up"), ("odd", "wider"), ("tiny", "tinier")]
    # q, k, v and gate, up joined; odd and wider (different inputs) and alone each packed apart.
    assert packing.pack_linears(model, groups=groups) == 8
    assert all(type(model[name]) is packing.PackedSlice for name in ("q", "k", "v", "gate", "up"))
    assert model["q"].product is model["v"].product and model["gate"].product is model["up"].product
    assert (model["k"].start, model["k"].stop) == (1024, 1152) and model["q"].product.out_features == 1280
    assert all(type(model[name]) is packing.PackedLinear for name in ("odd", "wider", "alone"))
    assert type(model["tiny"]) is nn.Linear and type(model["tinier"]) is nn.Linear
    assert not any(m.training for m in model.modules())
    with torch.inference_mode():
        for name, layer in model.items():
            got = layer(inputs[name])
            scale = expected[name].abs().max().item()
            assert got.shape == expected[name].shape
            assert (got - expected[name]).abs().max().item() <= TOLERANCE[torch.float32] * scale, name
    # A joined product holds the weights that were loaded, once.
    assert packing.weight_bytes(model) == loaded_bytes


def test_a_model_whose_code_reads_its_layers_weights_is_served_as_loaded(tokenizer, tmp_path, monkeypatch, caplog):
    """BLOOM's "slow but exact" tensor-parallel emulation slices its projections' weights in
    its forward: with them packed that forward fails, so the worker loads it again unpacked."""
    config = AutoConfig.for_model("bloom", hidden_size=64, n_layer=2, n_head=4, vocab_size=len(tokenizer),
                                  pretraining_tp=2, slow_but_exact=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "bloom")
    tokenizer.save_pretrained(tmp_path / "bloom")
    monkeypatch.setattr(packing, "MIN_WEIGHTS", 0)
    with caplog.at_level(logging.WARNING, logger="specd.worker.packing"):
        scorer = Scorer(tmp_path / "bloom", ModelSettings(max_sessions=2))
    assert not any(isinstance(m, packing.PackedLinear) for m in scorer.runner.model.modules())
    assert "--cpu-linear torch" in caplog.text
    scores = asyncio.run(score_once(scorer, [5, 17, 23]))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "bloom").eval()
    with torch.inference_mode():
        assert scores == reference(torch.tensor([[5, 17, 23]])).logits[0, -1].argmax().item()


async def score_once(scorer: Scorer, prompt: list[int]) -> int:
    """The target's greedy next token after `prompt`, through the runner's scheduler."""
    try:
        scores = await scorer.score("s", 0, prompt, [], Transform())
        assert scores.argmax is not None
        return scores.argmax[0]
    finally:
        await scorer.runner.close()


def test_a_worker_packs_the_demo_target_and_the_drafts_large_layers_unless_told_not_to():
    target = ModelRunner(DEMO_TARGET, ModelSettings(max_sessions=2))
    plain = ModelRunner(DEMO_TARGET, ModelSettings(max_sessions=2, cpu_linear="torch"))
    draft = ModelRunner(DEMO_DRAFT, ModelSettings(max_sessions=2))

    def packed(runner: ModelRunner, kind: type = packing.PackedLinear) -> int:
        return sum(isinstance(m, kind) for m in runner.model.modules())

    # The target: in each of its 4 layers q, k and v as one product, gate and up as one, o and
    # down; and the tied output layer. The draft, its weights as loaded: its output layer
    # (4,096 × 256) and in each of its 2 layers gate and up as one (256 × 1,376); its other
    # 256-wide layers stay.
    assert packed(target) == 4 * 4 + 1 and packed(target, packing.PackedSlice) == 4 * 5
    assert packed(plain) == 0 and packed(draft) == 1 + 2
    assert lean.decoder_of(target.model) is not None
    assert all(len(layer.project) == 1 for layer in lean.decoder_of(target.model).layers)
    # The weights packed are the ones loaded: the tied output layer computes the same logits.
    ids = torch.tensor([[5, 17, 23, 42, 8, 99, 3]])
    with torch.inference_mode():
        expected, got = plain.model(ids).logits, target.model(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


@FLOAT16
def test_a_draft_worker_holds_its_large_layers_in_float16_and_proposes_nearly_as_in_float32():
    half = Drafter(DEMO_DRAFT, ModelSettings(max_sessions=2)).runner
    loaded = Drafter(DEMO_DRAFT, ModelSettings(max_sessions=2), cpu_weights="as-loaded").runner
    # A verifier's runner is never asked for float16: its logits decide the output.
    target = Scorer(DEMO_TARGET, ModelSettings(max_sessions=2)).runner

    def layouts(runner: ModelRunner) -> list[str]:
        return [m.layout for m in runner.model.modules() if isinstance(m, packing.PackedLinear)]

    # The draft (width 256, 2 layers): per layer q, k and v as one product, gate and up as one,
    # and down (176,128 weights); its output layer. o (65,536) is under the float16 threshold.
    assert layouts(half) == ["float16"] * (2 * 3 + 1)
    # As loaded, oneDNN's bound keeps only gate and up (256 × 1,376) and the output layer.
    assert layouts(loaded) == ["onednn"] * (2 + 1) and set(layouts(target)) == {"onednn"}
    # Each float16 weight holds 2 bytes of float32's 4.
    halved = sum(m.in_features * m.out_features for m in half.model.modules() if isinstance(m, packing.PackedLinear))
    assert packing.weight_bytes(loaded.model) - packing.weight_bytes(half.model) == 2 * halved
    ids = torch.tensor([[5, 17, 23, 42, 8, 99, 3, 250, 1000, 7]])
    with torch.inference_mode():
        expected, got = loaded.model(ids).logits, half.model(ids).logits
    assert (got - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
