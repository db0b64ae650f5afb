"""AUTO against plain decoding from a cold start under load: the bar of gateway/policy/priors.py.

    python scripts/coldstart_check.py [--rounds 4] [--pairs 1] [--alternate]

For each configuration, AUTO and OFF, a fresh `specd serve` on the demo pair with its
defaults: then rounds of 8 prompts none of its requests has seen, all 8 in flight at
once (the 8 demo code and prose prompts first, then pieces of specd's own source), 64
new tokens each, greedy. Prints tokens/s per round, AUTO ÷ OFF round by round and their
mean, whether the greedy outputs are equal, and AUTO's load caps afterwards (the prior
and the cap in force, from the gateway's metrics). With --pairs N it repeats that N
times, swapping which configuration runs first. With --alternate both servers run side
by side and their rounds take turns, so that a long run's drift in the machine's speed
falls on both alike. Run it on a quiet machine.
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

from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd_cli.bench import DEMO_WORKLOAD

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


def run_round(stub: gateway_pb2_grpc.GatewayStub, mode: str, prompts: list[str]) -> tuple[float, list[list[int]]]:
    """All of `prompts` in flight at once, 64 greedy tokens each: tokens/s over the round,
    and each output."""
    def send(prompt: str) -> gateway_pb2.GenerateResponse:
        return stub.Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, sampling=gateway_pb2.SamplingParams(max_new_tokens=64),
            speculation=gateway_pb2.SpeculationParams(mode=mode)), timeout=600)
    began = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(send, prompts))
    return (sum(r.stats.generated_tokens for r in replies) / (time.perf_counter() - began),
            [list(r.token_ids) for r in replies])


class Server:
    """A fresh `specd serve` on the demo pair, its gateway on `port`, its metrics on `metrics`."""

    def __init__(self, port: int, metrics: int, flags: list[str]) -> None:
        self.metrics = metrics
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specd-coldstart-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("specd")), "serve", "--port", str(port), "--metrics-port",
             str(metrics), *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=300)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def round(self, mode: str, prompts: list[str]) -> tuple[float, list[list[int]]]:
        return run_round(self.stub, mode, prompts)

    def caps(self) -> str:
        """The load cap lines of the gateway's metrics."""
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=30).read().decode()
        return "\n".join(line for line in metrics.splitlines()
                         if line.startswith(("specd_spec_decode_load_cap{", "specd_spec_decode_load_cap_prior{",
                                             "specd_spec_decode_load_cap_learned{")))

    def stop(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(60)


CONFIGS = {"AUTO": "SPECULATION_MODE_AUTO", "OFF": "SPECULATION_MODE_OFF"}


def run_config(mode: str, prompts: list[list[str]], flags: list[str]) -> tuple[list[float], list[list[int]], str]:
    """Every round on one fresh server, one configuration alone on the machine."""
    server = Server(PORT, METRICS, flags)
    try:
        rates, outputs = [], []
        for round_prompts in prompts:
            rate, output = server.round(mode, round_prompts)
            rates.append(rate)
            outputs += output
        return rates, outputs, server.caps()
    finally:
        server.stop()


def run_alternated(prompts: list[list[str]], flags: list[str]) -> dict[str, tuple[list[float], list[list[int]], str]]:
    """Both configurations on fresh servers side by side, their rounds taking turns (AUTO,
    OFF, OFF, AUTO, ...): the machine's drift over a long run falls on both alike. The idle
    server's workers wait on their streams, costing the other next to nothing."""
    servers = {name: Server(PORT + i, METRICS + i, flags) for i, name in enumerate(CONFIGS)}
    try:
        rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
        outputs: dict[str, list[list[int]]] = {name: [] for name in CONFIGS}
        for index, round_prompts in enumerate(prompts):
            for name in (list(CONFIGS) if index % 2 == 0 else list(reversed(CONFIGS))):
                rate, output = servers[name].round(CONFIGS[name], round_prompts)
                rates[name].append(rate)
                outputs[name] += output
        return {name: (rates[name], outputs[name], servers[name].caps()) for name in CONFIGS}
    finally:
        for server in servers.values():
            server.stop()


def report(title: str, results: dict[str, tuple[list[float], list[list[int]], str]]) -> None:
    auto, off = results["AUTO"][0], results["OFF"][0]
    ratios = [a / o for a, o in zip(auto, off)]
    print(title)
    print("  AUTO tokens/s " + " ".join(f"{r:6.1f}" for r in auto))
    print("  OFF  tokens/s " + " ".join(f"{r:6.1f}" for r in off))
    print("  AUTO ÷ OFF    " + " ".join(f"{r:6.2f}" for r in ratios) + f"   mean {statistics.fmean(ratios):.2f}")
    if len(ratios) >= 8:
        half = len(ratios) // 2
        print(f"  mean of the first {half} rounds {statistics.fmean(ratios[:half]):.2f}, "
              f"of the last {len(ratios) - half} {statistics.fmean(ratios[half:]):.2f}")
    print(f"  greedy outputs equal: {results['AUTO'][1] == results['OFF'][1]}")
    print("  " + results["AUTO"][2].replace("\n", "\n  "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--alternate", action="store_true",
                        help="run AUTO's and OFF's servers side by side, their rounds taking turns (for long runs)")
    parser.add_argument("serve_flags", nargs="*", help="more `specd serve` flags for both (after --)")
    args = parser.parse_args()
    prompts = rounds_of_prompts(args.rounds)
    for pair in range(args.pairs):
        if args.alternate:
            report(f"pair {pair + 1}, rounds alternated (AUTO, OFF, OFF, AUTO, ...), 8 in flight, fresh servers:",
                   run_alternated(prompts, args.serve_flags))
            continue
        order = list(CONFIGS) if pair % 2 == 0 else list(reversed(CONFIGS))
        results = {name: run_config(CONFIGS[name], prompts, args.serve_flags) for name in order}
        report(f"pair {pair + 1} ({' then '.join(order)}), 8 in flight, fresh servers:", results)


if __name__ == "__main__":
    main()
