"""The HTTP edge's bars, measured against a real `specd serve` on the demo pair.

    python scripts/edge_check.py [--http-port 8000] [--port 50051]

`specd serve` runs with its file limit at 512 (its children inherit it). In turn:
- a 4-token gRPC request's and `/health`'s median latency, quiet, then while three
  client processes loop 1 MiB chat bodies of 34,000 messages;
- 600 sockets that never send a byte: how long until gRPC and `/health` answer, how many
  of the sockets the server closed within 40 s, and how much the log grew;
- SIGTERM to serve with six long streams in flight: how each stream ended.
Each figure is printed beside its bar (issue #52).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc

from specd.v1 import gateway_pb2, gateway_pb2_grpc

PROMPT = "def fibonacci(n):"


def generate_ms(stub: gateway_pb2_grpc.GatewayStub) -> float:
    began = time.perf_counter()
    stub.Generate(gateway_pb2.GenerateRequest(
        prompt=PROMPT, sampling=gateway_pb2.SamplingParams(max_new_tokens=4)), timeout=60)
    return (time.perf_counter() - began) * 1000


def health_ms(http_port: int) -> float:
    began = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=60) as response:
        response.read()
    return (time.perf_counter() - began) * 1000


def medians(stub, http_port: int, n: int = 30) -> tuple[float, float]:
    grpc_ms, http_ms = [], []
    for _ in range(n):
        grpc_ms.append(generate_ms(stub))
        http_ms.append(health_ms(http_port))
        time.sleep(0.05)
    return statistics.median(grpc_ms), statistics.median(http_ms)


def flood(http_port: int, stop: multiprocessing.synchronize.Event) -> None:
    body = json.dumps({"model": "target", "messages": [{"role": "user", "content": ""}] * 34_000},
                      separators=(",", ":")).encode()
    while not stop.is_set():
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).read()
        except urllib.error.HTTPError as exc:
            exc.read()
        except OSError:
            time.sleep(0.1)


def stream_ending(http_port: int, i: int, endings: list[str]) -> None:
    body = json.dumps({"model": "target", "prompt": f"{PROMPT} # {i}", "max_tokens": 900, "temperature": 0,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    lines = []
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            lines = [raw[6:].decode().strip() for raw in response if raw.startswith(b"data: ")]
    except Exception as exc:
        endings.append(f"cut ({type(exc).__name__}: {exc})")
        return
    if lines[-1:] != ["[DONE]"]:
        endings.append("no [DONE]")
    elif "error" in json.loads(lines[-2]):
        endings.append("error event + [DONE]")
    else:
        endings.append("whole + [DONE]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=8000)
    args = parser.parse_args()
    log_path = Path(tempfile.mkdtemp(prefix="specd-edge-")) / "serve.log"
    log = open(log_path, "wb")
    serve = subprocess.Popen(
        [str(Path(sys.executable).with_name("specd")), "serve", "--port", str(args.port), "--http-port",
         str(args.http_port)], stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512)))
    channel = grpc.insecure_channel(f"127.0.0.1:{args.port}")
    grpc.channel_ready_future(channel).result(timeout=180)
    stub = gateway_pb2_grpc.GatewayStub(channel)
    for _ in range(240):
        try:
            health_ms(args.http_port)
            break
        except OSError:
            time.sleep(0.5)
    medians(stub, args.http_port, 5)  # warm-up
    quiet_grpc, quiet_http = medians(stub, args.http_port)
    stop = multiprocessing.Event()
    flooders = [multiprocessing.Process(target=flood, args=(args.http_port, stop)) for _ in range(3)]
    for process in flooders:
        process.start()
    time.sleep(3)
    flood_grpc, flood_http = medians(stub, args.http_port)
    stop.set()
    for process in flooders:
        process.join(60)
    bar = 3 * quiet_grpc + 50
    print(f"4-token gRPC median: quiet {quiet_grpc:.1f} ms, under the chat flood {flood_grpc:.1f} ms "
          f"(bar: under {bar:.1f}) {'ok' if flood_grpc < bar else 'MISSED'}")
    print(f"/health median: quiet {quiet_http:.1f} ms, under the chat flood {flood_http:.1f} ms "
          f"(bar: under 200) {'ok' if flood_http < 200 else 'MISSED'}")

    before = log_path.stat().st_size
    silent = [socket.create_connection(("127.0.0.1", args.http_port), timeout=5) for _ in range(600)]
    began = time.monotonic()
    generate_ms(stub)
    grpc_s = time.monotonic() - began
    http_s = None
    while http_s is None and time.monotonic() - began < 40:
        try:
            health_ms(args.http_port)
            http_s = time.monotonic() - began
        except OSError:
            time.sleep(0.2)
    closed = 0
    for sock in silent:
        sock.settimeout(max(0.01, 40 - (time.monotonic() - began)))
        try:
            closed += sock.recv(1) == b""
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
        sock.close()
    grown = (log_path.stat().st_size - before) / 1e6
    print(f"600 silent sockets: gRPC answered after {grpc_s:.1f} s, /health after "
          f"{'never' if http_s is None else f'{http_s:.1f} s'} (bar: 40 s); {closed} of 600 closed by the server "
          f"within 40 s; the log grew {grown:.3f} MB (bar: under 5)")

    endings: list[str] = []
    readers = [threading.Thread(target=stream_ending, args=(args.http_port, i, endings)) for i in range(6)]
    for reader in readers:
        reader.start()
    time.sleep(3)
    serve.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(120)
    serve.wait(60)
    print(f"SIGTERM with six long streams: {', '.join(sorted(endings))} (bar: each [DONE] or an error event); "
          f"serve exited with {serve.returncode}")
    channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
