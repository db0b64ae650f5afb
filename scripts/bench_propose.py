"""What the worker's scheduler and the model thread's hand-offs add to a draft's γ-token
proposal, beside the proposal's own forwards.

    python scripts/bench_propose.py [--model models/demo/draft-distilled] [--draft-base TARGET] [--gamma 4]
        [--threads 1] [--draft-cpu-weights float16|as-loaded]

One session, greedy. Each round commits up to 3 of the last proposal's tokens and one of its
own, and proposes γ (`Drafter.propose`, as the draft service does). Each proposal is split
in two: its forwards, as the scheduler timed them (`Proposal.forward_ms`), and the rest of
its time in `propose` (bookkeeping, the queue, the hand-offs to the model's thread and back,
sampling after each forward).
Prints the median ms of the whole, of the forwards and of the rest; docs/performance.md
keeps the figures.

Why the split within each proposal, not two runs (one through the scheduler, one of the
forwards called directly): on a shared CPU a forward's time drifts by a factor of two
from one minute to the next, and two runs apart put that drift into their difference.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from draft_service.drafter import Drafter
from specd.config import DEMO_DRAFT
from specd.sampling import Transform
from specd.steps import DraftRequest
from specd.worker import hub
from specd.worker.settings import DRAFT_CPU_WEIGHTS

PROMPT = list(range(5, 60))


async def proposals(drafter: Drafter, gamma: int, rounds: int) -> list[tuple[float, float]]:
    """(ms in `propose`, ms of its forwards) per proposal of `gamma` tokens, the session
    growing by up to 4 committed tokens a round. Unranked, as the draft service runs an untraced
    greedy step."""
    request = DraftRequest(gamma, Transform())
    proposal = await drafter.propose("s", 0, PROMPT, request, ranked=False)
    position, times = len(PROMPT), []
    for _ in range(rounds):
        began = time.perf_counter()
        committed = [*proposal.tokens[:3], 7]
        proposal = await drafter.propose("s", position, committed, request, ranked=False)
        times.append(((time.perf_counter() - began) * 1e3, proposal.forward_ms))
        position += len(committed)
        if position > 400:  # start over before the context grows far
            position = len(PROMPT)
            proposal = await drafter.propose("s", 0, PROMPT, request, ranked=False)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_DRAFT))
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a draft worker on a CPU takes 1)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--draft-base", default=None,
                        help="the target a draft made by `specd distill` from the target alone shares weights with")
    parser.add_argument("--draft-cpu-weights", choices=DRAFT_CPU_WEIGHTS, default="float16",
                        help="the draft's large linear layers, as the draft worker's flag")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafter = Drafter(args.model, draft_base=hub.resolve(args.draft_base) if args.draft_base else None,
                      cpu_weights=args.draft_cpu_weights)
    times = asyncio.run(proposals(drafter, args.gamma, args.rounds))[20:]  # past the first rounds' warm-up
    asyncio.run(drafter.runner.close())
    whole = statistics.median(total for total, _ in times)
    forwards = statistics.median(forward for _, forward in times)
    rest = statistics.median(total - forward for total, forward in times)
    print(f"{args.model} ({args.draft_cpu_weights}), γ={args.gamma}, {args.threads} thread(s), "
          f"median ms per proposal: {whole:.2f}, "
          f"its forwards {forwards:.2f}, the rest {rest:.2f} ({rest / args.gamma:.3f} per token)")


if __name__ == "__main__":
    main()
