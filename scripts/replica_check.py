"""A new gateway replica beside an old one: does it start from what the old one learned?

    python scripts/replica_check.py [--learn-rounds 12] [--rounds 6]

One verifier and one draft worker (the demo pair, prefix caching off), as on Kubernetes. Gateway A serves
--learn-rounds rounds of 8 unseen prompts at once in AUTO, learning its load caps and
sharing them through the verifier (every 2 s). Then two fresh gateways start against the
same workers: B shares (it takes A's levels at start-up), C does not (--share-load-caps 0,
it starts from the priors alone). B and C take turns (B, C, C, B, ...) on the same new
rounds. Prints each gateway's load caps with their origins, tokens/s round by round,
B ÷ C, and whether their greedy outputs are equal. Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from specd.config import DEMO_DRAFT, DEMO_TARGET

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coldstart_check import rounds_of_prompts, run_round  # noqa: E402

from specd.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VERIFIER, DRAFT, GATEWAY, METRICS = 50091, 50092, 50093, 9491
SPECD = str(Path(sys.executable).with_name("specd"))


def start(*args: str) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("w+", prefix="specd-replica-", suffix=".log", delete=False)
    return subprocess.Popen([SPECD, *args], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


class Gateway:
    def __init__(self, index: int, share_s: str) -> None:
        self.port, self.metrics = GATEWAY + 10 * index, METRICS + index
        self.process = start("gateway", "--port", str(self.port), "--metrics-port", str(self.metrics),
                             "--verifier-address", f"127.0.0.1:{VERIFIER}", "--draft-address",
                             f"127.0.0.1:{DRAFT}", "--share-load-caps", share_s)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        grpc.channel_ready_future(self.channel).result(timeout=300)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def round(self, prompts: list[str]) -> tuple[float, list[list[int]]]:
        return run_round(self.stub, "SPECULATION_MODE_AUTO", prompts)

    def caps(self) -> str:
        """load: cap (origin) at each level, from GetGatewayInfo (what `specd doctor` prints)."""
        rows = self.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest()).load_caps
        return ", ".join(f"{row.load}: γ≤{row.cap} ({row.origin})" for row in rows)

    def shared_gauges(self) -> str:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=30).read().decode()
        return " ".join(line.split("{")[1].split("}")[0].split(",")[1] for line in text.splitlines()
                        if line.startswith("specd_spec_decode_load_cap_shared{") and line.endswith(" 1.0"))

    def stop(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learn-rounds", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    prompts = rounds_of_prompts(1 + args.learn_rounds + args.rounds)[1:]  # code pieces only
    learn, fresh = prompts[:args.learn_rounds], prompts[args.learn_rounds:]
    # No prefix caching: B and C send the same prompts to the same workers, and whichever
    # went second would find the first one's blocks cached.
    workers = [start("verifier", "--port", str(VERIFIER), "--target", str(DEMO_TARGET), "--no-prefix-caching"),
               start("draft", "--port", str(DRAFT), "--draft", str(DEMO_DRAFT), "--no-prefix-caching")]
    gateways: list[Gateway] = []
    try:
        old = Gateway(0, "2")
        gateways.append(old)
        rates = [old.round(p)[0] for p in learn]
        print(f"gateway A, {args.learn_rounds} rounds AUTO, tokens/s: " + " ".join(f"{r:.0f}" for r in rates))
        print(f"  caps: {old.caps()}")
        time.sleep(3)  # a sharing round after the last trial
        shared, alone = Gateway(1, "2"), Gateway(2, "0")
        gateways += [shared, alone]
        print(f"gateway B (shares) at start: {shared.caps()}")
        print(f"gateway C (does not) at start: {alone.caps()}")
        results: dict[str, tuple[list[float], list[list[int]]]] = {"B": ([], []), "C": ([], [])}
        for index, round_prompts in enumerate(fresh):
            order = [("B", shared), ("C", alone)] if index % 2 == 0 else [("C", alone), ("B", shared)]
            for name, gateway in order:
                rate, outputs = gateway.round(round_prompts)
                results[name][0].append(rate)
                results[name][1].extend(outputs)
        ratios = [b / c for b, c in zip(results["B"][0], results["C"][0])]
        print("  B tokens/s " + " ".join(f"{r:6.1f}" for r in results["B"][0]))
        print("  C tokens/s " + " ".join(f"{r:6.1f}" for r in results["C"][0]))
        print("  B ÷ C      " + " ".join(f"{r:6.2f}" for r in ratios) + f"   mean {statistics.fmean(ratios):.2f}")
        print(f"  greedy outputs equal: {results['B'][1] == results['C'][1]}")
        print(f"  B after: {shared.caps()}; loads still at the shared cap: {shared.shared_gauges() or 'none'}")
        print(f"  C after: {alone.caps()}")
    finally:
        for gateway in gateways:
            gateway.stop()
        for worker in workers:
            worker.terminate()
            worker.wait(60)


if __name__ == "__main__":
    main()
