"""What a sampled step costs against a greedy one, with a large vocabulary, side by side.

    python scripts/bench_sampled.py --make runs/wide-vocab       # once: the pair
    specd serve --target runs/wide-vocab/target --draft runs/wide-vocab/draft --port 50082 &
    python scripts/bench_sampled.py --gateway 127.0.0.1:50082

The pair: two near-free random models (2 layers × 128) with a vocabulary of 131,072
tokens (the demo tokenizer plus added tokens). They disagree, so a sampled γ=4 step
usually ends in a rejection, the case that ships a row of p. For target-only and fixed
γ=4, greedy and T = 1 (no top-k/top-p) run in turn over the same prompts; it prints ms
per step (the gateway's total_ms / steps) and the sampled ÷ greedy ratio.
docs/performance.md keeps the figures.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

VOCAB = 131_072
PROMPTS = ["def read_config(path):", "The return value of the function is", "class Counter:",
           "import os\nimport sys\n", "This module provides a simple way to", "    for line in lines:"]


def make(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specd.config import DEMO_TARGET

    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(VOCAB - len(tokenizer))])
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    for seed, name in enumerate(("target", "draft")):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)


def measure(gateway: str, rounds: int, new_tokens: int) -> None:
    import grpc

    from specd.v1 import gateway_pb2, gateway_pb2_grpc

    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gateway))
    configs = {"target-only": (gateway_pb2.SPECULATION_MODE_OFF, 0),
               "fixed γ=4": (gateway_pb2.SPECULATION_MODE_FIXED, 4)}
    per_step: dict[tuple[str, float], list[float]] = {}
    for r in range(rounds):
        for prompt in PROMPTS:
            for label, (mode, gamma) in configs.items():
                for temperature in (0.0, 1.0):
                    response = stub.Generate(gateway_pb2.GenerateRequest(
                        prompt=prompt, sampling=gateway_pb2.SamplingParams(
                            temperature=temperature, seed=r + 1, max_new_tokens=new_tokens),
                        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_length=gamma, policy="fixed")))
                    stats = response.stats
                    per_step.setdefault((label, temperature), []).append(stats.total_ms / stats.steps)
    print(f"vocabulary {VOCAB:,}, {new_tokens} new tokens, {rounds} rounds × {len(PROMPTS)} prompts "
          f"(median ms per step)")
    print(f"{'configuration':14} {'greedy':>8} {'T = 1':>8} {'sampled ÷ greedy':>17}")
    for label in configs:
        greedy = statistics.median(per_step[(label, 0.0)])
        sampled = statistics.median(per_step[(label, 1.0)])
        print(f"{label:14} {greedy:8.2f} {sampled:8.2f} {sampled / greedy:17.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--make", type=Path, metavar="DIR", help="write the pair to DIR/target, DIR/draft and exit")
    parser.add_argument("--gateway", default="127.0.0.1:50082", metavar="HOST:PORT")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    if args.make:
        make(args.make)
    else:
        measure(args.gateway, args.rounds, args.max_new_tokens)


if __name__ == "__main__":
    main()
