"""A draft's proposal through the worker's scheduler against the same forwards alone:
what the scheduler and the model thread's hand-offs add to a γ-token proposal.

    python scripts/bench_propose.py [--model models/demo/draft-distilled] [--gamma 4] [--threads 1]

One session, greedy. Each round feeds 4 committed tokens and proposes γ (`ModelRunner.propose`,
as the draft service does), against γ forwards of the paged store called directly
(one of 4 tokens, then γ - 1 of one). Prints the median ms of each and the difference;
docs/performance.md keeps the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from specd.config import DEMO_DRAFT
from specd.sampling import Transform
from specd.steps import DraftRequest
from specd.worker import kvstore
from specd.worker.kvstore import BatchRow, SessionKV
from specd.worker.runtime import ModelRunner

PROMPT = list(range(5, 60))


async def through_scheduler(runner: ModelRunner, gamma: int, rounds: int) -> list[float]:
    """ms per proposal of `gamma` tokens, the session growing by 4 committed tokens a round."""
    proposal = await runner.propose("s", 0, PROMPT, DraftRequest(gamma, Transform()))
    position, times = len(PROMPT), []
    for _ in range(rounds):
        began = time.perf_counter()
        proposal = await runner.propose("s", position, [*proposal.tokens[:3], 7][:4], DraftRequest(gamma, Transform()))
        times.append((time.perf_counter() - began) * 1e3)
        position += 4
        if position > 400:  # start over before the context grows far
            position = len(PROMPT)
            proposal = await runner.propose("s", 0, PROMPT, DraftRequest(gamma, Transform()))
    return times


def forwards_alone(runner: ModelRunner, gamma: int, rounds: int) -> list[float]:
    """ms of the same forwards on the store with no scheduler: 4 tokens, then γ - 1 of one."""
    session = SessionKV(runner.pool)
    assert session.reserve(len(PROMPT) + 8 + gamma)
    kvstore.forward(runner.model, [BatchRow(session, PROMPT, 1)], runner.device)
    times = []
    for _ in range(rounds):
        session.crop(len(PROMPT))
        began = time.perf_counter()
        logits, _ = kvstore.forward(runner.model, [BatchRow(session, [5, 6, 7, 8], 1)], runner.device)
        for _ in range(gamma - 1):
            token = int(logits[-1].argmax())
            logits, _ = kvstore.forward(runner.model, [BatchRow(session, [token], 1)], runner.device)
        times.append((time.perf_counter() - began) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_DRAFT))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a draft worker on a CPU takes 1)")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(args.model)
    scheduled = asyncio.run(through_scheduler(runner, args.gamma, args.rounds))
    alone = forwards_alone(runner, args.gamma, args.rounds)
    asyncio.run(runner.close())
    through, direct = statistics.median(scheduled[20:]), statistics.median(alone[20:])
    print(f"{args.model}, γ={args.gamma}, {args.threads} thread(s), median ms per proposal: "
          f"through the scheduler {through:.2f}, the forwards alone {direct:.2f}, "
          f"the difference {through - direct:.2f} ({(through - direct) / args.gamma:.3f} per token)")


if __name__ == "__main__":
    main()
