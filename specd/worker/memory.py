"""How much of a CUDA device a worker's KV pool takes (`--gpu-memory-fraction`), and whether
the device a worker is asked for exists.

`--gpu-memory-fraction F` (0 < F ≤ 1) is the share of the device's total memory one worker
may use, as vLLM's `--gpu-memory-utilization` is one instance's: two workers on one device
each take their own F, and their fractions should add up to at most about 0.9 (each process's
CUDA context, about half a GiB, is outside them, as in vLLM). For each model the worker loads:

    KV pool = F × total − loaded − activation − kept rows − graphs

- loaded: what loading the model allocated on the device (its weights and buffers), counted
  by torch's allocator in this process, so another process loading at the same time does not
  change it;
- activation: the peak allocation, above what was allocated before it, of one profiling
  forward at the largest batch the worker serves (`profile_shape`), with the KV gather
  scratch (`KVPool.gather`) grown from nothing and the post-processing's float32 softmax and
  top-k over every kept row;
- kept rows: the budget of a draft's kept q rows (`--kept-rows-mib`), which live on the device;
- graphs (`--cuda-graphs`): what the buckets captured at load keep, their buffers and outputs
  (`graphs.graph_bytes`), and the peak of the captures' shared pool, one eager run of the
  largest buckets measured on the profiling pool (`graphs.transient_bytes`). The captures
  run after the pool is made (a graph holds its addresses), and the worker logs what they
  took beside this figure.

and never more than the device has free once the model is loaded, less the same activation,
kept rows and graphs (another process may hold more than its fraction). A draft worker hosting several
drafts gives each an equal share of its fraction. Without the flag a worker keeps what it always
did: its pool within half of the memory free when the model loads (the GPU's, or the host's).
On a CPU the flag is refused (`device_problem`): there is no device memory to share, and
`--kv-cache-tokens` sizes the pool.

The profiling forward reads every row's keys through the gather at `PROFILE_CONTEXT` positions
of context (or the model's whole context, when shorter). Attention over longer contexts with
the largest batch needs more scratch than was profiled (the gather pads every row to the
longest). The paged kernel (`--attention-kernel triton`, `specd.worker.pagedkernel`) gathers
nothing, so with it the profile holds whatever the context: a worker takes it before profiling.

`specd serve` runs both workers on one device: it splits its one fraction between them in
proportion to the models' KV bytes per token (`split_fraction`), so that both pools hold
about as many positions, and starts the draft worker once the verifier is serving
(`specd_cli.serve.start_groups`), so that neither sizes its pool while the other loads.

Pure arithmetic at the top (no torch import: `specd serve` uses it); the measurements import
torch when called.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from specd.worker.kvstore import KVPool

# The context each row of the profiling forward holds before its new tokens.
PROFILE_CONTEXT = 4096
MiB = 1 << 20


def kv_pool_bytes(*, total: int, fraction: float, loaded: int, activation: int, kept_rows: int, free: int,
                  graphs: int = 0) -> int:
    """Bytes the KV pool of one model may take (0: none are left): F × total − loaded −
    activation − kept rows − graphs, and at most what is free less the activation, kept rows
    and graphs (which are not allocated while the pool is sized)."""
    budget = int(fraction * total) - loaded - activation - kept_rows - graphs
    room = free - activation - kept_rows - graphs
    return max(0, min(budget, room))


@dataclass(frozen=True)
class ProfileShape:
    """The rows of the profiling forward: `rows` sessions, the first feeding `widest` tokens and
    every other `width`, each after `context` cached positions, every fed token's logits kept."""

    rows: int
    widest: int
    width: int
    context: int

    @property
    def tokens(self) -> int:
        return self.widest + (self.rows - 1) * self.width

    @property
    def keys(self) -> int:
        """Keys the forward gathers: every row's, padded to the longest."""
        return self.rows * (self.context + self.widest)


