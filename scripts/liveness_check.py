"""Freeze the verifier of a fresh `specd serve` (SIGSTOP) and watch the gateway's health.

    python scripts/liveness_check.py [--port 50051] [--freeze 15]

Polls, every 0.5 s, the health name the gateway's Kubernetes liveness and startup probes
ask (`specd.liveness`) and the one readiness follows (""), through the freeze and 5 s
after the verifier resumes. The bar (issue #59): the liveness name never leaves SERVING.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.grpcserver import LIVENESS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--freeze", type=float, default=15.0, help="seconds the verifier is stopped")
    args = parser.parse_args()
    serve = subprocess.Popen([str(Path(sys.executable).with_name("specd")), "serve", "--port", str(args.port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    verifier = None
    assert serve.stdout is not None
    for line in serve.stdout:
        if "verifier running as pid" in line:
            verifier = int(line.split("pid")[1].split()[0])
        if "ready on" in line:
            break
    assert verifier is not None, "serve never said which pid the verifier has"
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{args.port}"))

    def status(name: str) -> str:
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            return err.code().name

    seen: dict[str, set[str]] = {LIVENESS: set(), "": set()}
    os.kill(verifier, signal.SIGSTOP)
    end = time.monotonic() + args.freeze
    while time.monotonic() < end:
        for name in seen:
            seen[name].add(status(name))
        time.sleep(0.5)
    os.kill(verifier, signal.SIGCONT)
    time.sleep(5)
    after = {name or '""': status(name) for name in seen}
    during = ", ".join(f"{name or chr(34) * 2} {sorted(states)}" for name, states in seen.items())
    verdict = "ok" if seen[LIVENESS] == {"SERVING"} else "MISSED"
    print(f"during a {args.freeze:g} s freeze: {during}; 5 s after: {after}; bar: {LIVENESS} only SERVING: {verdict}")
    serve.send_signal(signal.SIGTERM)
    serve.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
