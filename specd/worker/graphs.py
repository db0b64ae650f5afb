"""Decode and verify forwards of fixed shapes, replayed as CUDA graphs (`--cuda-graphs`).

Why: on a GPU, a small batch's forward is bound by kernel launches, not arithmetic. One
layer of the lean forward (`specd.worker.lean`) is about fifty kernels, so an 8B target's
forward is about 1,500 launches and a 1B draft's about 750, each a few microseconds of
host time, while the device's work for one decoding row is less. A CUDA graph launches a
whole captured forward at once, as vLLM and SGLang do for their decode batches.

A graph fixes every shape and every address, so a captured forward (`StaticStep`) runs
over buffers of its own, and its shape is a bucket:
- `batch` rows (a power of two up to the worker's sessions);
- `feed` tokens per row (1 for a draft's step, up to 16: a verification of γ + 1);
- `width` blocks of the KV pool each row reads (a power of two).
A worker captures its buckets when it loads (`buckets`: a bounded set), as vLLM and SGLang
do, and counts their memory before it sizes the KV pool (`specd.worker.memory`), so that
no capture stalls a request or takes memory the pool was promised. A forward whose rows
fit a captured bucket fills that bucket's buffers with one copy and replays its graph; any
other forward (a prefill chunk, more rows or a longer context than the set covers) runs
the eager forward as before (`forwards`): there the device's arithmetic, not the launches,
is most of the time.

Which buckets, and why: every batch, every feed, and every width up to the model's
context, where the bucket feeds at most `GRAPH_POSITIONS` positions (vLLM's largest
captured batch by default) and reads at most the keys the profiling forward read
(`memory.profile_shape`), so that no captured forward gathers more than the activation
the memory plan measured. Each bucket keeps its buffers and its output, its hidden states
(`graph_bytes`); the captures share one memory pool, taken largest first, so their
intermediates take the largest one's peak once (`transient_bytes`).

Padding, so that nothing the graph computes for it reaches a real row: a row feeding
fewer than `feed` tokens, and the rows past the forward's own, feed token 0 and write its
keys and values into the null block (`kvstore.NULL_BLOCK`, never handed to a session),
which every row's mask hides. A padding row sees its own first key, so every query has a
key and every value stays finite (a row that sees none gives NaN in some attention
kernels, which a masked weight of 0 would still spread through the null block). Each
real row's logits are then those of the eager forward over the same row, up to the
rounding of products of another shape (as batching already is).

What the capture needs, and `problem` checks at load: the lean forward (transformers'
own forward builds masks and caches in Python), experts run as grouped products (a
mixture of experts loaded with transformers' eager experts loops over the experts its
router chose, read back from the device), and a
rotary scaling that does not choose its frequencies from the positions ("longrope";
"dynamic" is refused by every worker). That the static forward has no branch on the
values of tensors, no host copy and no shape that follows the rows is tested on a CPU,
which cannot capture (`tests/test_graphs.py`): the operators it runs, recorded for two
sets of rows, and torch's graph tracer.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from specd.devices import upload
from specd.worker import memory
from specd.worker.kvstore import NULL_BLOCK, KVPool
from specd.worker.layout import BatchCache, BatchInputs, BatchRow
from specd.worker.settings import BatchSettings

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # rows of a captured forward, capped by the worker's sessions
FEED_BUCKETS = (1, 2, 4, 8, 16)  # tokens per row: a plain step, a verification of γ + 1 ≤ 16
# Positions (rows × tokens) of the largest captured forward. Past it a forward's arithmetic
# outweighs its launches, and each bucket's output grows with its positions.
GRAPH_POSITIONS = 512
Bucket = tuple[int, int, int]  # (batch, feed, width)
# Families whose layers route tokens to experts (the lean forward calls their own MoE blocks):
# transformers runs them as grouped products with offsets on the device, or, where a model
# is loaded with experts_implementation="eager", as a loop over the experts hit.
_ROUTED = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


class Decoder(Protocol):
    """The lean forward in its two parts (`specd.worker.lean.LeanDecoder`)."""

    def body(self, inputs: BatchInputs) -> torch.Tensor:
        """Final-normed hidden states [1, Σ T, H] at every position."""

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] of final-normed rows [..., H]."""


