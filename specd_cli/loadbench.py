"""`specd bench --concurrency 1,4,8,16`: throughput and latency with many requests in flight.

For each concurrency level N, every configuration (target-only, fixed γ, AUTO, ...) runs
in turn with N clients in a closed loop, each sending its next prompt as soon as its last
one finished, over the same requests. Each request streams (GenerateStream), so time to
first token and time between tokens are measured as a client sees them. The clients are
tasks on one asyncio event loop over one channel (grpc.aio), as a service written in
Python calls the gateway: the bench shares the machine with the server, and on 2 cores 32
threads of blocking streams took half again the CPU of the event loop (3.7 against 2.4 s
for 512 requests of 48 tokens) and 12–16% of the server's tokens/s.
Beside them, in the same run, transformers' own batched `generate` of the same target
on N prompts at once (left-padded, greedy): what plain batched decoding does with no
server at all. Prints one table, writes load.json and two plots (tokens/s and p50
latency against concurrency).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.tls import ClientTLS


@dataclass
class LoadResult:
    """One configuration at one concurrency level."""

    label: str
    concurrency: int
    tokens: int = 0
    seconds: float = 0.0  # wall time of the whole level
    latencies: list[float] = field(default_factory=list)  # s per request
    first_token: list[float] = field(default_factory=list)  # s to the first streamed chunk
    between_tokens: list[float] = field(default_factory=list)  # s per token after the first chunk
    batch_sizes: list[float] = field(default_factory=list)  # mean verify batch of each request
    proposed: int = 0
    accepted: int = 0
    failures: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def merge(self, other: LoadResult) -> None:
        """Add another run of the same configuration and level (another round)."""
        self.tokens += other.tokens
        self.seconds += other.seconds
        for mine, theirs in ((self.latencies, other.latencies), (self.first_token, other.first_token),
                             (self.between_tokens, other.between_tokens), (self.batch_sizes, other.batch_sizes)):
            mine.extend(theirs)
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.failures += other.failures

    @staticmethod
    def percentile(values: list[float], q: int) -> float:
        """The q-th percentile (0 without values)."""
        if len(values) < 2:
            return values[0] if values else 0.0
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def _one(stub, req, metadata: tuple[tuple[str, str], ...], result: LoadResult) -> None:
    import grpc

    began = time.perf_counter()
    first = None
    first_tokens = 0
    tokens = 0
    stats = None
    try:
        async for chunk in stub.GenerateStream(req, metadata=metadata):
            if first is None and chunk.token_ids:
                first, first_tokens = time.perf_counter(), len(chunk.token_ids)
            tokens += len(chunk.token_ids)
            if chunk.HasField("stats"):
                stats = chunk.stats
    except grpc.RpcError:
        result.failures += 1
        return
    ended = time.perf_counter()
    result.tokens += tokens
    result.latencies.append(ended - began)
    if first is not None:
        result.first_token.append(first - began)
        if tokens > first_tokens:
            result.between_tokens.append((ended - first) / (tokens - first_tokens))
    if stats is not None:
        result.batch_sizes.append(stats.mean_verify_batch_size)
        result.proposed += stats.proposed_tokens
        result.accepted += stats.accepted_tokens


def run_level(gateway: str, tls: ClientTLS, metadata: tuple[tuple[str, str], ...], requests: list, label: str,
              concurrency: int) -> LoadResult:
    """N clients in a closed loop over `requests`, on a channel of their own; the level's
    wall time is the window. metadata: sent with every call (an API key)."""
    return asyncio.run(_run_level(gateway, tls, metadata, requests, label, concurrency))


async def _run_level(gateway: str, tls: ClientTLS, metadata: tuple[tuple[str, str], ...], requests: list,
                     label: str, concurrency: int) -> LoadResult:
    from specd.tls import aio_channel
    from specd.v1 import gateway_pb2_grpc

    result = LoadResult(label, concurrency)
    queue = list(reversed(requests))
    async with aio_channel(gateway, tls) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await channel.channel_ready()

        async def client() -> None:
            while queue:
                await _one(stub, queue.pop(), metadata, result)

        began = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - began
    return result


def transformers_batched(target_dir: str, prompts: list[str], levels: list[int], max_new_tokens: int,
                         dtype_name: str, requests_per_level: int) -> dict[int, LoadResult]:
    """transformers' greedy `generate` on batches of N prompts (left-padded): tokens/s and latency
    (on the GPU when there is one)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specd.worker.hub import resolve

    target_dir = str(resolve(target_dir))  # a .gguf file or a hub id, as the services take it
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # On the GPU when there is one, as the services would run there (scripts/gpu_check.sh).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype_name)).to(device).eval()
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    results = {}
    for n in levels:
        result = LoadResult("transformers generate, batch = N", n)
        batches = max(1, requests_per_level // n)
        for b in range(batches):
            batch = [prompts[(b * n + i) % len(prompts)] for i in range(n)]
            inputs = tokenizer(batch, return_tensors="pt", padding=True).to(device)
            began = time.perf_counter()
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id)
            elapsed = time.perf_counter() - began
            result.seconds += elapsed
            for row in out[:, inputs["input_ids"].shape[1]:].tolist():
                ends = [i for i, t in enumerate(row) if t in eos]
                result.tokens += ends[0] + 1 if ends else len(row)
                result.latencies.append(elapsed)
        results[n] = result
    return results


