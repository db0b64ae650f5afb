"""`specd bench`: every γ policy and target-only decoding, side by side, against a running gateway.

For each prompt of a workload (prompts per task type), every configuration runs once, in
turn, each going first on every n-th prompt, so slow drift of a shared machine hits them
all alike. It prints a table (acceptance, mean tokens per step, tokens/s, ratio to
target-only, and how many outputs equal target-only's — all of them when greedy) overall
and per task type, and writes a report folder: report.md, results.json and PNG plots
(acceptance by draft position, γ over a request, tokens/s per configuration). With
--target/--draft it also times transformers' own target-only, assisted and prompt-lookup
generation on the same pair, in a process of its own and warmed up, for the "ours vs
transformers" ratio. --repeat K sends the workload K times and reports each pass: an
agent's workload, where prompts come back.

Each request carries a cache salt of its own configuration and prompt, so neither the
workers' prefix caches nor the gateway's suffix cache give one configuration or prompt what
another prefilled or generated; a --repeat pass meets its own earlier pass, as an agent's
prompts do. Each configuration's requests also carry a user segment of their own; under
--concurrency, one per level and round too, since every level sends the same prompts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from specd.contract import decodes_plainly
from specd.tls import add_client_arguments, client_channel, client_tls_from_args
from specd_cli.clientauth import add_api_key_argument

# Built-in workload for the shipped demo pair (Python source and English prose). These
# prompts were written for the benchmark, not cut from the training corpus.
DEMO_WORKLOAD = {
    "code": [
        "def read_config(path):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n",
        "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key):\n",
        "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n",
        "    def __repr__(self):\n        return ",
        "def _check_arg(value, name):\n    if not isinstance(value, int):\n        raise TypeError(",
        "    for line in lines:\n        line = line.strip()\n        if not line",
        "class Error(Exception):\n    \"\"\"Base class for exceptions in this module.\"\"\"\n",
        "    try:\n        result = func(*args, **kwargs)\n    except",
    ],
    "general": [
        "The return value of the function is",
        "This module provides a simple way to",
        "If the optional argument is given, the",
        "Changed in version 3.8: The",
        "The following example shows how to",
        "Note that this method does not",
        "A new list is returned, and the",
        "An exception is raised when the",
    ],
}


@dataclass
class Config:
    """One column of the benchmark: a speculation mode, γ policy and (optionally) draft."""

    label: str
    mode: str  # auto | fixed | off
    policy: str = ""
    draft_length: int = 0
    overlap: bool = False  # overlapped speculation ("+overlap")
    draft_model: str = ""  # empty: --draft-model, else the gateway's choice
    # The user segment its requests carry: one per configuration, so that no configuration
    # is drafted from another's responses by the gateway's suffix cache (one per tenant).
    segment: str = ""


@dataclass
class Result:
    """What one configuration did over the workload."""

    config: Config
    tokens: int = 0
    seconds: float = 0.0
    proposed: int = 0
    accepted: int = 0
    steps: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    by_task: dict[str, list[float]] = field(default_factory=dict)  # task → [tokens, seconds, proposed, accepted]
    gamma_trace: list[int] = field(default_factory=list)  # γ per step of the longest request
    outputs: list[list[int]] = field(default_factory=list)  # token ids of every request, in order
    same_as_target_only: int = 0  # requests whose output equals target-only's (greedy: all)
    pre_draft_steps: int = 0  # overlap: steps pre-drafted for, and hits among them
    pre_draft_hits: int = 0
    drafts: dict[str, int] = field(default_factory=dict)  # draft model → requests it served

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


def parse_configs(spec: str) -> list[Config]:
    """"off,fixed:4,ema,cost,cost+overlap,cost@DRAFT" → configurations (target-only is always first).

    `+overlap` turns overlapped speculation on; `@DRAFT` pins a configuration to one
    hosted draft; without it the request names --draft-model, or no draft at all (the
    gateway's task map or goodput selection).
    """
    configs = [Config("target-only", "off", segment="bench-0")]
    for item in spec.split(","):
        plus = "+overlap" in item
        item, _, draft = item.replace("+overlap", "").strip().partition("@")
        if not item or item == "off":
            continue
        name, _, gamma = item.partition(":")
        suffix = (" +overlap" if plus else "") + (f" @{draft}" if draft else "")
        segment = f"bench-{len(configs)}"
        if name == "fixed":
            configs.append(Config(f"fixed γ={gamma}{suffix}", "fixed", "fixed", int(gamma), overlap=plus,
                                  draft_model=draft, segment=segment))
        else:
            configs.append(Config(f"{name}{' (AUTO)' if name == 'cost' else ''}{suffix}", "auto", name,
                                  overlap=plus, draft_model=draft, segment=segment))
    return configs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT")
    add_api_key_argument(parser)
    parser.add_argument("--workload", help="JSON file {task_type: [prompts]} (default: the demo workload)")
    parser.add_argument("--questions", metavar="FILE",
                        help="instead of --workload: chat requests, one a line, each rendered as a user message "
                             "with --target's chat template (task type 'chat')")
    parser.add_argument("--questions-count", type=int, default=16, metavar="N",
                        help="the first N requests of --questions (default 16)")
    parser.add_argument("--configs", default="fixed:2,fixed:4,fixed:6,fixed:8,ema,cost,confidence",
                        help="comma list of fixed:γ, ema, cost, confidence, each optionally +overlap "
                             "(e.g. fixed:4+overlap; target-only always runs)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=1,
                        help="passes over the workload; with --concurrency, each level's configurations run "
                             "this many times in turn, each configuration's ratio to target-only printed "
                             "round by round (how much the machine's noise moves it)")
    parser.add_argument("--repeat", type=int, default=1, metavar="K",
                        help="send the whole workload K times, one table per pass: an agent's workload, where "
                             "the same prompts come back (the suffix proposer's cache meets them again)")
    parser.add_argument("--draft-model", default="", help="draft model name (default: the gateway's)")
    parser.add_argument("--out", default="bench-out", help="report folder")
    parser.add_argument("--target", help="also time transformers' generate on this target directory")
    parser.add_argument("--draft", help="... and its assisted generation with this draft directory")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="dtype for transformers' generate; match the services' --dtype")
    parser.add_argument("--concurrency", default="",
                        help="comma list of requests in flight, e.g. 1,4,8,16: measure throughput and latency "
                             "under load (specd_cli.loadbench) instead of one request at a time")
    parser.add_argument("--requests-per-level", type=int, default=32,
                        help="with --concurrency: requests per configuration and level")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="measure prefix caching instead (specd_cli.prefixbench): a long system prompt before "
                             "many questions, and a multi-turn conversation, each request with the cache and "
                             "without it")
    add_client_arguments(parser)  # --ca etc.: a gateway serving TLS


def build_request(prompt: str, task: str, config: Config, *, temperature: float, max_new_tokens: int, seed: int,
                  draft_model: str = "", user_segment: str = "", top_k: int = 0, cache_salt: str = ""):
    """The GenerateRequest of one prompt under one configuration (the config's draft wins)."""
    from specd.v1 import gateway_pb2

    mode = {"auto": gateway_pb2.SPECULATION_MODE_AUTO, "fixed": gateway_pb2.SPECULATION_MODE_FIXED,
            "off": gateway_pb2.SPECULATION_MODE_OFF}[config.mode]
    return gateway_pb2.GenerateRequest(
        prompt=prompt, task_type=task, user_segment=user_segment, cache_salt=cache_salt,
        sampling=gateway_pb2.SamplingParams(temperature=temperature, top_k=top_k, seed=seed,
                                            max_new_tokens=max_new_tokens),
        speculation=gateway_pb2.SpeculationParams(mode=mode, policy=config.policy,
                                                  draft_length=config.draft_length,
                                                  draft_model=config.draft_model or draft_model,
                                                  overlap=config.overlap))


def _request(prompt: str, task: str, config: Config, args: argparse.Namespace, seed: int, segment: str = "",
             cache_salt: str = ""):
    return build_request(prompt, task, config, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                         seed=seed, draft_model=args.draft_model, user_segment=segment or config.segment,
                         cache_salt=cache_salt)


def add_stats(result: Result, task: str, stats, seconds: float) -> None:
    """Add one request's GenerationStats (and its wall time) to a configuration's result."""
    result.tokens += stats.generated_tokens
    result.seconds += seconds
    result.proposed += stats.proposed_tokens
    result.accepted += stats.accepted_tokens
    result.steps += stats.steps
    result.pre_draft_steps += stats.pre_draft_steps
    result.pre_draft_hits += stats.pre_draft_hits
    for mine, theirs in ((result.proposed_per_position, stats.proposed_per_position),
                         (result.accepted_per_position, stats.accepted_per_position)):
        mine.extend([0] * (len(theirs) - len(mine)))
        for i, value in enumerate(theirs):
            mine[i] += value
    row = result.by_task.setdefault(task, [0, 0.0, 0, 0])
    row[0] += stats.generated_tokens
    row[1] += seconds
    row[2] += stats.proposed_tokens
    row[3] += stats.accepted_tokens
    if stats.draft_model:
        result.drafts[stats.draft_model] = result.drafts.get(stats.draft_model, 0) + 1
    if len(stats.draft_lengths) > len(result.gamma_trace):
        result.gamma_trace = list(stats.draft_lengths)


@dataclass(frozen=True)
class Costs:
    """The gateway's measured costs of the benchmarked pair (GetAcceptanceStats)."""

    model_pair: str
    target_step_ms: float
    draft_cost_ratio: float  # c
    verify_cost_ratio: dict[int, float]  # v(γ)

    def predicted_speedup(self, tokens_per_step: float, gamma: int) -> float | None:
        """docs/design.md §5: E[tokens per step] / (γ·c + v(γ)), with E as measured; None when
        v(γ) was not measured. (Acceptance is far from i.i.d. — a draft tends to get a
        whole run right or miss at once — so E from the per-token rate would mislead.)"""
        v = self.verify_cost_ratio.get(gamma)
        return None if v is None else tokens_per_step / (gamma * self.draft_cost_ratio + v)


def fetch_costs(stub, draft_model: str) -> Costs | None:
    """The cost row of the draft's pair (the most measured pair when no draft is named)."""
    from specd.v1 import gateway_pb2

    rows = stub.GetAcceptanceStats(gateway_pb2.AcceptanceStatsRequest()).costs
    rows = [r for r in rows if not decodes_plainly(r.model_pair)]
    if draft_model:
        rows = [r for r in rows if r.model_pair.startswith(f"{draft_model}->")]
    if not rows:
        return None
    row = max(rows, key=lambda r: len(r.verify_cost_ratio))
    return Costs(row.model_pair, row.target_step_ms, row.draft_cost_ratio, dict(row.verify_cost_ratio))


def run_gateway(args: argparse.Namespace, workload: dict[str, list[str]],
                configs: list[Config]) -> tuple[list[Result], Costs | None]:
    """Run every configuration on every prompt, interleaved, timing each request end to end."""
    import grpc

    from specd.v1 import gateway_pb2_grpc
    from specd_cli.clientauth import with_api_key

    results = [Result(c) for c in configs]
    with client_channel(args.gateway, client_tls_from_args(args)) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        grpc.channel_ready_future(channel).result(timeout=300)
        # Warm-up: one request per configuration (first-call costs; the cost policy's model),
        # in a segment of its own, so that no configuration meets the prompt in its cache.
        first_task, first_prompts = next(iter(workload.items()))
        for config in configs:
            stub.Generate(_request(first_prompts[0], first_task, config, args, seed=1, segment="bench-warm-up"))
        seed = 0
        for _ in range(args.rounds):
            for task, prompts in workload.items():
                for prompt in prompts:
                    seed += 1
                    # Each configuration first in turn, prompt by prompt, and each request under
                    # a cache salt of its own (the same in every --repeat pass): no configuration
                    # meets the prefill or the output of another, or of another prompt.
                    turn = seed % len(results)
                    for result in results[turn:] + results[:turn]:
                        began = time.perf_counter()
                        response = stub.Generate(_request(prompt, task, result.config, args, seed,
                                                          cache_salt=f"{result.config.segment}-{seed}"))
                        add_stats(result, task, response.stats, time.perf_counter() - began)
                        result.outputs.append(list(response.token_ids))
        costs = fetch_costs(stub, args.draft_model)
    for result in results:
        result.same_as_target_only = sum(a == b for a, b in zip(result.outputs, results[0].outputs))
    return results, costs


def machine() -> str:
    """This machine's CPU and cores: the ratio to transformers depends on them (torch's own
    products for one row, which transformers uses, run at very different speeds on
    different CPUs; specd's workers use oneDNN's packed ones, specd.worker.packing)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:  # not Linux: the platform's own name
        pass
    return f"{name}, {os.cpu_count()} cores"


def run_transformers(args: argparse.Namespace, workload: dict[str, list[str]]) -> dict[str, float]:
    """tokens/s of transformers' own greedy generate, target-only, assisted by the draft and
    with prompt lookup, measured as its users would: in a process of its own (spawned, so
    nothing of this client's threads or imports rides along), with torch's default threads
    as the workers have them, the services' dtype, and each configuration warmed up on the
    first prompt before its timed pass. An in-process baseline with no warm-up ran at 60
    tokens/s where transformers alone runs at 134-166 on the demo target (docs/performance.md,
    "The transformers baseline")."""
    import multiprocessing

    prompts = [p for ps in workload.values() for p in ps] * args.rounds
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(transformers_rates, (args.target, args.draft, args.dtype, prompts, args.max_new_tokens))


def chat_workload(args: argparse.Namespace) -> dict[str, list[str]]:
    """--questions' first --questions-count lines, each a user message rendered with the
    target's chat template up to the assistant's turn."""
    from transformers import AutoTokenizer

    from specd.worker.hub import resolve

    if not args.target:
        raise SystemExit("specd bench: --questions needs --target, whose chat template renders them")
    tokenizer = AutoTokenizer.from_pretrained(resolve(args.target))
    lines = [q for q in Path(args.questions).read_text(encoding="utf-8").splitlines() if q.strip()]
    return {"chat": [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=False) for q in lines[:args.questions_count]]}


def transformers_rates(target_spec: str, draft_path: str | None, dtype_name: str, prompts: list[str],
                       max_new_tokens: int) -> dict[str, float]:
    """In the spawned process: each configuration warmed up, then timed over every prompt.
    A draft made by `specd distill` from the target alone loads with the target's shared
    weights, as the draft worker loads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specd.worker import sharing
    from specd.worker.hub import resolve

    target_path = resolve(target_spec)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    dtype = getattr(torch, dtype_name)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
    draft = None
    if draft_path and sharing.is_shared_draft(Path(draft_path)):
        draft = sharing.load(Path(draft_path), dtype, target_path)
    elif draft_path:
        draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).eval()
    # Prompt lookup as transformers does it: a fixed 10 tokens per match (its documented setting).
    runs: dict[str, dict[str, object]] = {"transformers target-only": {}}
    if draft is not None:
        runs["transformers assisted"] = {"assistant_model": draft}
    runs["transformers prompt lookup"] = {"prompt_lookup_num_tokens": 10}
    rates = {}
    for label, extra in runs.items():
        tokens, seconds = 0, 0.0
        for i, prompt in enumerate([prompts[0], *prompts]):  # the first pass of prompt 0 warms up
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            began = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id, **extra)
            if i:
                tokens += out.shape[1] - ids.shape[1]
                seconds += time.perf_counter() - began
        rates[label] = tokens / seconds
    return rates


def table(results: list[Result], extra: dict[str, float], costs: Costs | None = None) -> str:
    """The side-by-side table, plain text; with costs, the speedup the cost model predicts."""
    base = results[0].tokens_per_s
    lines = [f"{'configuration':<26} {'acc. rate':>10} {'tokens/step':>11} {'tokens/s':>9} {'× target-only':>13}"
             f" {'same output':>12} {'predicted ×':>11} {'hit rate':>8}"]
    for r in results:
        accept = f"{r.acceptance_rate:.3f}" if r.proposed else "—"
        predicted = None
        if costs is not None and r.config.mode == "fixed":
            predicted = costs.predicted_speedup(r.tokens_per_step, r.config.draft_length)
        lines.append(f"{r.config.label:<26} {accept:>10} {r.tokens_per_step:>11.2f} {r.tokens_per_s:>9.1f} "
                     f"{r.tokens_per_s / base:>13.2f} {r.same_as_target_only:>5}/{len(r.outputs):<6} "
                     f"{f'{predicted:.2f}' if predicted else '':>11} "
                     f"{f'{r.pre_draft_hits / r.pre_draft_steps:.2f}' if r.pre_draft_steps else '':>8}")
    for label, rate in extra.items():
        lines.append(f"{label:<26} {'':>10} {'':>11} {rate:>9.1f} {rate / base:>13.2f}")
    if costs is not None:
        lines.append(f"\nmeasured costs of {costs.model_pair}: plain target step {costs.target_step_ms:.1f} ms, "
                     f"c = {costs.draft_cost_ratio:.3f} (draft per token), v(γ) = "
                     + ", ".join(f"{g}: {v:.2f}" for g, v in sorted(costs.verify_cost_ratio.items())))
    tasks = sorted({t for r in results for t in r.by_task})
    if len(tasks) > 1:
        lines.append("")
        lines.append("per task type: acceptance rate / tokens/s")
        lines.append(f"{'configuration':<26} " + " ".join(f"{t:>20}" for t in tasks))
        for r in results:
            cells = []
            for t in tasks:
                tokens, seconds, proposed, accepted = r.by_task.get(t, [0, 0.0, 0, 0])
                cells.append(f"{(accepted / proposed if proposed else 0):>9.3f} / "
                             f"{tokens / seconds if seconds else 0:>8.1f}")
            lines.append(f"{r.config.label:<26} " + " ".join(f"{c:>20}" for c in cells))
    lines += selection_summary(results)
    return "\n".join(lines)


def best_assignment(results: list[Result], policy: str) -> tuple[float, dict[str, str]]:
    """tokens/s of the best fixed draft per task type among configurations pinned to a draft
    with this policy (an oracle that knows each task's best draft), and that assignment."""
    pinned = [r for r in results if r.config.draft_model and r.config.policy == policy]
    tokens = seconds = 0.0
    choice = {}
    for task in sorted({t for r in pinned for t in r.by_task}):
        rows = [(r.by_task[task][0] / r.by_task[task][1], r) for r in pinned if r.by_task.get(task, [0, 0])[1]]
        if not rows:
            continue
        _, best = max(rows, key=lambda row: row[0])
        tokens += best.by_task[task][0]
        seconds += best.by_task[task][1]
        choice[task] = best.config.draft_model
    return (tokens / seconds if seconds else 0.0), choice


def selection_summary(results: list[Result]) -> list[str]:
    """For configurations that let the gateway pick the draft: each draft's share, and their
    tokens/s against the best fixed assignment of drafts to task types."""
    lines = []
    for r in results:
        if r.config.mode == "off" or r.config.draft_model or len(r.drafts) < 2:
            continue
        best, choice = best_assignment(results, r.config.policy)
        total = sum(r.drafts.values())
        shares = ", ".join(f"{d} {n / total:.0%}" for d, n in sorted(r.drafts.items()))
        lines.append(f"\n{r.config.label}, draft chosen by the gateway: {shares}")
        if best:
            lines.append(f"  {r.tokens_per_s:.1f} tokens/s = {r.tokens_per_s / best:.1%} of the best fixed assignment "
                         f"{choice} ({best:.1f} tokens/s)")
    return lines


def plots(results: list[Result], out: Path) -> list[str]:
    """PNG plots of the run; returns their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speculative = [r for r in results if r.proposed]
    names = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in speculative:
        rates = [a / p for a, p in zip(r.accepted_per_position, r.proposed_per_position) if p]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=r.config.label)
    ax.set(xlabel="position inside the draft", ylabel="accepted / proposed", title="Acceptance by draft position",
           ylim=(0, 1.05))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=100)
    names.append("acceptance_by_position.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in speculative:
        if r.config.mode == "auto":
            ax.step(range(1, len(r.gamma_trace) + 1), r.gamma_trace, where="post", label=r.config.label)
    ax.set(xlabel="step", ylabel="γ", title="γ over a request (adaptive policies)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "gamma_over_request.png", dpi=100)
    names.append("gamma_over_request.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.barh([r.config.label for r in results], [r.tokens_per_s for r in results])
    ax.set(xlabel="tokens/s", title="Throughput per configuration (batch 1)")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=100)
    names.append("tokens_per_s.png")
    plt.close("all")
    return names


def run_load(args: argparse.Namespace, workload: dict[str, list[str]], configs: list[Config]) -> int:
    """Every configuration at every concurrency level, and transformers' batched generate beside."""
    import grpc

    from specd.v1 import gateway_pb2_grpc
    from specd_cli import loadbench
    from specd_cli.clientauth import api_key_metadata, with_api_key

    levels = [int(n) for n in args.concurrency.split(",")]
    tls, metadata = client_tls_from_args(args), api_key_metadata(args.api_key_env)
    tasks = [(task, prompt) for task, prompts in workload.items() for prompt in prompts]
    rounds: list[list[loadbench.LoadResult]] = [[] for _ in range(args.rounds)]
    with client_channel(args.gateway, tls) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        grpc.channel_ready_future(channel).result(timeout=300)
        for config in configs:  # warm-up: first-call costs, the cost policy's first measurements
            stub.Generate(_request(tasks[0][1], tasks[0][0], config, args, seed=1, segment="bench-warm-up"))
        for n in levels:
            # Rounds take turns configuration by configuration, so that the machine's drift falls
            # on all of them alike, and each round starts with the next configuration: a wave
            # that always ran second would meet whatever the wave before it leaves behind (a
            # slower spell, the workers' state). Each level's and round's requests carry
            # segments of their own, and each request a cache salt of its own: neither the
            # suffix cache nor the prefix caches may give them another level's, round's or
            # request's work.
            for number, this_round in enumerate(rounds, start=1):
                measured: dict[int, loadbench.LoadResult] = {}  # by configuration, which run in turn
                turn = (number - 1) % len(configs)
                for index in [*range(turn, len(configs)), *range(turn)]:
                    config = configs[index]
                    segment = f"{config.segment}-at-{n}-round-{number}"
                    reqs = [_request(tasks[i % len(tasks)][1], tasks[i % len(tasks)][0], config, args, seed=i + 1,
                                     segment=segment, cache_salt=f"{segment}-{i}")
                            for i in range(args.requests_per_level)]
                    measured[index] = loadbench.run_level(args.gateway, tls, metadata, reqs, config.label, n)
                    print(f"  N={n:<3} {config.label:<24} {measured[index].tokens_per_s:8.1f} tokens/s"
                          + (f" (round {number})" if len(rounds) > 1 else ""), flush=True)
                this_round.extend(measured[index] for index in range(len(configs)))  # target-only first
    results = loadbench.merged(rounds)
    reference = {}
    if args.target:
        reference = loadbench.transformers_batched(args.target, [p for _, p in tasks], levels, args.max_new_tokens,
                                                   args.dtype, args.requests_per_level)
    text = loadbench.table(results, reference)
    if len(rounds) > 1:
        text += "\n\n" + loadbench.round_ratios(rounds)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = loadbench.plots(results, reference, out)
    rows = [{"label": r.label, "concurrency": r.concurrency, "tokens": r.tokens, "seconds": r.seconds,
             "tokens_per_s": r.tokens_per_s, "latency_p50_s": r.percentile(r.latencies, 50),
             "latency_p95_s": r.percentile(r.latencies, 95),
             "ttft_p50_s": statistics.median(r.first_token) if r.first_token else None,
             "tbt_p50_s": statistics.median(r.between_tokens) if r.between_tokens else None,
             "mean_verify_batch": statistics.fmean(r.batch_sizes) if r.batch_sizes else None,
             "acceptance_rate": r.accepted / r.proposed if r.proposed else None, "failures": r.failures}
            for r in [*results, *reference.values()]]
    (out / "load.json").write_text(json.dumps({
        "gateway": args.gateway, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "requests_per_level": args.requests_per_level, "rounds": args.rounds, "levels": levels, "rows": rows},
        indent=2))
    (out / "load.md").write_text(
        f"# specd bench --concurrency {args.concurrency}\n\n{args.requests_per_level} requests per configuration "
        f"and level in each of {args.rounds} round(s), {args.max_new_tokens} new tokens, temperature "
        f"{args.temperature}.\n\n```\n{text}\n```\n\n"
        + "".join(f"![{name}]({name})\n\n" for name in images))
    print(f"\nreport: {out / 'load.md'}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.shared_prefix:
        import grpc

        from specd.v1 import gateway_pb2_grpc
        from specd_cli import prefixbench
        from specd_cli.clientauth import with_api_key

        with client_channel(args.gateway, client_tls_from_args(args)) as channel:
            grpc.channel_ready_future(channel).result(timeout=300)
            return prefixbench.run(args, gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env)))
    workload = chat_workload(args) if args.questions else \
        json.loads(Path(args.workload).read_text()) if args.workload else DEMO_WORKLOAD
    configs = parse_configs(args.configs)
    if args.concurrency:
        return run_load(args, workload, configs)
    passes = []
    for number in range(1, args.repeat + 1):
        results, costs = run_gateway(args, workload, configs)
        if args.repeat > 1:
            print(f"pass {number} of {args.repeat}:\n{table(results, {}, costs)}\n", flush=True)
        passes.append(results)
    extra = run_transformers(args, workload) if args.target else {}
    text = table(results, extra, costs)
    if args.repeat > 1:
        text = "\n\n".join(f"pass {n}:\n{table(r, extra, costs)}" for n, r in enumerate(passes, 1))
    text = f"machine: {machine()}\n{text}"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    images = plots(results, out)
    (out / "results.json").write_text(json.dumps({
        "gateway": args.gateway, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "rounds": args.rounds, "prompts": {t: len(p) for t, p in workload.items()},
        "configurations": [{"label": r.config.label, "tokens": r.tokens, "seconds": r.seconds,
                            "tokens_per_s": r.tokens_per_s, "acceptance_rate": r.acceptance_rate,
                            "tokens_per_step": r.tokens_per_step, "by_task": r.by_task,
                            "proposed_per_position": r.proposed_per_position,
                            "accepted_per_position": r.accepted_per_position, "gamma_trace": r.gamma_trace,
                            "same_output_as_target_only": r.same_as_target_only, "requests": len(r.outputs)}
                           for r in results],
        "passes": [[{"label": r.config.label, "tokens_per_s": r.tokens_per_s, "acceptance_rate": r.acceptance_rate,
                     "tokens_per_step": r.tokens_per_step, "same_output_as_target_only": r.same_as_target_only}
                    for r in results] for results in passes],
        "transformers_tokens_per_s": extra,
        "costs": costs.__dict__ if costs else None}, indent=2))
    (out / "report.md").write_text(
        f"# specd bench\n\n{statistics.fmean([len(p) for p in workload.values()]):.0f} prompts per task type, "
        f"{args.max_new_tokens} new tokens, temperature {args.temperature}, {args.rounds} round(s).\n\n"
        f"```\n{text}\n```\n\n" + "".join(f"![{name}]({name})\n\n" for name in images))
    print(f"\nreport: {out / 'report.md'}")
    return 0
