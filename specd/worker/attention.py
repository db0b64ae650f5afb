"""Paged attention: the attention of one batched forward, read through the KV pool in a
fixed number of operator calls (`paged_attention`, set on a model as ``specd_paged`` by
`use_paged_attention`).

Every session's blocks are gathered through its block table (one `index_select` of whole
blocks, the cheapest gather on a CPU) into a padded [sessions, KV heads, longest, head
dim] tensor, and one SDPA call with a mask runs over them. On a GPU the gather is where a
paged or varlen kernel would go. On a CPU the gather's copy costs memory bandwidth:
docs/serving-path.md has the measurements against a loop over sessions on views of their
own storage.

Models whose attention goes through `cache.update` and transformers' attention interface
work: full attention, sliding windows and hybrids of the two (Llama, Mistral, Qwen,
Gemma 2 and 3, OPT, ...), and multi-head latent attention (DeepSeek-V2/V3), whose
compressed latents are what the pool holds. A model that attends on its own is handed
whole contexts instead (`specd.worker.forwards`).
"""
from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specd.worker import pagedkernel
from specd.worker.layout import BatchCache

PAGED_ATTENTION = "specd_paged"  # the attention implementation `use_paged_attention` sets


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    batch_cache: BatchCache | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of a ragged batch through the pool, in a fixed number of operator calls.

    query: [1, heads, Σ T, head dim]; returns [1, Σ T, heads, head dim] as transformers'
    attention functions do. The queries are scattered into a padded [B, heads, T, D], every
    session's keys and values gathered through its block table (`BatchCache.update` has
    already stored the new ones), one SDPA call with the batch's mask, and the rows that
    are tokens gathered back. Multi-head latent attention (DeepSeek-V2/V3) stores its
    compressed latents, which the layer's own `expand_kv` turns into keys and values
    after the gather, so the pool holds the compressed cache. A sliding-window layer
    (Mistral, Gemma, Qwen2 with windows) masks what lies outside its window; a layer that
    soft-caps its scores (Gemma 2), which SDPA cannot, computes them in three matrix
    operations instead. Without a batch cache
    (a plain forward of the same model) this is transformers' SDPA, or its eager
    attention where scores are soft-capped.
    """
    if batch_cache is None:
        if softcap is not None:
            causal = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                                device=query.device).tril(key.shape[-2] - query.shape[-2])
            return _eager(query, key, value, causal if attention_mask is None else attention_mask, scaling, softcap)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    layer: int = module.layer_idx  # type: ignore[assignment]  # torch types a module's attributes as Tensor | Module
    cache = batch_cache
    cache.attended = True
    _, heads, tokens, dim = query.shape
    batch, longest = cache.batch, cache.longest_feed
    if cache.query_rows is None:  # every row feeds `longest` tokens: a view, no copy
        padded = query[0].view(heads, batch, longest, dim).transpose(0, 1)
    else:
        padded = query.new_zeros(batch * longest, heads, dim)
        padded.index_copy_(0, cache.query_rows, query[0].transpose(0, 1))
        padded = padded.view(batch, longest, heads, dim).transpose(1, 2)
    if cache.row_ends is not None:  # the paged kernel reads each row's blocks where the pool keeps them
        out = pagedkernel.paged_attention(padded, cache.pool.keys[layer], cache.pool.values[layer],
                                          cache.read_blocks.view(batch, -1), cache.query_positions, cache.row_ends,
                                          cache.pool.block_tokens, scaling if scaling is not None else dim ** -0.5,
                                          sliding_window, softcap)
        return _unpad(out, cache, batch, longest, heads), None
    if cache.run is not None:  # one row in consecutive blocks: a view of the pool
        start, stop = cache.run
        keys = cache.pool.keys[layer][start:stop].transpose(0, 1).unsqueeze(0)  # [1, KV heads, keys, D]
        values = cache.pool.values[layer][start:stop].transpose(0, 1).unsqueeze(0)
    else:
        keys, values = cache.pool.gather(layer, cache.read_blocks, cache.gather_scratch)  # [B × W, block, KV heads, D]
        kv_heads = keys.shape[2]
        keys = keys.view(batch, -1, kv_heads, keys.shape[-1])[:, :cache.keys].transpose(1, 2)  # [B, KV heads, keys, D]
        values = values.view(batch, -1, kv_heads, values.shape[-1])[:, :cache.keys].transpose(1, 2)
    expand = getattr(module, "expand_kv", None)
    if expand is not None:  # multi-head latent attention caches its compressed latents: expand them here
        keys, values = expand(keys, values)
    mask = cache.allowed if sliding_window is None else cache.window(sliding_window)
    if softcap is None:
        out = _sdpa(padded, keys, values, mask, scaling)
    else:
        out = _eager(padded, keys, values, mask, scaling, softcap)[0].transpose(1, 2)
    return _unpad(out, cache, batch, longest, heads), None


def _unpad(out: torch.Tensor, cache: BatchCache, batch: int, longest: int, heads: int) -> torch.Tensor:
    """[B, heads, T, D] of the padded queries → [1, Σ T, heads, D] of the batch's tokens."""
    out = out.transpose(1, 2).reshape(batch * longest, heads, out.shape[-1])  # [B × T, heads, D]
    if cache.query_rows is not None:
        out = out.index_select(0, cache.query_rows)
    return out.unsqueeze(0)