def table(results: list[LoadResult], reference: dict[int, LoadResult]) -> str:
    """One row per (concurrency, configuration), ratios to target-only and to transformers."""
    lines = [f"{'N':>3} {'configuration':<32} {'tokens/s':>9} {'× OFF':>6} {'× HF':>6} {'p50 s':>6} {'p95 s':>6}"
             f" {'TTFT ms':>8} {'TBT ms':>7} {'batch':>6} {'acc.rate':>8} {'fail':>4}"]
    for n in sorted({r.concurrency for r in results}):
        level = [r for r in results if r.concurrency == n]
        off = level[0].tokens_per_s
        hf = reference.get(n)
        for r in level + ([hf] if hf else []):
            ttft = statistics.median(r.first_token) * 1e3 if r.first_token else 0.0
            tbt = statistics.median(r.between_tokens) * 1e3 if r.between_tokens else 0.0
            batch = statistics.fmean(r.batch_sizes) if r.batch_sizes else 0.0
            accept = f"{r.accepted / r.proposed:.3f}" if r.proposed else "—"
            ratio_hf = f"{r.tokens_per_s / hf.tokens_per_s:6.2f}" if hf and hf.tokens_per_s else f"{'':>6}"
            lines.append(f"{n:>3} {r.label:<32} {r.tokens_per_s:>9.1f} {r.tokens_per_s / off:>6.2f} {ratio_hf}"
                         f" {r.percentile(r.latencies, 50):>6.2f} {r.percentile(r.latencies, 95):>6.2f}"
                         f" {ttft:>8.0f} {tbt:>7.1f} {batch:>6.2f} {accept:>8} {r.failures:>4}")
    return "\n".join(lines)


def merged(rounds: list[list[LoadResult]]) -> list[LoadResult]:
    """Each configuration and level over every round, as new results: the rounds' own stay
    as measured, for `round_ratios`."""
    totals = [LoadResult(result.label, result.concurrency) for result in rounds[0]]
    for results in rounds:
        for total, result in zip(totals, results, strict=True):
            total.merge(result)
    return totals


def round_ratios(rounds: list[list[LoadResult]]) -> str:
    """Each configuration's tokens/s over target-only's (the first of each round), round by
    round, level by level: how far one round's ratio is from the next says how much of a
    difference between configurations the machine's noise can make."""
    lines = []
    for n in sorted({r.concurrency for results in rounds for r in results}):
        per_round = [[r for r in results if r.concurrency == n] for results in rounds]
        for index, label in enumerate(r.label for r in per_round[0][1:]):
            ratios = [level[index + 1].tokens_per_s / level[0].tokens_per_s for level in per_round
                      if level[0].tokens_per_s]
            if not ratios:
                continue
            lines.append(f"N={n:<3} {label} ÷ target-only, round by round: {' '.join(f'{r:.2f}' for r in ratios)}"
                         f" (mean {statistics.fmean(ratios):.2f}, spread {max(ratios) - min(ratios):.2f})")
    return "\n".join(lines)


def plots(results: list[LoadResult], reference: dict[int, LoadResult], out: Path) -> list[str]:
    """Throughput and p50 latency against concurrency, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[LoadResult]] = {}
    for r in [*results, *reference.values()]:
        series.setdefault(r.label, []).append(r)
    names = []
    for name, value, ylabel in (("load_tokens_per_s.png", lambda r: r.tokens_per_s, "tokens/s (all requests)"),
                                ("load_latency_p50.png", lambda r: r.percentile(r.latencies, 50), "p50 latency (s)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, rows in series.items():
            rows = sorted(rows, key=lambda r: r.concurrency)
            ax.plot([r.concurrency for r in rows], [value(r) for r in rows], marker="o", label=label)
        ax.set(xlabel="requests in flight", ylabel=ylabel, xscale="log",
               xticks=sorted({r.concurrency for r in results}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        names.append(name)
    plt.close("all")
    return names
