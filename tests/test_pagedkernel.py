"""The paged attention kernel (`specd.worker.pagedkernel`, `--attention-kernel triton`). On
a CPU, Triton's interpreter runs it (TRITON_INTERPRET=1, set by tests/conftest.py): the same
kernel source a GPU compiles, executed on this CPU's tensors; on a GPU, the compiled kernel.
What the interpreter cannot say (the GPU's code, its speed, bfloat16 products on matrix
units) only a device can.

- the kernel against attention written out row by row: grouped heads, rows of different
  feeds and lengths, a sliding window, soft-capped scores, float32, float16 and bfloat16,
  and NaN in every slot no row holds;
- a real model's batched forwards, eager and as static steps, equal the gather's;
- served through real services, greedy output equals transformers' `generate`;
- a worker asked for it loads it after its trial, or keeps the gather and says why;
- Triton's compiler builds it for Hopper (sm_90), with no GPU.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import request, start_stack
from specd.worker import forwards, graphs, lean, pagedkernel, trials
from specd.worker.kvstore import NULL_BLOCK
from specd.worker.layout import BatchRow
from specd.worker.settings import BatchSettings, ModelSettings
from test_batching import PROMPTS, _model, _per_row, _pool, in_flight
from test_graphs import _buckets, _sessions
from test_pipeline import reference_greedy
from verifier_service.scorer import Scorer

pytest.importorskip("triton", reason="Triton runs the kernel (dev extra; Linux x86-64 wheels only)")


# The kernel's tensors: on a GPU where Triton compiles it, else on this CPU in its
# interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _written_out(query, keys, values, table, lengths, feeds, block_tokens, window, softcap):
    """Attention of each real query, one at a time, over its row's keys read slot by slot,
    in float64: [(b, t, [heads, D])]."""
    heads, kv_heads, dim = query.shape[1], keys.shape[1], query.shape[-1]
    found = []
    for b, (length, feed) in enumerate(zip(lengths, feeds)):
        positions = torch.arange(length)
        slots = table[b][positions // block_tokens] * block_tokens + positions % block_tokens
        k = keys[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [heads, L, D]
        v = values[slots].double().transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        for t in range(feed):
            at = length - feed + t
            scores = torch.einsum("hd,hld->hl", query[b, :, t].double(), k) * dim ** -0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            seen = positions <= at
            if window is not None:
                seen &= positions > at - window
            found.append((b, t, torch.einsum("hl,hld->hd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (9, None), (None, 30.0)])
def test_the_kernel_is_attention_written_out(dtype, heads, kv_heads, window, softcap):
    torch.manual_seed(0)
    block_tokens, dim, tokens = 16, 64, 4
    blocks = 12
    keys = torch.randn(blocks * block_tokens, kv_heads, dim)
    values = torch.randn(blocks * block_tokens, kv_heads, dim)
    # Three rows over scattered blocks: 40 keys after feeding 4 tokens, 70 after 2, 10 after 1;
    # every slot no row holds (the null block, the tails of last blocks) is NaN.
    table = torch.tensor([[3, 7, 1, 0, 0], [2, 4, 6, 8, 9], [5, 0, 0, 0, 0]])
    lengths, feeds = [40, 70, 10], [4, 2, 1]
    held = torch.zeros(blocks * block_tokens, dtype=torch.bool)
    for b, length in enumerate(lengths):
        positions = torch.arange(length)
        held[table[b][positions // block_tokens] * block_tokens + positions % block_tokens] = True
    keys[~held], values[~held] = float("nan"), float("nan")
    query = torch.randn(len(lengths), heads, tokens, dim)
    starts = torch.tensor([length - feed for length, feed in zip(lengths, feeds)])
    query_positions = starts[:, None] + torch.arange(tokens)
    keys, values, query = keys.to(dtype), values.to(dtype), query.to(dtype)
    out = pagedkernel.paged_attention(query.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), table.to(DEVICE),
                                      query_positions.to(DEVICE), torch.tensor(lengths, device=DEVICE),
                                      block_tokens, dim ** -0.5, window, softcap).cpu()
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    for b, t, expected in _written_out(query, keys, values, table, lengths, feeds, block_tokens, window, softcap):
        torch.testing.assert_close(out[b, :, t].double(), expected, atol=tolerance, rtol=tolerance)


def test_a_models_forwards_through_the_kernel_equal_the_gathers(model_dirs):
    """The load-time trial's forwards (two sessions of different lengths, three forwards
    together) and a static step's, through the kernel and through the gather: the same
    logits, in float32."""
    torch.manual_seed(0)
    model = _model(model_dirs["target"], DEVICE)
    pool = _pool(model)
    assert lean.install(model, pool, model.config.vocab_size, model.device) is None
    assert pagedkernel.problem(model, model.device, interpret=pagedkernel.interpreted()) is None
    forward = forwards.stand_in(model)
    assert forward is not None
    gathered = trials.trial_logits(forward, pool, model.config.vocab_size, model.device)
    paged = trials.trial_logits(forward, pool, model.config.vocab_size, model.device, paged_kernel=True)
    assert not isinstance(gathered, str) and not isinstance(paged, str)
    for want, got in zip(gathered, paged):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert pagedkernel.disagreement(gathered, paged, torch.float32) is None
    assert pagedkernel.disagreement(gathered, [logits + 1.0 for logits in paged], torch.float32) is not None

    decoder = lean.decoder_of(model)
    assert decoder is not None
    steps = graphs.StaticSteps(decoder, pool, model.device, _buckets(model, pool, 4), capture=False,
                               paged_kernel=True)
    with torch.inference_mode():
        sessions = _sessions(model, pool, [5, 30, 12])
        feeds = [[7], [8, 9, 10], [11, 12]]
        rows = [BatchRow(s, feed, len(feed)) for s, feed in zip(sessions, feeds)]
        eager = _per_row(forwards.forward(model, rows, model.device))
        for session, feed in zip(sessions, feeds):
            session.crop(session.length - len(feed))
        static = steps.forward(rows)
    assert static is not None and steps.replays == 1
    for got, expected in zip(_per_row(static), eager):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert NULL_BLOCK not in [block for s in sessions for block in s.blocks]


def test_greedy_served_through_the_kernel_equals_generate(model_dirs, target_model, tokenizer):
    """Draft and verifier read their pools through the kernel: greedy output with four in
    flight equals transformers' `generate`, speculating at fixed γ and decoding plainly."""
    stack = start_stack(model_dirs, drafts=("close",))
    try:
        runners = [stack.draft.servicer.drafts["close"].runner, stack.verifier.servicer.scorer.runner]
        for runner in runners:
            forwards.use_paged_kernel(runner.model)
        prompts = PROMPTS[:4]
        for mode in ("FIXED", "OFF"):
            responses = in_flight(stack.stub, [request(p, max_new_tokens=10, mode=mode, draft_model="close")
                                               for p in prompts])
            for prompt, response in zip(prompts, responses):
                assert list(response.token_ids) == reference_greedy(target_model, tokenizer, prompt, 10), (mode, prompt)
    finally:
        stack.close()


