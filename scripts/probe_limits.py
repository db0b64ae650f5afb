"""How fast a running gateway refuses oversized requests (docs/reliability.md).

    python scripts/probe_limits.py --gateway 127.0.0.1:50051 [--api-key-env VAR]

Sends prompts of growing size and prints, for each, the status and the time to it.
Before the edge limits an 8 MiB prompt was tokenized for 14.9 s before its refusal.
"""
from __future__ import annotations

import argparse
import time

import grpc

from specd.v1 import gateway_pb2, gateway_pb2_grpc
from specd_cli.clientauth import with_api_key

SIZES = [8 * 1024 * 1024, 1000 * 1024, 256 * 1024 + 1, 256 * 1024]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="127.0.0.1:50051")
    parser.add_argument("--api-key-env", default="")
    args = parser.parse_args()
    with grpc.insecure_channel(args.gateway) as channel:
        stub = gateway_pb2_grpc.GatewayStub(with_api_key(channel, args.api_key_env))
        grpc.channel_ready_future(channel).result(timeout=120)
        for size in SIZES:
            request = gateway_pb2.GenerateRequest(prompt="a" * size,
                                                  sampling=gateway_pb2.SamplingParams(max_new_tokens=1))
            began = time.perf_counter()
            try:
                stub.Generate(request, timeout=120)
                outcome = "OK"
            except grpc.RpcError as exc:
                outcome = f"{exc.code().name}: {(exc.details() or '')[:80]}"
            print(f"{size:>9} bytes  {(time.perf_counter() - began) * 1e3:7.0f} ms  {outcome}", flush=True)


if __name__ == "__main__":
    main()