def _bucket(value: int, buckets: Sequence[int]) -> int | None:
    return next((bucket for bucket in buckets if bucket >= value), None)


def _width(blocks: int) -> int:
    """The width bucket of a row reading `blocks` blocks: the power of two at or above it."""
    return 1 << max(blocks - 1, 0).bit_length()


def _parts(batch: int, feed: int, width: int) -> list[int]:
    """Lengths of a bucket's buffer parts, in order (`StaticStep`)."""
    positions = batch * feed
    return [positions, positions, positions, batch * width, batch, batch, positions]


def buckets(*, max_sessions: int, batching: BatchSettings, max_context: int) -> list[Bucket]:
    """The buckets a worker captures at load, largest first (the order a shared memory pool
    wants): every batch up to the worker's sessions, every feed, and every width up to the
    model's context, where batch × feed ≤ GRAPH_POSITIONS and the bucket gathers at most the
    keys the worker's profiling forward does (`memory.profile_shape`)."""
    block_tokens = batching.block_tokens
    max_keys = memory.profile_shape(max_sessions=max_sessions, max_batch_tokens=batching.max_batch_tokens,
                                    prefill_chunk=batching.prefill_chunk, max_context=max_context,
                                    block_tokens=block_tokens).keys
    batches = tuple(b for b in BATCH_BUCKETS if b < max_sessions) + (
        _bucket(max_sessions, BATCH_BUCKETS) or BATCH_BUCKETS[-1],)
    blocks = -(-max_context // block_tokens)
    widest = _width(blocks)  # a session at the whole context fits it
    found = []
    for batch in batches:
        widths = [1 << k for k in range(widest.bit_length()) if batch * (1 << k) * block_tokens <= max_keys]
        found += [(batch, feed, width) for feed in FEED_BUCKETS if batch * feed <= GRAPH_POSITIONS
                  for width in widths]
    return sorted(found, key=lambda b: (b[0] * b[2], b[0] * b[1], b), reverse=True)


class StaticStep:
    """One bucket's forward: `batch` rows feeding `feed` tokens each, reading `width`
    blocks each, over buffers it owns. `fill` writes a forward's rows into them; `run`
    computes the final-normed hidden states of every padded position, [1, batch × feed,
    H], from nothing but those buffers, which is what a graph captures. The output layer
    runs after, on the kept rows alone (`StaticSteps.forward`): a captured graph keeps its
    output for good, and logits of every padded position would be batch × feed × V of
    them a bucket (2 GiB in bfloat16 for 256 rows of 16 tokens over Llama 3's 128K
    vocabulary), where hidden states are H wide.

    The buffer, int64, in one tensor so that it is filled by one copy: token ids,
    positions and write slots [batch × feed each], block tables [batch × width], the
    first position and end of each row [batch each], then the kept rows' indices into
    the padded positions [batch × feed], read after `run` (outside a graph)."""

    def __init__(self, decoder: Decoder, pool: KVPool, batch: int, feed: int, width: int,
                 device: torch.device, paged_kernel: bool = False) -> None:
        self.decoder, self.pool, self.paged_kernel = decoder, pool, paged_kernel
        self.batch, self.feed, self.width = batch, feed, width
        parts = _parts(batch, feed, width)
        self.buffer = torch.zeros(sum(parts), dtype=torch.long, device=device)
        (self.ids, self.positions, self.write_slots, self.read_blocks, self.starts, self.ends,
         self.kept) = self.buffer.split(parts)
        self.fill([])  # all padding: what a capture runs on, writing only into the null block
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None  # a captured graph's hidden states, rewritten by each replay

    def fill(self, rows: Sequence[BatchRow]) -> int:
        """Lay `rows` out in the buffers (one copy to the device); how many kept rows."""
        batch, feed, width, size = self.batch, self.feed, self.width, self.pool.block_tokens
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        blocks: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        kept: list[int] = []
        for b in range(batch):
            row = rows[b] if b < len(rows) else None
            if row is None:  # a padding row: positions 0.., its keys in the null block, seeing the first
                start, tokens, table, end, real = 0, [], [], 1, []
            else:
                session, tokens = row.session, row.tokens
                start, table, end = session.length, session.blocks[:width], session.length + len(tokens)
                real = session.slots(start, end)
                kept += range(b * feed + len(tokens) - row.keep, b * feed + len(tokens))
            ids += tokens + [0] * (feed - len(tokens))
            positions += range(start, start + feed)
            slots += real + [NULL_BLOCK * size + i % size for i in range(len(real), feed)]
            blocks += table + [NULL_BLOCK] * (width - len(table))
            starts.append(start)
            ends.append(end)
        count = len(kept)
        kept += [0] * (batch * feed - count)
        # `upload`'s copy (from pinned memory on a GPU, without a wait), then one on the device
        # into the buffers the graph reads.
        self.buffer.copy_(upload(ids + positions + slots + blocks + starts + ends + kept, self.buffer.device))
        return count

    def run(self) -> torch.Tensor:
        """The final-normed hidden states [1, batch × feed, H] of every padded position:
        operators on the buffers alone, with shapes that depend only on the bucket (what a
        CUDA graph captures)."""
        device, size = self.buffer.device, self.pool.block_tokens
        keys = self.width * size
        query_positions = self.starts[:, None] + torch.arange(self.feed, device=device)  # [B, T]
        allowed = None  # the paged kernel reads each row up to its end instead
        if not self.paged_kernel:
            key_positions = torch.arange(keys, device=device)
            allowed = ((key_positions <= query_positions[..., None])
                       & (key_positions < self.ends[:, None, None])).unsqueeze(1)  # [B, 1, T, keys]
        cache = BatchCache(self.pool, self.write_slots, self.read_blocks, self.batch, keys, None, allowed,
                           query_positions, None, self.feed, gather_scratch=False,
                           row_ends=self.ends if self.paged_kernel else None)
        every = torch.arange(self.batch * self.feed, device=device)
        return self.decoder.body(BatchInputs(self.ids[None], self.positions[None], cache, every, []))


class StaticSteps:
    """The static forwards of one model, one for each of `buckets`, built when it is made:
    captured as CUDA graphs (`capture`), or run eagerly (a CPU, which cannot capture: the
    same operators, for tests). Nothing is built or captured after, on a request's path."""

    def __init__(self, decoder: Decoder, pool: KVPool, device: torch.device, buckets: Sequence[Bucket],
                 capture: bool, paged_kernel: bool = False) -> None:
        self.decoder, self.pool, self.device = decoder, pool, device
        self.batches = tuple(sorted({batch for batch, _, _ in buckets}))
        self._memory = torch.cuda.graph_pool_handle() if capture else None  # one pool for every graph
        self._steps: dict[Bucket, StaticStep] = {}
        for key in buckets:  # largest first: later captures reuse what earlier ones freed in the pool
            step = self._steps[key] = StaticStep(decoder, pool, *key, device, paged_kernel)
            if capture:
                self._capture(step)
        self.replays = 0  # forwards run through a static step (a counter for tests and the GPU check)

    def bucket(self, rows: Sequence[BatchRow]) -> Bucket | None:
        """The bucket `rows` fit (None: no built one does; they run the eager forward)."""
        batch = _bucket(len(rows), self.batches)
        feed = _bucket(max(len(row.tokens) for row in rows), FEED_BUCKETS)
        if batch is None or feed is None:
            return None
        blocks = max(-(-(row.session.length + len(row.tokens)) // self.pool.block_tokens) for row in rows)
        key = (batch, feed, _width(blocks))
        return key if key in self._steps else None

    def forward(self, rows: Sequence[BatchRow]) -> tuple[torch.Tensor, list[slice]] | None:
        """The kept logits [Σ keep, V] of `rows` and each row's slice, from the bucket's
        static step (None: no bucket fits). Rows have reserved their positions, as for
        `layout.prepare`. On the model's thread."""
        key = self.bucket(rows)
        if key is None:
            return None
        step = self._steps[key]
        count = step.fill(rows)
        if step.graph is not None:
            step.graph.replay()
            hidden = step.output
        else:
            hidden = step.run()
        assert hidden is not None
        self.replays += 1
        kept, reads = step.kept[:count], list[slice]()
        for row in rows:
            start = reads[-1].stop if reads else 0
            reads.append(slice(start, start + row.keep))
        return self.decoder.head(hidden[0].index_select(0, kept)), reads

    def _capture(self, step: StaticStep) -> None:
        """Capture `step` (all padding, so the warm-up and the capture write only the null
        block) as a CUDA graph, after warm-up runs on a side stream, as torch's
        documentation asks (lazy initialisations must not be captured)."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step.run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._memory):
            step.output = step.run()
        step.graph = graph

    @property
    def built(self) -> list[Bucket]:
        """The buckets this model's forwards may run as static steps."""
        return list(self._steps)

    @property
    def captured(self) -> int:
        """Buckets captured as graphs."""
        return sum(step.graph is not None for step in self._steps.values())


def graph_bytes(buckets: Sequence[Bucket], hidden: int, element_bytes: int) -> int:
    """What `buckets`' static steps keep for good, in bytes: each one's int64 buffer
    (`_parts`) and its captured output, [batch × feed, hidden] of the model's dtype."""
    return sum(8 * sum(_parts(batch, feed, width)) + batch * feed * hidden * element_bytes
               for batch, feed, width in buckets)


def transient_bytes(decoder: Decoder, pool: KVPool, buckets: Sequence[Bucket], device: torch.device,
                    paged_kernel: bool = False) -> int:
    """The largest peak, above what was allocated before it, of one eager run of the static
    steps whose intermediates are largest (for each feed, the bucket that gathers the most
    keys): what the captures' shared pool holds besides their outputs. Measured by torch's
    CUDA allocator; 0 on a CPU, where the runs still check the buckets' shapes. `pool` may
    be any pool of the model's shape: an all-padding step reads only its null block."""
    corners = [max((b for b in buckets if b[1] == feed), key=lambda b: (b[0] * b[2], b[0]))
               for feed in {feed for _, feed, _ in buckets}]
    peak = 0
    cuda = device.type == "cuda"
    with torch.inference_mode():
        for key in corners:
            step = StaticStep(decoder, pool, *key, device, paged_kernel)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            output = step.run()
            if cuda:
                torch.cuda.synchronize(device)
                peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
            del output, step
    return peak


def problem(model: torch.nn.Module, decoder: Decoder | None, longrope: bool) -> str | None:
    """Why `model`'s forwards cannot run as static steps (None: they can). longrope: its
    rotary scaling switches frequencies with the positions (`rope.regime`)."""
    if decoder is None:
        return "it runs transformers' own forward, not the lean one (--model-forward lean, on a family it mirrors)"
    experts = getattr(model.config, "_experts_implementation", None)
    if type(model).__name__ in _ROUTED and experts == "eager":
        return (f"{type(model).__name__} runs its experts eagerly, a loop over the experts its router chose, read "
                f"back from the device; load it with experts_implementation='grouped_mm' (transformers' default)")
    if longrope:
        return "its 'longrope' rotary scaling picks its frequencies from the forward's positions"
    return None
