"""The verifier's own cost per step without gRPC: its multiplexed stream's step path in one process.

    python scripts/bench_verifier_step.py [--model runs/tiny-target] [--sessions 32] [--rounds 60]

Calls the verifier servicer's `Verify` as gRPC would, with the messages a gateway's stream
would send: one `VerifySteps` message carrying a plain greedy step of every session, each
asking the verifier to run ahead for the rest (`run_ahead_steps`, as the gateway asks for
plain decoding); a round ends when every session has had its next answer. Prints the
median wall time of a round and CPU time per step (every thread of this process: the
event loop, the model's thread).

Set beside what `closed_loop.py --cpu-of` reports for a `specd serve` verifier at the same
number of sessions, the difference is what the transport and the processes' hand-offs
cost (docs/performance.md). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

import grpc
import torch

from specd.v1 import worker_pb2
from specd.worker.runtime import event_loop_single_threaded
from verifier_service.scorer import Scorer
from verifier_service.server import VerifierServicer

WARM_UP_ROUNDS = 5
PROMPT_TOKENS = 100


async def run(servicer: VerifierServicer, sessions: int, rounds: int) -> tuple[float, float]:
    """Median ms a round and µs of CPU a step over `rounds` rounds of every session's step."""
    inbox: asyncio.Queue[worker_pb2.VerifySteps | None] = asyncio.Queue()

    async def messages() -> AsyncIterator[worker_pb2.VerifySteps]:
        while (message := await inbox.get()) is not None:
            yield message

    # The RPC reads nothing of its context: no gRPC server is needed to call it.
    results = servicer.Verify(messages(), cast(grpc.aio.ServicerContext, None))
    vocab = servicer.scorer.runner.info.vocab_size
    steps = WARM_UP_ROUNDS + rounds
    # One step a session, its prompt, which lets the verifier decode the rest unasked: the
    # answers take the step ids reserved after the step's own (the gateway's stream does this).
    message = worker_pb2.VerifySteps()
    session_of: dict[int, int] = {}  # step id, reserved ones too → session
    for i in range(sessions):
        first_id = 1 + i * (steps + 1)
        session_of.update(dict.fromkeys(range(first_id, first_id + steps + 1), i))
        request = message.steps.add(step_id=first_id).request
        request.delta.session_id = f"s{i}"
        request.delta.tokens.extend((5 + 7 * i + j) % vocab for j in range(PROMPT_TOKENS))
        request.run_ahead_steps = steps
    answered = [0] * sessions  # answers each session has had
    walls, cpus = [], []
    await inbox.put(message)
    for round_index in range(steps + 1):
        began, cpu = time.perf_counter(), time.process_time()
        while min(answered) <= round_index:
            for result in (await results.__anext__()).results:
                if result.HasField("status"):
                    raise SystemExit(f"a step failed: {result.status.message}")
                answered[session_of[result.step_id]] += 1
        if round_index > WARM_UP_ROUNDS:
            walls.append((time.perf_counter() - began) * 1e3)
            cpus.append((time.process_time() - cpu) * 1e6 / sessions)
    await inbox.put(None)
    await cast(AsyncGenerator, results).aclose()
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/tiny-target", help="the target (scripts/make_tiny_target.py)")
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: a small model in the verifier)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scorer = Scorer(args.model)
    event_loop_single_threaded()  # as a worker does once its models are loaded
    # Every session decodes all its rounds: a run ends at EOS, which would leave a round waiting.
    scorer.runner.info = dataclasses.replace(scorer.runner.info, eos_token_ids=())
    servicer = VerifierServicer(scorer)
    round_ms, step_us = asyncio.run(run(servicer, args.sessions, args.rounds))
    print(f"{args.model}, {args.sessions} sessions, {args.threads} torch thread(s): {round_ms:.2f} ms a round, "
          f"{step_us:.1f} µs of CPU a step")


if __name__ == "__main__":
    main()
