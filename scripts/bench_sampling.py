"""What the sampling parameters cost, side by side in one run: logprobs and a JSON schema
against the same requests without them, and speculation against none under the schema.

Against a running `specd serve` with no model-free proposers (the suffix cache learns
every output, which would help whichever configuration runs second on a prompt):

    .venv/bin/specd serve --model-free "" &
    .venv/bin/python scripts/bench_sampling.py [--baseline 127.0.0.1:50061]

Each round runs every configuration over the demo workload's prompts, greedy, one
request at a time (--in-flight for more), in turn, so the machine's drift hits all
alike; the script prints tokens/s per configuration over all rounds and the ratios the
sampling bars ask for. `--baseline ADDRESS` adds the plain configuration against a
second server (say, the commit before a change, started from its own checkout on other
ports): "a request with no new parameter is as fast as before", measured in one run.
"""
from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd_cli.bench import DEMO_WORKLOAD

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "language", "lines"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "language": {"type": "string", "enum": ["python", "rust", "go", "c"]},
                         "lines": {"type": "integer", "minimum": 1, "maximum": 999}}}


def build(prompt: str, config: str, max_tokens: int, draft: str) -> gateway_pb2.GenerateRequest:
    off = config.endswith("OFF")
    mode = gateway_pb2.SPECULATION_MODE_OFF if off else gateway_pb2.SPECULATION_MODE_AUTO
    request = gateway_pb2.GenerateRequest(
        prompt=prompt, sampling=gateway_pb2.SamplingParams(max_new_tokens=max_tokens),
        speculation=gateway_pb2.SpeculationParams(mode=mode, draft_model="" if off else draft))
    if config.startswith("logprobs"):
        request.sampling.logprobs = 5
    if config.startswith("schema"):
        request.sampling.structured.json_schema = json.dumps(SCHEMA)
    return request


def run(stub, requests: list[gateway_pb2.GenerateRequest], in_flight: int) -> tuple[int, float]:
    began = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        tokens = sum(pool.map(lambda r: stub.Generate(r, timeout=600).stats.generated_tokens, requests))
    return tokens, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="127.0.0.1:50051")
    parser.add_argument("--baseline", default="", metavar="ADDRESS", help="a second gateway for 'plain'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = [p for ps in DEMO_WORKLOAD.values() for p in ps]
    stubs = {"": gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(args.gateway))}
    if args.baseline:
        stubs["baseline"] = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(args.baseline))
    draft = stubs[""].GetGatewayInfo(gateway_pb2.GatewayInfoRequest()).drafts[0].name
    configs = ["plain AUTO", "logprobs=5 AUTO", "schema OFF", "schema AUTO"]
    if args.baseline:
        configs.insert(1, "plain AUTO @baseline")
    for config in configs:  # warm-up: each server's first requests load and trace
        stub = stubs["baseline" if "@" in config else ""]
        run(stub, [build(p, config, 8, draft) for p in prompts[:2]], 1)
    totals = {config: [0, 0.0] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            stub = stubs["baseline" if "@" in config else ""]
            tokens, seconds = run(stub, [build(p, config, args.max_tokens, draft) for p in prompts], args.in_flight)
            totals[config][0] += tokens
            totals[config][1] += seconds
    rate = {config: tokens / seconds for config, (tokens, seconds) in totals.items()}
    print(f"demo workload, {len(prompts)} prompts × {args.rounds} rounds, {args.in_flight} in flight, "
          f"greedy, {args.max_tokens} tokens at most, draft {draft}")
    for config in configs:
        print(f"  {config:<24} {rate[config]:7.1f} tokens/s  ({totals[config][0]} tokens)")
    print(f"logprobs=5 ÷ plain, AUTO:   {rate['logprobs=5 AUTO'] / rate['plain AUTO']:.3f}")
    print(f"schema: AUTO ÷ OFF:         {rate['schema AUTO'] / rate['schema OFF']:.3f}")
    if args.baseline:
        print(f"plain: this ÷ baseline:     {rate['plain AUTO'] / rate['plain AUTO @baseline']:.3f}")


if __name__ == "__main__":
    main()
