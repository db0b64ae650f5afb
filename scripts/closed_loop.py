"""Keep N requests in flight against a gateway for a while; print tokens/s and ms per step.

    python scripts/closed_loop.py --gateway 127.0.0.1:50051 [--in-flight 1] [--seconds 10]
        [--mode off|fixed|auto] [--draft-length 4] [--temperature 0] [--cpu-of PID,PID]

Each of N client threads sends its next unary Generate (48 new tokens, a prompt of its
own) as soon as the last one returned. What `specd bench` does with its workload and
reports, without them: for profiling a server (py-spy beside it) and for alternating two
servers run side by side, where noise between runs would hide a difference.

With --cpu-of (process ids on this machine: the gateway's, the workers'), it also prints
the CPU time each used per generated token over the same seconds, from /proc. On a
machine whose speed drifts, CPU per token moves less than tokens/s: it says which process
a change made cheaper even when the throughput of two runs cannot tell them apart.
"""
from __future__ import annotations

import argparse
import os
import threading
import time

import grpc

from specd.v1 import gateway_pb2, gateway_pb2_grpc

MODES = {"off": gateway_pb2.SPECULATION_MODE_OFF, "fixed": gateway_pb2.SPECULATION_MODE_FIXED,
         "auto": gateway_pb2.SPECULATION_MODE_AUTO}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--in-flight", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--mode", choices=MODES, default="off")
    parser.add_argument("--draft-length", type=int, default=4, help="γ with --mode fixed")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--cpu-of", default="", metavar="PID,PID", help="report CPU µs per token of these processes")
    args = parser.parse_args()
    pids = [int(pid) for pid in args.cpu_of.split(",") if pid]
    stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(args.gateway))
    end = time.monotonic() + args.seconds
    totals = {"tokens": 0, "steps": 0}
    lock = threading.Lock()

    def client(index: int) -> None:
        sent = 0
        while time.monotonic() < end:
            response = stub.Generate(gateway_pb2.GenerateRequest(
                prompt=f"def handler_{index}_{sent}(request):\n    return",
                sampling=gateway_pb2.SamplingParams(max_new_tokens=48, seed=sent + 1, temperature=args.temperature),
                speculation=gateway_pb2.SpeculationParams(
                    mode=MODES[args.mode], draft_length=args.draft_length if args.mode == "fixed" else 0,
                    policy="fixed" if args.mode == "fixed" else "")))
            sent += 1
            with lock:
                totals["tokens"] += response.stats.generated_tokens
                totals["steps"] += response.stats.steps

    began, cpu_before = time.monotonic(), {pid: cpu_seconds(pid) for pid in pids}
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.in_flight)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    print(f"{args.in_flight} in flight, {args.mode}: {totals['tokens'] / elapsed:.1f} tokens/s, "
          f"{1e3 * elapsed * args.in_flight / max(1, totals['steps']):.2f} ms per step of a request")
    for pid in pids:
        used = cpu_seconds(pid) - cpu_before[pid]
        print(f"  pid {pid} ({process_name(pid)}): {1e6 * used / max(1, totals['tokens']):.1f} µs of CPU per token, "
              f"{100 * used / elapsed:.0f}% of a core")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used, from /proc/PID/stat (Linux)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def process_name(pid: int) -> str:
    """A short name: the specd role (`gateway`, `verifier`, `draft`) when it is one."""
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        words = cmdline.read().decode(errors="replace").split("\0")
    return next((word for word in words if word in ("gateway", "verifier", "draft", "serve")), words[0])


if __name__ == "__main__":
    main()
