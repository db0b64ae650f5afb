"""AUTO against plain decoding from a cold start under load: the bar of gateway/priors.py.

    python scripts/coldstart_check.py [--rounds 4] [--pairs 1]

For each configuration, AUTO and OFF, a fresh `specd serve` on the demo pair with its
defaults: then rounds of 8 prompts none of its requests has seen, all 8 in flight at
once (the 8 demo code and prose prompts first, then pieces of specd's own source), 64
new tokens each, greedy. Prints tokens/s per round, AUTO ÷ OFF round by round and their
mean, whether the greedy outputs are equal, and AUTO's load caps afterwards (the prior
and the cap in force, from the gateway's metrics). With --pairs N it repeats that N
times, swapping which configuration runs first. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from specd.cli.bench import DEMO_WORKLOAD
from specd.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PORT, METRICS = 50081, 9481


def rounds_of_prompts(rounds: int) -> list[list[str]]:
    """The demo workload's first 8 prompts, then pieces of specd's source, 8 per round."""
    demo = [p for ps in DEMO_WORKLOAD.values() for p in ps][:8]
    code, piece = [], ""
    for path in sorted((ROOT / "gateway").glob("*.py")):
        for line in path.read_text().splitlines(keepends=True):
            piece += line
            if len(piece) > 700:
                code.append(piece)
                piece = ""
    return [demo] + [code[8 * i:8 * i + 8] for i in range(rounds - 1)]


def run_config(mode: str, prompts: list[list[str]], flags: list[str]) -> tuple[list[float], list[list[int]], str]:
    log = tempfile.NamedTemporaryFile("w+", prefix="specd-coldstart-", suffix=".log", delete=False)
    server = subprocess.Popen([str(Path(sys.executable).with_name("specd")), "serve", "--port", str(PORT),
                               "--metrics-port", str(METRICS), *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    channel = grpc.insecure_channel(f"127.0.0.1:{PORT}")
    try:
        grpc.channel_ready_future(channel).result(timeout=300)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        rates, outputs = [], []
        for round_prompts in prompts:
            def send(prompt: str) -> gateway_pb2.GenerateResponse:
                return stub.Generate(gateway_pb2.GenerateRequest(
                    prompt=prompt, sampling=gateway_pb2.SamplingParams(max_new_tokens=64),
                    speculation=gateway_pb2.SpeculationParams(mode=mode)), timeout=600)
            began = time.perf_counter()
            with ThreadPoolExecutor(len(round_prompts)) as pool:
                replies = list(pool.map(send, round_prompts))
            rates.append(sum(r.stats.generated_tokens for r in replies) / (time.perf_counter() - began))
            outputs += [list(r.token_ids) for r in replies]
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{METRICS}/metrics", timeout=30).read().decode()
        caps = "\n".join(line for line in metrics.splitlines()
                         if line.startswith(("specd_spec_decode_load_cap{", "specd_spec_decode_load_cap_prior{",
                                             "specd_spec_decode_load_cap_learned{")))
        return rates, outputs, caps
    finally:
        channel.close()
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("serve_flags", nargs="*", help="more `specd serve` flags for both (after --)")
    args = parser.parse_args()
    prompts = rounds_of_prompts(args.rounds)
    configs = {"AUTO": "SPECULATION_MODE_AUTO", "OFF": "SPECULATION_MODE_OFF"}
    for pair in range(args.pairs):
        order = list(configs) if pair % 2 == 0 else list(reversed(configs))
        results = {name: run_config(configs[name], prompts, args.serve_flags) for name in order}
        auto, off = results["AUTO"][0], results["OFF"][0]
        ratios = [a / o for a, o in zip(auto, off)]
        print(f"pair {pair + 1} ({' then '.join(order)}), 8 in flight, fresh servers:")
        print("  AUTO tokens/s " + " ".join(f"{r:6.1f}" for r in auto))
        print("  OFF  tokens/s " + " ".join(f"{r:6.1f}" for r in off))
        print("  AUTO ÷ OFF    " + " ".join(f"{r:6.2f}" for r in ratios) + f"   mean {statistics.fmean(ratios):.2f}")
        print(f"  greedy outputs equal: {results['AUTO'][1] == results['OFF'][1]}")
        print("  " + results["AUTO"][2].replace("\n", "\n  "))


if __name__ == "__main__":
    main()
