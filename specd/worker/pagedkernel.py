"""Paged attention in one Triton kernel (`--attention-kernel triton`, CUDA only): each row's
keys and values read through its block table where the pool keeps them, with no gather.

Why: the default path (`specd.worker.attention`) gathers every row's blocks into a padded
tensor and runs one SDPA over it. On a GPU that gather writes and then reads every key
once more, its scratch grows with the batch's longest context, and a mask of
[rows, tokens, keys] goes with it; a CUDA graph must fix the keys' count, so graphs are
bucketed by context (`specd.worker.graphs`). Paged kernels (vLLM's, FlashInfer's) read
the block table themselves, so a row reads only its own blocks, up to its own end. This
is such a kernel for specd's shapes, written in Triton because the GPU image carries
Triton (3.6) and no FlashInfer, and because Triton runs on a CPU in its interpreter
(`TRITON_INTERPRET=1`), where `tests/test_pagedkernel.py` checks it against SDPA.

One program per (row, KV head): the G query heads sharing that KV head and the row's T
query tokens are G·T rows of one tile (as FlashInfer's decode kernels group a KV head's
queries), and the program walks the row's keys a block at a time with an online softmax
(FlashAttention's), up to the row's end. A query at position p sees keys at positions ≤ p
(and > p − window with a sliding window, whose layers start at the tile of the earliest
query's window); Gemma 2's soft-capped scores are capped before
the softmax. Keys past a row's end are never loaded: the pool's unwritten slots may hold
any bits, NaN among them, and 0 × NaN would reach a real row through the value product.

What it serves: models whose layers attend through the attention interface with equal key
and value head dims of a power of two, no latent expansion (`usable`). A worker that asks
for it on another model, or without Triton or a CUDA device, keeps the gather and says why.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Any

import torch
from transformers import PreTrainedModel

# A tile has at least 16 rows and 16 keys, the matrix units' smallest tile (mma m16n8k16).
_MIN_TILE = 16


def problem(model: PreTrainedModel, device: torch.device, interpret: bool = False) -> str | None:
    """Why `model`'s attention cannot run through the kernel on `device` (None: it can).
    interpret: Triton's CPU interpreter runs it (tests only)."""
    if device.type != "cuda" and not interpret:
        return f"--attention-kernel triton runs on a CUDA device, and this worker runs on {device.type}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (the GPU image carries it; pip install triton)"
    config = model.config.get_text_config()
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads:
        return f"{heads} query heads do not group evenly over {kv_heads} KV heads"
    if dim & (dim - 1):
        return f"its head dim, {dim}, is not a power of two (a tile's width)"
    for module in model.modules():
        if hasattr(module, "expand_kv") or hasattr(module, "kv_a_proj_with_mqa"):
            return "it caches latents that its layers expand into keys and values (multi-head latent attention)"
    return None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1: tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def disagreement(gathered: list[torch.Tensor], paged: list[torch.Tensor], dtype: torch.dtype) -> str | None:
    """How the kernel's trial logits differ from the gather's beyond the rounding of another
    order of sums (None: they agree), for a model computing in `dtype`: a largest difference
    over 1e-4 of the largest logit in float32, 2e-2 in 16-bit types, or a value not finite."""
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for want, got in zip(gathered, paged):
        scale = want.float().abs().max().item()
        worst = (want.float() - got.float()).abs().max().item()
        if not torch.isfinite(got).all() or worst > tolerance * scale:
            return f"its trial logits differ from the gather's by {worst:.3g} (largest logit {scale:.3g})"
    return None


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, compiled on first use (Triton is imported only where it is asked for)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged(q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, qpos_ptr, ends_ptr, scale, softcap, window,
              stride_qb, stride_qh, stride_qt, stride_ks, stride_kh, stride_vs, stride_vh,
              stride_ob, stride_oh, stride_ot, width, tokens, groups,
              BLOCK_TOKENS: tl.constexpr, DIM: tl.constexpr, ROWS: tl.constexpr, KEYS: tl.constexpr,
              WINDOWED: tl.constexpr, CAPPED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        r = tl.arange(0, ROWS)  # tile row r: query head h·G + r // T, token r % T
        d = tl.arange(0, DIM)
        real = r < groups * tokens
        head = h * groups + r // tokens
        t = r % tokens
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :],
                    mask=real[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        qpos = tl.load(qpos_ptr + b * tokens + t, mask=real, other=-1)
        end = tl.load(ends_ptr + b)
        best = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        first = 0
        if WINDOWED:  # no key before the earliest query's window is seen: start at its tile
            earliest = tl.min(tl.where(real, qpos, end), 0)
            first = tl.maximum(earliest - window + 1, 0) // KEYS * KEYS
        while first < end:  # a while, not a range: Triton's interpreter takes no loaded bound for range
            j = first + tl.arange(0, KEYS)  # key positions in the row
            held = j < end
            block = tl.load(table_ptr + b * width + j // BLOCK_TOKENS, mask=held, other=0)
            slot = block * BLOCK_TOKENS + j % BLOCK_TOKENS
            k = tl.load(k_ptr + slot[:, None] * stride_ks + h * stride_kh + d[None, :], mask=held[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            if CAPPED:  # softcap · tanh(scores / softcap), tanh(x) = 2σ(2x) − 1
                scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
            seen = (j[None, :] <= qpos[:, None]) & held[None, :]
            if WINDOWED:
                seen = seen & (j[None, :] > qpos[:, None] - window)
            scores = tl.where(seen, scores, float("-inf"))
            top = tl.maximum(best, tl.max(scores, 1))
            shift = tl.where(top == float("-inf"), 0.0, top)  # a row that has seen nothing yet stays at 0
            weights = tl.exp(scores - shift[:, None])
            rescale = tl.exp(best - shift)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(v_ptr + slot[:, None] * stride_vs + h * stride_vh + d[None, :], mask=held[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            rounded = weights.to(v_ptr.dtype.element_ty)  # as the values are kept, FlashAttention's way
            if UPCAST:
                rounded = rounded.to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(rounded, v, input_precision=PRECISION)
            best = top
            first += KEYS
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + t[:, None] * stride_ot + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=real[:, None])

    return paged


def warps(rows: int, dim: int) -> int:
    """Warps a program runs with: 8 where its float32 accumulator, rows × dim, would hold
    more than 64 registers a thread over 4 warps (G · T = 128 rows of 128 wide: an 8B's
    verification of 16 tokens), else Triton's default 4."""
    return 8 if rows * dim > 64 * 128 else 4


# Triton's CPU interpreter keeps the grid it runs in module globals: two threads' kernels
# (a draft and a verifier in one test process) must not interleave there.
_INTERPRETER = threading.Lock()


def paged_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                    query_positions: torch.Tensor, ends: torch.Tensor, block_tokens: int, scaling: float,
                    window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of padded queries [B, heads, T, D] over one layer of the pool, keys and
    values [slots, KV heads, D], each row through its block table (`table`, [B, W]) up to
    its end (`ends`, [B]: the keys it holds after this forward), query (b, t) at position
    `query_positions[b, t]`; returns [B, heads, T, D]. Queries past a row's own tokens (a
    row feeding fewer than T) get whatever their positions let them see: callers drop them."""
    batch, heads, tokens, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    query = query.contiguous()
    out = torch.empty_like(query)
    rows = max(_MIN_TILE, 1 << (groups * tokens - 1).bit_length())
    precision = "ieee" if query.dtype == torch.float32 else "tf32"  # float32 stays float32 on a GPU's matrix units
    interpreting = interpreted()
    # The interpreter multiplies bfloat16 tiles as their raw bits: there (tests) the tiles are
    # multiplied in float32, the softmax weights still rounded to the values' dtype.
    upcast = query.dtype == torch.bfloat16 and interpreting
    with _INTERPRETER if interpreting else contextlib.nullcontext():
        _kernel()[(batch, kv_heads)](
            query, keys, values, out, table, query_positions, ends, scaling, softcap or 1.0, window or 0,
            query.stride(0), query.stride(1), query.stride(2), keys.stride(0), keys.stride(1),
            values.stride(0), values.stride(1), out.stride(0), out.stride(1), out.stride(2),
            table.shape[1], tokens, groups,
            BLOCK_TOKENS=block_tokens, DIM=dim, ROWS=rows, KEYS=max(_MIN_TILE, block_tokens),
            WINDOWED=window is not None, CAPPED=softcap is not None, PRECISION=precision, UPCAST=upcast,
            num_warps=warps(rows, dim))
    return out
