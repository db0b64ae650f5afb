"""Packing probability distributions into `specd.v1.Distributions` and back.

A `repeated float` of vocabulary size is slow to build and parse in Python; raw
little-endian bytes read with torch.frombuffer are not (DESIGN.md §6). With top-k/top-p
only the support travels. Shared by the workers (pack) and the gateway (unpack).
"""
from __future__ import annotations

import numpy as np
import torch

from specd.v1 import worker_pb2


def pack_distributions(probs: torch.Tensor, sparse: bool) -> worker_pb2.Distributions:
    """Pack probabilities [n, V] as dense float32 bytes, or their non-zero support when sparse."""
    probs = probs.float().contiguous()
    n, vocab = probs.shape
    if not sparse:
        return worker_pb2.Distributions(positions=n, vocab_size=vocab, probs=probs.numpy().tobytes())
    rows, cols = probs.nonzero(as_tuple=True)
    offsets = torch.zeros(n + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
    return worker_pb2.Distributions(
        positions=n,
        vocab_size=vocab,
        probs=probs[rows, cols].numpy().tobytes(),
        token_ids=cols.to(torch.int32).numpy().tobytes(),
        support_offsets=offsets.numpy().tobytes(),
    )


def unpack_distributions(message: worker_pb2.Distributions) -> torch.Tensor:
    """Dense float32 probabilities [positions, vocab_size] from a packed message."""
    n, vocab = message.positions, message.vocab_size
    values = torch.from_numpy(np.frombuffer(message.probs, dtype=np.float32).copy())
    if not message.token_ids:
        return values.view(n, vocab)
    token_ids = torch.from_numpy(np.frombuffer(message.token_ids, dtype=np.int32).astype(np.int64))
    offsets = np.frombuffer(message.support_offsets, dtype=np.int32)
    rows = torch.from_numpy(np.repeat(np.arange(n), np.diff(offsets)))
    dense = torch.zeros(n, vocab, dtype=torch.float32)
    dense[rows, token_ids] = values
    return dense
