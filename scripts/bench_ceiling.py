"""What speculation gains with the models alone: greedy fixed-γ decoding ÷ target-only
decoding of the same prompts in one process, with no gRPC, no gateway and no scheduler.

    python scripts/bench_ceiling.py [--target models/demo/target] [--draft models/demo/draft-distilled]
        [--gamma 4] [--max-new-tokens 48] [--rounds 3] [--target-threads 0] [--draft-threads 1]
        [--device cpu|cuda] [--dtype float32|bfloat16|float16] [--workload FILE]

Each model is loaded with what shapes a worker's forward (on a CPU large linear layers
packed for oneDNN; the paged KV store; the lean forward where it is exact) and runs on a
thread of its own, on a CPU with the torch threads `specd serve` gives the demo pair (the
draft one, `--draft-threads 1`; the target torch's default, as for any target of 32 MiB
of weights or more). A speculative step is the draft's γ forwards on the draft's thread, then
one forward of the γ+1 positions on the target's, then the greedy verdict
(`specd.rejection.verify_greedy`); a target-only step is one forward of one token. So a
step pays the forwards and two hand-offs between threads per model, as a worker's
does, and nothing of the serving path: no messages, no event loops, no batching.

The prompts are `specd bench`'s demo workload (or `--workload`, a `specd bench --workload`
file such as the held-out real code of `scripts/heldout_workload.py`), decoded both ways in
turns, prompt by prompt, `--rounds` times; generation stops at EOS or `--max-new-tokens`.
It prints tokens/s of each, their ratio round by round, tokens per step and how many
prompts gave the same tokens both ways (16 of 16 with the demo pair in float32 on this
project's CPU; in half precision a verification's product of γ+1 rows may round apart from
a one-row product's and turn a near tie). Against `specd bench --configs fixed:4
--concurrency 1` on the same machine, the same hour, it says what the serving path costs
a speculative step, and what this model pair could give at best on this machine;
`scripts/ceiling_pairs.py` takes the two in pairs a minute apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specd.config import DEMO_DRAFT, DEMO_TARGET
from specd.rejection import verify_greedy
from specd.worker import forwards, lean, packing, trials
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.runtime import eos_ids
from specd_cli.bench import DEMO_WORKLOAD

BLOCK_TOKENS = 16


class Model:
    """One model on a thread of its own: loaded there, and every forward run there."""

    def __init__(self, path: str, threads: int, device: torch.device, dtype: torch.dtype,
                 layout: str = "onednn") -> None:
        self.device = device
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"model-{path}")
        self.thread.submit(self._load, path, threads, dtype, layout).result()

    def _load(self, path: str, threads: int, dtype: torch.dtype, layout: str) -> None:
        if threads:
            torch.set_num_threads(threads)
        # packed_model packs a CPU's layers only.
        self.model = packing.packed_model(
            lambda: AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval(), lean.joinable,
            layout)
        config = self.model.config
        shape = trials.kv_shape(self.model, self.device)
        use_paged_attention(self.model)
        self.pool = KVPool(*shape, dtype, self.device, BLOCK_TOKENS, 256)
        unmirrored = lean.install(self.model, self.pool, config.vocab_size, self.device)
        print(f"{path}: {self.device}, {dtype}, {torch.get_num_threads()} torch thread(s), "
              f"lean forward: {unmirrored or 'on'}")

    def run(self, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)` on the model's thread; its result."""
        return self.thread.submit(work, *args).result()

    def forward(self, session: SessionKV, tokens: list[int], keep: int) -> torch.Tensor:
        """On the model's thread: feed `tokens`, the kept logits' argmax [keep]."""
        if not session.reserve(session.length + len(tokens)):
            raise RuntimeError("the KV pool is full")
        logits, _ = forwards.forward(self.model, [BatchRow(session, tokens, keep)], self.device)
        return logits.argmax(dim=-1)

    def propose(self, session: SessionKV, committed: list[int], gamma: int) -> list[int]:
        """On the model's thread: feed what `session` has not cached of `committed`, then
        draft `gamma` tokens greedily, one per forward (the last one is not fed)."""
        proposal = [int(self.forward(session, committed[session.length:], 1)[0])]
        while len(proposal) < gamma:
            proposal.append(int(self.forward(session, proposal[-1:], 1)[0]))
        return proposal