def test_a_worker_asked_for_the_kernel_takes_it_after_its_trial(model_dirs, caplog):
    # A pool of 256 positions: the forwards a worker times at load then stop at 3 sessions,
    # which the interpreter runs in seconds.
    settings = ModelSettings(device=DEVICE, attention_kernel="triton", batching=BatchSettings(kv_cache_tokens=256))
    with caplog.at_level(logging.INFO, logger="specd"):
        scorer = Scorer(model_dirs["target"], settings)
    assert forwards.paged_kernel(scorer.runner.model)
    assert "reads the KV pool through the paged kernel" in caplog.text


def test_a_worker_whose_trial_disagrees_keeps_the_gather(model_dirs, caplog, monkeypatch):
    monkeypatch.setattr(pagedkernel, "disagreement", lambda gathered, paged, dtype: "its trial logits differ (planted)")
    settings = ModelSettings(device=DEVICE, attention_kernel="triton", batching=BatchSettings(kv_cache_tokens=256))
    with caplog.at_level(logging.WARNING, logger="specd"):
        scorer = Scorer(model_dirs["target"], settings)
    assert not forwards.paged_kernel(scorer.runner.model)
    assert "keeps the gather for attention: its trial logits differ (planted)" in caplog.text


def test_a_model_the_kernel_cannot_serve_keeps_the_gather_and_says_why(monkeypatch):
    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1))
    assert "head dim, 48, is not a power of two" in (pagedkernel.problem(odd, torch.device("cpu"), True) or "")
    assert "runs on a CUDA device" in (pagedkernel.problem(odd, torch.device("cpu")) or "")
    problems = ModelSettings(attention_kernel="triton").problems()
    assert problems and "--attention-kernel triton runs on a CUDA device" in problems[0]
    monkeypatch.setitem(sys.modules, "triton", None)  # as where Triton is not installed
    assert "Triton is not installed" in (pagedkernel.problem(odd, torch.device("cuda"), True) or "")



# Triton's compiler, without a GPU: the kernel compiled for Hopper (sm_90) down to a cubin,
# for shapes a served 8B, a float32 test model and a float16 model with a window take.
_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from specd.worker import pagedkernel

kernel = pagedkernel._kernel()
ints = ["stride_qb", "stride_qh", "stride_qt", "stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_ob",
        "stride_oh", "stride_ot", "width", "tokens", "groups", "window"]
for dtype, dim, rows, windowed, capped, precision in [("bf16", 128, 64, False, False, "tf32"),
                                                      ("fp32", 64, 16, True, True, "ieee"),
                                                      ("fp16", 128, 128, True, False, "tf32")]:
    signature = {**{name: "*" + dtype for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
                 **{name: "*i64" for name in ("table_ptr", "qpos_ptr", "ends_ptr")},
                 "scale": "fp32", "softcap": "fp32", **{name: "i32" for name in ints}}
    constants = {"BLOCK_TOKENS": 16, "DIM": dim, "ROWS": rows, "KEYS": 16, "WINDOWED": windowed, "CAPPED": capped,
                 "PRECISION": precision, "UPCAST": False}
    signature.update({name: "constexpr" for name in constants})
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": pagedkernel.warps(rows, dim)})
    print(dtype, len(compiled.asm["cubin"]), compiled.metadata.shared)
"""


def test_the_kernel_compiles_for_hopper_without_a_gpu():
    """What the interpreter does not check, the GPU's code generation (tile shapes a matrix
    unit takes, loop-carried types, shared memory), by Triton's own compiler for sm_90,
    which needs no device; a fresh process, since the interpreter replaces the compiler
    once Triton is imported."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE], env=environment, capture_output=True, text=True,
                            timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [line.split() for line in result.stdout.splitlines()]
    assert [dtype for dtype, _, _ in compiled] == ["bf16", "fp32", "fp16"]
    assert all(int(cubin) > 0 and 0 < int(shared) <= 227 * 1024 for _, cubin, shared in compiled), compiled