def _sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
          scaling: float | None) -> torch.Tensor:
    """SDPA of [B, heads, T, D] queries over [B, KV heads, keys, D]; returns [B, heads, T, D].

    On a CPU, torch's own grouped-query SDPA (`enable_gqa`), whose flash kernel takes the
    mask. On CUDA, torch sends grouped queries with a mask to its math kernel, which
    materialises every score in float32 (gigabytes for a long profiling forward). There
    the query heads that share a KV head are folded into its rows instead (`grouped_sdpa`)
    and every kernel sees as many query heads as KV heads, so the memory-efficient kernel
    takes the masked forward (`pin_sdpa_backends` keeps cuDNN out)."""
    if query.is_cuda:
        return grouped_sdpa(query, keys, values, mask, scaling)
    return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                            enable_gqa=True)


def grouped_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float | None) -> torch.Tensor:
    """Grouped-query attention as one SDPA with equal head counts, by folding each KV head's
    G query heads into its rows: [B, KV heads · G, T, D] → [B, KV heads, G · T, D], each
    row under its own query's mask row (as FlashInfer's decode kernels group a KV head's
    queries). No key or value is copied. Query head h reads KV head h // G, as
    `enable_gqa` and transformers' `repeat_kv` pair them."""
    batch, heads, tokens, dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    folded = query.reshape(batch, kv_heads, groups * tokens, dim)
    if mask is not None:  # [B, 1, T, keys]: the same rows for every head of a group
        mask = mask.expand(batch, 1, tokens, mask.shape[-1]).repeat(1, 1, groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, tokens, values.shape[-1])


def pin_sdpa_backends(device: torch.device) -> None:
    """Leave cuDNN's SDPA out on CUDA. Its plans are cached per exact shape, and an eager
    decode's key length changes every step, so each step would build a new plan (tens of
    milliseconds on sm90 with cuDNN ≥ 9.15). Flash (unmasked forwards) and the
    memory-efficient kernel (masked ones, see `grouped_sdpa`) need no plan; the math
    kernel stays the fallback for shapes neither takes. A process-wide setting, made once
    at load: a worker serves one model on one device."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def sdpa_backends() -> str:
    """The SDPA backends torch may choose on CUDA, for the GPU check's record."""
    flags = {"flash": torch.backends.cuda.flash_sdp_enabled(),
             "memory-efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
             "cudnn": torch.backends.cuda.cudnn_sdp_enabled(), "math": torch.backends.cuda.math_sdp_enabled()}
    return ", ".join(name for name, on in flags.items() if on)


def _eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float | None, softcap: float) -> tuple[torch.Tensor, None]:
    """Attention with soft-capped scores (softcap · tanh(scores / softcap)), as Gemma 2's
    eager attention computes it; `mask` is boolean (True: seen) or additive. Returns
    [B, T, heads, D] like the attention interface."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), None


def use_paged_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through `paged_attention` (plain forwards stay SDPA)."""
    # transformers finds an attention implementation by name in its global registry;
    # registering it again sets the same function.
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    model.set_attn_implementation(PAGED_ATTENTION)
    pin_sdpa_backends(model.device)

