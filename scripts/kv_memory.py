"""KV memory of many open sessions against the arithmetic, on the demo target (or --model).

    python scripts/kv_memory.py [--sessions 64] [--tokens 512]

Opens the sessions through the verifier's runtime (each scores a prompt of `tokens`
positions), then prints the bytes their KV storage holds, the arithmetic (layers × 2 ×
KV heads × head dim × tokens × bytes per element), and the process's RSS growth.
"""
from __future__ import annotations

import argparse
import asyncio
import resource

from specd.config import DEMO_TARGET
from specd.sampling import Transform
from specd.worker.settings import ModelSettings
from verifier_service.scorer import Scorer


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_TARGET))
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    scorer = Scorer(args.model, ModelSettings(max_sessions=args.sessions))
    runner = scorer.runner
    await scorer.score("warm-up", 0, [5] * 16, [], Transform())
    runner.end_session("warm-up")
    before = rss_mb()
    for i in range(args.sessions):
        # tokens - 1 committed plus one scored position: `tokens` cached positions each.
        await scorer.score(f"s{i}", 0, [(7 * i + j) % runner.info.vocab_size for j in range(args.tokens - 1)], [1],
                           Transform())
    held = runner.sessions.kv_bytes()
    arithmetic = args.sessions * args.tokens * runner.kv_bytes_per_token()
    print(f"{args.sessions} sessions × {args.tokens} tokens of {runner.info.name}: KV held {held / 2**20:.1f} MiB, "
          f"arithmetic {arithmetic / 2**20:.1f} MiB ({held / arithmetic:.3f}×); "
          f"RSS grew {rss_mb() - before:.1f} MiB "
          f"(peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    await runner.close()


if __name__ == "__main__":
    asyncio.run(main())
