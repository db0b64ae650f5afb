"""Small host values onto a model's device: index lists, uniforms, a forward's rows.

On a GPU a copy from pageable memory waits: the host blocks until the device has taken
it, and so until the stream has run whatever came before (the forward whose results the
copy is for). From pinned memory with `non_blocking`, the copy is queued like a kernel and
the host goes on. torch's caching host allocator keeps the pinned buffer until the copy
has run, so it may be let go at once. On a CPU it is the tensor itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (on the CPU) on `device`, without a wait on a GPU."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload(values: Sequence[int] | Sequence[float], device: torch.device, dtype: torch.dtype = torch.long
           ) -> torch.Tensor:
    """Python numbers as one tensor of `dtype` on `device`: one copy, without a wait on a GPU."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def select_rows(tensor: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """`tensor`'s rows at `rows`, in their order: the tensor itself when they are all of it
    in order (one session in a forward: no copy of rows as wide as a vocabulary), else one
    index upload and one gather."""
    if len(rows) == tensor.shape[0] and all(row == i for i, row in enumerate(rows)):
        return tensor
    return tensor.index_select(0, upload(rows, tensor.device))


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bfloat16 matmuls run on `device` at least as fast as float32's: on an
    accelerator, or on a CPU with oneDNN's bfloat16 kernels (AVX512-BF16 or AMX). A CPU
    with AVX2 alone emulates them: a [256, 576] × [576, 1536] product took 391 ms against
    4.7 ms in float32 on a 2-core AMD EPYC."""
    return device.type != "cpu" or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
