"""The grouped-query SDPA the paged attention runs on CUDA (`specd.worker.attention.grouped_sdpa`).

On CUDA torch sends grouped queries with a mask to its math kernel, so there the paged
attention folds each KV head's query heads into its rows instead. Which kernel CUDA then
picks only a device can show (`scripts/gpu_check.sh` prints the backends); that the fold
computes the same attention as torch's own grouped-query SDPA is checked here, on the
masks a batched forward makes.
"""
from __future__ import annotations

import pytest
import torch

from specd.worker.attention import grouped_sdpa


def _ragged_mask(query_positions: torch.Tensor, ends: torch.Tensor, keys: int) -> torch.Tensor:
    """[B, 1, T, keys]: causal up to each query, and nothing past the keys its row holds (as
    `specd.worker.layout` builds a batch's mask)."""
    key_pos = torch.arange(keys)
    return ((key_pos <= query_positions[..., None]) & (key_pos < ends[:, None, None])).unsqueeze(1)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 8), (32, 8), (4, 1)])
@pytest.mark.parametrize("tokens", [1, 5])
def test_folding_query_groups_is_grouped_query_attention(heads, kv_heads, tokens):
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads * 10 + tokens)
    batch, keys, dim = 3, 23, 16
    query = torch.randn(batch, heads, tokens, dim, generator=gen)
    key = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    value = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    ends = torch.tensor([23, 9, 15])  # rows of different lengths, padded to the longest
    query_positions = ends[:, None] - tokens + torch.arange(tokens)
    mask = _ragged_mask(query_positions, ends, keys)
    window = mask & (torch.arange(keys) > query_positions[..., None] - 4).unsqueeze(1)  # a sliding window of 4
    for m in (mask, window):
        expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=m, scale=0.3,
                                                                    enable_gqa=True)
        torch.testing.assert_close(grouped_sdpa(query, key, value, m, 0.3), expected)


def test_one_query_that_sees_every_key_needs_no_mask():
    gen = torch.Generator().manual_seed(7)
    query, key, value = (torch.randn(1, 8, 1, 16, generator=gen), torch.randn(1, 2, 11, 16, generator=gen),
                         torch.randn(1, 2, 11, 16, generator=gen))
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=True)
    torch.testing.assert_close(grouped_sdpa(query, key, value, None, None), expected)
    # Pairing query head h with KV head h // 4, not h % 2: swapping the KV heads must change the answer.
    swapped = grouped_sdpa(query, key.flip(1), value.flip(1), None, None)
    assert not torch.allclose(swapped, expected)
