#!/usr/bin/env python3
"""What tracing costs: the same requests against a stack with tracing off and one with it on.

Both stacks (draft, verifier, gateway: three processes each) run at once; requests
alternate between them, in an order that flips every round, so the machine's noise
falls on both alike. The traced stack exports every span over OTLP/gRPC to
`specd trace collect`'s receiver, running in this process on loopback, exactly as a
deployment would export to a collector. Greedy requests with a fixed γ: both stacks
do identical work, which the script checks.

    python scripts/bench_tracing.py                      # the demo pair
    python scripts/bench_tracing.py --target DIR --draft DIR
    python scripts/bench_tracing.py --random-pair        # random weights, demo shapes
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from specd.config import DEMO_DRAFT, DEMO_TARGET  # noqa: E402
from specd.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from specd_cli.serve import wait_healthy  # noqa: E402
from specd_cli.supervisor import stop_all  # noqa: E402
from specd_cli.trace import load_spans, start_collector  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef read_config(path):",
    "class LRUCache:\n    def __init__(self, capacity):",
    "The garbage collector",
    "for line in open(",
    "Exceptions are raised when",
]


def random_pair(directory: Path) -> tuple[Path, Path]:
    """A target and a draft with random weights and the demo pair's shapes and vocabulary.

    Acceptance is low with random weights, so each token costs more steps, hence more
    spans, than with a trained pair: the overhead measured is an upper bound.
    """
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO / "scripts"))
    from make_demo_pair import DRAFT_SHAPE, TARGET_SHAPE, VOCAB_SIZE

    # Some of this interpreter's own library as a corpus: enough text for the vocabulary.
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((p.read_text(errors="ignore") for p in sources),
                            trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<eos>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    dirs = []
    for seed, (name, shape) in enumerate((("target", TARGET_SHAPE), ("draft", DRAFT_SHAPE))):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=1024,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **shape)
        path = directory / name
        LlamaForCausalLM(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs.append(path)
    return dirs[0], dirs[1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_stack(target: Path, draft: Path, env: dict[str, str], threads: int) -> tuple[str, list[subprocess.Popen]]:
    """Draft, verifier and gateway processes; returns the gateway's address and the processes."""
    me = [sys.executable, "-m", "specd_cli"]
    draft_port, verifier_port, gateway_port = _free_port(), _free_port(), _free_port()
    common = ["--threads", str(threads), "--grace", "5"]
    procs = [
        subprocess.Popen(me + ["draft", "--port", str(draft_port), "--draft", str(draft), *common],
                         env=env, cwd=REPO),
        subprocess.Popen(me + ["verifier", "--port", str(verifier_port), "--target", str(target), *common],
                         env=env, cwd=REPO),
        subprocess.Popen(me + ["gateway", "--port", str(gateway_port), "--grace", "5",
                               "--draft-address", f"127.0.0.1:{draft_port}",
                               "--verifier-address", f"127.0.0.1:{verifier_port}"], env=env, cwd=REPO),
    ]
    return f"127.0.0.1:{gateway_port}", procs


def generate(stub, prompt: str, max_new_tokens: int, draft_length: int) -> tuple[list[int], float]:
    request = gateway_pb2.GenerateRequest(
        prompt=prompt,
        sampling=gateway_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
        speculation=gateway_pb2.SpeculationParams(mode=gateway_pb2.SPECULATION_MODE_FIXED,
                                                  draft_length=draft_length))
    began = time.perf_counter()
    response = stub.Generate(request, timeout=300)
    return list(response.token_ids), time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT)
    parser.add_argument("--random-pair", action="store_true",
                        help="random-weight models of the demo shapes (when no trained pair exists)")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the prompts")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-length", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="specd-bench-tracing-") as tmp_name:
        tmp = Path(tmp_name)
        target, draft = random_pair(tmp) if args.random_pair else (args.target, args.draft)
        for path in (target, draft):
            if not (path / "config.json").is_file():
                print(f"no model at {path}: pass --target/--draft, make the demo pair, or use --random-pair",
                      file=sys.stderr)
                return 2
        spans_file = tmp / "spans.jsonl"
        collector, port = start_collector(spans_file)
        plain = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        traced = {**plain, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}
        stacks = {"tracing off": start_stack(target, draft, plain, args.threads),
                  "tracing on": start_stack(target, draft, traced, args.threads)}
        procs = [p for _, ps in stacks.values() for p in ps]
        try:
            for address, ps in stacks.values():
                if not wait_healthy(address, ps, timeout_s=300):
                    print("a stack did not start; see the messages above", file=sys.stderr)
                    return 1
            channels = {name: grpc.insecure_channel(address) for name, (address, _) in stacks.items()}
            stubs = {name: gateway_pb2_grpc.GatewayStub(ch) for name, ch in channels.items()}
            for stub in stubs.values():  # warm-up: first forwards, first stream set-up
                generate(stub, PROMPTS[0], 8, args.draft_length)
            tokens = {name: 0 for name in stubs}
            seconds: dict[str, list[float]] = {name: [] for name in stubs}
            order = list(stubs)
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    outputs = {}
                    for name in order:
                        outputs[name], elapsed = generate(stubs[name], prompt, args.max_new_tokens,
                                                          args.draft_length)
                        tokens[name] += len(outputs[name])
                        seconds[name].append(elapsed)
                    assert len({tuple(o) for o in outputs.values()}) == 1, "the stacks generated differently"
                    order.reverse()
            for channel in channels.values():
                channel.close()
        finally:
            stop_all(procs, grace_s=20)  # SIGTERM: the traced stack flushes its spans
            collector.stop(grace=2).wait()

        spans = load_spans(spans_file)
        requests = len(PROMPTS) * args.rounds
        print(f"\n{requests} greedy requests per stack, {args.max_new_tokens} new tokens, γ = "
              f"{args.draft_length}, target {target.name}, draft {draft.name}\n")
        print(f"{'':<12} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'median ms/request':>18}")
        rate = {}
        for name in stubs:
            rate[name] = tokens[name] / sum(seconds[name])
            print(f"{name:<12} {tokens[name]:>7} {sum(seconds[name]):>8.2f} {rate[name]:>9.1f} "
                  f"{statistics.median(seconds[name]) * 1e3:>18.1f}")
        print(f"\nthroughput with tracing on / off: {rate['tracing on'] / rate['tracing off']:.3f}x")
        steps = sum(1 for s in spans if s["name"] == "specd.step")
        print(f"spans exported: {len(spans)} ({len(spans) / (requests + 1):.1f} per request, "
              f"{steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
