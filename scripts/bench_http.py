"""The same streamed requests over gRPC and over OpenAI-compatible HTTP, side by side.

Against a running `specd serve --http-port N` (or gateway), keeps --in-flight streams
open on each transport in turn (the official `openai` client for HTTP, GenerateStream
for gRPC), over the demo workload, greedy, and prints tokens/s per transport and their
ratio; --rounds alternates them so the machine's drift hits both alike.

    .venv/bin/specd serve --http-port 8000 --model-free "" &   # no suffix cache: both transports alike
    .venv/bin/python scripts/bench_http.py --grpc 127.0.0.1:50051 --http http://127.0.0.1:8000/v1
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai

from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd_cli.bench import DEMO_WORKLOAD


def over_grpc(stub, prompt: str, max_tokens: int) -> int:
    request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=gateway_pb2.SamplingParams(
        max_new_tokens=max_tokens))
    return sum(len(chunk.token_ids) for chunk in stub.GenerateStream(request))


def over_http(client: openai.OpenAI, model: str, prompt: str, max_tokens: int) -> int:
    tokens = 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens


def run(send, prompts: list[str], in_flight: int, requests: int) -> float:
    """tokens/s with `in_flight` requests kept open until `requests` are done."""
    began = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        tokens = sum(pool.map(send, [prompts[i % len(prompts)] for i in range(requests)]))
    return tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc", default="127.0.0.1:50051")
    parser.add_argument("--http", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32, help="per transport and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    prompts = [p for ps in DEMO_WORKLOAD.values() for p in ps]
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(args.grpc))
    client = openai.OpenAI(base_url=args.http, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    senders = {"gRPC": lambda p: over_grpc(stub, p, args.max_tokens),
               "HTTP": lambda p: over_http(client, model, p, args.max_tokens)}
    for send in senders.values():  # warm-up
        run(send, prompts, args.in_flight, args.in_flight)
    rates: dict[str, list[float]] = {name: [] for name in senders}
    for _ in range(args.rounds):
        for name, send in senders.items():
            rates[name].append(run(send, prompts, args.in_flight, args.requests))
    grpc_rate = sum(rates["gRPC"]) / args.rounds
    http_rate = sum(rates["HTTP"]) / args.rounds
    print(f"{args.in_flight} in flight, {args.requests} requests × {args.rounds} rounds, {args.max_tokens} tokens")
    for name, values in rates.items():
        print(f"  {name:<5} " + "  ".join(f"{v:7.1f}" for v in values) + " tokens/s")
    print(f"  HTTP ÷ gRPC: {http_rate / grpc_rate:.2f}")


if __name__ == "__main__":
    main()