def profile_shape(*, max_sessions: int, max_batch_tokens: int, prefill_chunk: int, max_context: int,
                  block_tokens: int, profile_context: int = PROFILE_CONTEXT) -> ProfileShape:
    """The largest forward the scheduler can build (`specd.worker.batching`): as many rows as
    sessions are kept (one token each at least), max_batch_tokens tokens in all, one row a
    prefill chunk wide (a forward pads every row's queries to its widest), the rest sharing the
    other tokens; each row after `profile_context` positions (a whole number of blocks), within
    the model's context."""
    rows = max(1, min(max_sessions, max_batch_tokens))
    widest = max(1, min(prefill_chunk, max_batch_tokens - (rows - 1)))
    width = max(1, (max_batch_tokens - widest) // max(1, rows - 1)) if rows > 1 else widest
    width = min(width, widest)
    context = max(0, min(profile_context, max_context - widest))
    return ProfileShape(rows, widest, width, context // block_tokens * block_tokens)


def profile_blocks(shape: ProfileShape, block_tokens: int) -> int:
    """Blocks of a pool that holds the profile's rows: the shared context once (every row forks
    it, copy on write), each row's own blocks for its new tokens, and the null block."""
    own = -(-shape.widest // block_tokens) + (shape.rows - 1) * -(-shape.width // block_tokens)
    return shape.context // block_tokens + own + 1


def split_fraction(fraction: float, costs: Mapping[str, float]) -> dict[str, float]:
    """One device's fraction split between the workers on it, in proportion to their costs (KV
    bytes per token: each pool then holds about as many positions); equal shares where a cost is
    unknown (0)."""
    if not costs:
        return {}
    if any(cost <= 0 for cost in costs.values()):
        return {name: fraction / len(costs) for name in costs}
    whole = sum(costs.values())
    return {name: fraction * cost / whole for name, cost in costs.items()}


def config_kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """KV bytes per token of a model directory, read from its config.json: layers × KV heads ×
    head dim × 2 (keys and values) × dtype_bytes; 0 when the config names no such fields (the
    worker reads the true shape from a forward when it loads: `trials.kv_shape`)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    config = config.get("text_config", config)
    layers = config.get("num_hidden_layers") or 0
    heads = config.get("num_attention_heads") or 0
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else 0)
    return int(layers * kv_heads * head_dim * 2 * dtype_bytes)


def device_problem(device: str, gpu_memory_fraction: float = 0.0) -> str | None:
    """Why a worker cannot run on `device` with this fraction (None: it can), in words a person
    can act on: a CUDA device this torch or machine lacks, or a fraction for a device whose
    memory is not measured (a CPU's). Torch is imported only for a device other than a CPU."""
    kind = device.split(":")[0]
    if kind != "cpu":
        import os

        import torch

        try:
            where = torch.device(device)
        except (RuntimeError, ValueError):
            return f"--device {device!r} is not a torch device (cpu, cuda, cuda:1)"
        kind = where.type
        if kind == "cuda":
            if torch.version.cuda is None:
                return (f"--device {device}: this torch ({torch.__version__}) is built without CUDA; install a "
                        f"CUDA build of torch, or run on --device cpu")
            if not torch.cuda.is_available():
                return (f"--device {device}: no CUDA device is visible to torch {torch.__version__} (CUDA "
                        f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                        f"check the driver with nvidia-smi, or run on --device cpu")
            count = torch.cuda.device_count()
            if where.index is not None and where.index >= count:
                return f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    if gpu_memory_fraction and kind != "cuda":
        return (f"--gpu-memory-fraction sizes the KV pool from a CUDA device's memory, and this worker runs on "
                f"{kind}: leave it out (the pool then takes at most half of the memory free at load) or size "
                f"the pool with --kv-cache-tokens")
    return None


def profile_activation(forward, pool: KVPool, shape: ProfileShape, vocab_size: int,
                       device: torch.device) -> int:
    """Peak bytes one forward of `shape`'s rows allocates above what was allocated before it,
    with the post-processing's float32 softmax and top-2 over every kept row and the pool's
    gather scratch grown from nothing (measured by torch's CUDA allocator; 0 elsewhere, where
    the forward still runs, which checks the profile's rows). `forward(rows)` is the worker's
    (`forwards.forward` with its model)."""
    import torch

    from specd.worker.kvstore import SessionKV
    from specd.worker.layout import BatchRow

    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=generator).tolist()

    with torch.inference_mode():
        base = SessionKV(pool)
        if not base.reserve(max(shape.context, 1)):
            raise RuntimeError(f"the profiling pool has no room for {shape.context} positions")
        base.tokens = tokens(shape.context)
        chunk = 1024
        for start in range(0, shape.context, chunk):  # the shared context, a chunk a forward
            forward([BatchRow(base, base.tokens[start:start + chunk], 1)])
        rows = []
        for i in range(shape.rows):
            width = shape.widest if i == 0 else shape.width
            fork = base.fork(shape.context, shape.context + width)
            if fork is None:
                raise RuntimeError(f"the profiling pool has no room for row {i} of {shape.rows}")
            rows.append(BatchRow(fork, tokens(width), width))
        pool._scratch = None  # the gather's scratch grows in the profiled forward, as at its largest
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        logits, _ = forward(rows)
        probs = torch.softmax(logits.float(), dim=-1)
        probs.topk(2, dim=-1)
        del logits, probs
        peak = 0
        if cuda:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device) - before
        pool._scratch = None
        del rows, base
    return peak


@dataclass(frozen=True)
class MemoryPlan:
    """How one model's KV pool was sized under --gpu-memory-fraction (bytes), for the log and
    scripts/gpu_check.sh."""

    total: int
    fraction: float
    loaded: int
    activation: int
    kept_rows: int
    free: int
    pool: int
    profile: ProfileShape
    graphs: int = 0  # bytes kept for --cuda-graphs' buckets
    buckets: int = 0  # how many

    def describe(self) -> str:
        shape = self.profile
        graphs = (f", {self.graphs / MiB:,.0f} MiB for {self.buckets} CUDA graphs" if self.buckets else "")
        return (f"{self.fraction:g} of {self.total / MiB:,.0f} MiB, less {self.loaded / MiB:,.0f} MiB loaded, "
                f"{self.activation / MiB:,.0f} MiB of activation (a forward of {shape.rows} rows, "
                f"{shape.tokens} tokens, at {shape.context} positions of context){graphs} and "
                f"{self.kept_rows / MiB:,.0f} MiB of kept rows, with {self.free / MiB:,.0f} MiB free: a pool of "
                f"{self.pool / MiB:,.0f} MiB")