def target_only(target: Model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Greedy decoding by the target alone: the new tokens."""
    session = SessionKV(target.pool)
    out = [int(target.run(target.forward, session, prompt, 1)[0])]
    while len(out) < max_new and out[-1] not in eos:
        out.append(int(target.run(target.forward, session, [out[-1]], 1)[0]))
    return out


def speculative(target: Model, draft: Model, gamma: int, prompt: list[int], max_new: int,
                eos: set[int]) -> tuple[list[int], int]:
    """Greedy speculative decoding with a fixed γ: the new tokens, and the steps taken
    after the prompt's forward."""
    verified, drafted = SessionKV(target.pool), SessionKV(draft.pool)
    out = [int(target.run(target.forward, verified, prompt, 1)[0])]
    committed = prompt + out
    steps = 0
    while len(out) < max_new and out[-1] not in eos:
        proposal = draft.run(draft.propose, drafted, committed, gamma)
        argmax = target.run(target.forward, verified, [committed[-1], *proposal], gamma + 1).tolist()
        outcome = verify_greedy(proposal, argmax)
        new = proposal[:outcome.accepted] + [outcome.token]
        if any(token in eos for token in new):
            new = new[:next(i for i, token in enumerate(new) if token in eos) + 1]
        new = new[:max_new - len(out)]
        out += new
        committed += new
        steps += 1
        # Both caches keep only the committed positions (the newest is fed next step).
        verified.crop(len(committed) - 1)
        drafted.crop(len(committed) - 1)
    return out, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEMO_TARGET))
    parser.add_argument("--draft", default=str(DEMO_DRAFT))
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens a step (at least 1)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-threads", type=int, default=0, help="torch threads of the target (0: default)")
    parser.add_argument("--draft-threads", type=int, default=1, help="torch threads of the draft")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--workload", help="JSON file {task_type: [prompts]} (default: the demo workload)")
    args = parser.parse_args()
    if args.gamma < 1 or args.max_new_tokens < 2:
        parser.error("--gamma must be at least 1 and --max-new-tokens at least 2")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # The target first: torch's thread count is a process-wide setting that each thread
    # takes at its first parallel operator, so the draft's count set first would be the target's too.
    target = Model(args.target, args.target_threads, device, dtype)
    draft = Model(args.draft, args.draft_threads, device, dtype, packing.draft_layout(dtype))  # as a draft worker
    eos = set(eos_ids(target.model, tokenizer))
    workload = json.loads(Path(args.workload).read_text()) if args.workload else DEMO_WORKLOAD
    prompts = [tokenizer(p)["input_ids"] for ps in workload.values() for p in ps]
    target_only(target, prompts[0], 8, eos)  # warm-up, both ways
    speculative(target, draft, args.gamma, prompts[0], 8, eos)
    ratios = []
    for round_ in range(1, args.rounds + 1):
        seconds = {"target-only": 0.0, "speculative": 0.0}
        plain_tokens = fast_tokens = steps = same = 0
        for prompt in prompts:
            began = time.perf_counter()
            plain = target_only(target, prompt, args.max_new_tokens, eos)
            seconds["target-only"] += time.perf_counter() - began
            began = time.perf_counter()
            fast, taken = speculative(target, draft, args.gamma, prompt, args.max_new_tokens, eos)
            seconds["speculative"] += time.perf_counter() - began
            same += fast == plain
            plain_tokens, fast_tokens, steps = plain_tokens + len(plain), fast_tokens + len(fast), steps + taken
        plain_rate, fast_rate = plain_tokens / seconds["target-only"], fast_tokens / seconds["speculative"]
        ratios.append(fast_rate / plain_rate)
        # The prompt's forward gives each prompt its first token; the steps give the rest.
        per_step = (fast_tokens - len(prompts)) / max(steps, 1)
        print(f"round {round_}: target-only {plain_rate:.1f} tokens/s, fixed γ={args.gamma} {fast_rate:.1f} tokens/s "
              f"({ratios[-1]:.2f}×), {per_step:.2f} tokens a step, same output {same}/{len(prompts)}")
    print(f"fixed γ={args.gamma} ÷ target-only with the models alone, round by round: "
          f"{' '.join(f'{r:.2f}' for r in ratios)} (mean {statistics.fmean(ratios):.2f})")


if __name__ == "__main__":
    main()
