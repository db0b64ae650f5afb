"""The faults of docs/reliability.md, tried against `specd serve` with its defaults, and timed.

    python scripts/fault_check.py

Serves a near-free pair (runs/tiny-target, made by scripts/make_tiny_target.py, as both
target and draft) with a two-tenant API key file, then, one after the other: freezes
the draft (SIGSTOP) under 4 greedy AUTO requests, freezes the verifier, knocks on the
workers' sockets as another user (needs root), holds 70 long streams with one key while
the other key asks, and sends two bursts of 200 streams over 4 connections. Prints one
line per check with its figures; exits 1 if a check fails.
"""
from __future__ import annotations

import collections
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "runs" / "tiny-target"
KEYS = {"alpha": "alpha-fault-check-key", "beta": "beta-fault-check-key"}
PROMPTS = ["def fibonacci(n):", "class Cache:", "The gateway accepts", "Speculative decoding"]
failed: list[str] = []


def check(name: str, ok: bool, figures: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {figures}", flush=True)
    if not ok:
        failed.append(name)


def generate_request(prompt: str, new_tokens: int,
                     mode: gateway_pb2.SpeculationMode = gateway_pb2.SPECULATION_MODE_AUTO):
    return gateway_pb2.GenerateRequest(prompt=prompt, sampling=gateway_pb2.SamplingParams(max_new_tokens=new_tokens),
                                       speculation=gateway_pb2.SpeculationParams(mode=mode))


def key(tenant: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def serving(channel: grpc.Channel) -> bool:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def draft_frozen(stub, draft_pid: int) -> None:
    expected = {p: list(stub.Generate(generate_request(p, 200), metadata=key("alpha")).token_ids) for p in PROMPTS}
    started = threading.Barrier(len(PROMPTS) + 1)

    def one(prompt: str) -> list[int]:
        stream = stub.GenerateStream(generate_request(prompt, 200), metadata=key("alpha"), timeout=120)
        tokens = list(next(stream).token_ids)
        started.wait()
        return tokens + [t for chunk in stream for t in chunk.token_ids]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = {p: pool.submit(one, p) for p in PROMPTS}
        started.wait()
        os.kill(draft_pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        outputs = {p: f.result() for p, f in futures.items()}
    finished_s = time.monotonic() - frozen_at
    check("draft frozen: 4 AUTO requests in flight", outputs == expected and finished_s < 8,
          f"all finished {finished_s:.2f} s after the freeze, output unchanged: {outputs == expected}")
    began = time.monotonic()
    try:
        response = stub.Generate(generate_request(PROMPTS[0], 200), metadata=key("alpha"), timeout=5)
        check("draft frozen: a new request with a 5 s deadline", list(response.token_ids) == expected[PROMPTS[0]],
              f"served in {time.monotonic() - began:.2f} s")
    except grpc.RpcError as exc:
        check("draft frozen: a new request with a 5 s deadline", False, f"{exc.code().name}: {exc.details()}")
    finally:
        os.kill(draft_pid, signal.SIGCONT)


def verifier_frozen(stub, channel, verifier_pid: int) -> None:
    os.kill(verifier_pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        try:
            stub.Generate(generate_request(PROMPTS[1], 200), metadata=key("alpha"))
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
        unavailable_s = time.monotonic() - frozen_at
        check("verifier frozen: a request without a deadline", code == "UNAVAILABLE" and unavailable_s < 15,
              f"{code} after {unavailable_s:.2f} s")
        while serving(channel) and time.monotonic() - frozen_at < 30:
            time.sleep(0.1)
        health_s = time.monotonic() - frozen_at
        check("verifier frozen: the gateway's health", health_s < 15, f"not SERVING {health_s:.2f} s after the freeze")
    finally:
        os.kill(verifier_pid, signal.SIGCONT)
    thawed_at = time.monotonic()
    while time.monotonic() - thawed_at < 30:
        try:
            stub.Generate(generate_request(PROMPTS[1], 16), metadata=key("alpha"), timeout=10)
            break
        except grpc.RpcError:
            time.sleep(0.1)
    served_s = time.monotonic() - thawed_at
    check("verifier thawed: requests served again", served_s < 10, f"after {served_s:.2f} s")


def other_user(sockets: list[Path]) -> None:
    if os.getuid() != 0:
        check("workers from another local user", True, "skipped: switching users needs root")
        return
    outcomes = []
    for path in sockets:
        child = os.fork()
        if child == 0:
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.connect(str(path))
                code = 0
            except PermissionError:
                code = 13
            finally:
                os._exit(code)
        outcomes.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    check("workers from another local user (nobody)", outcomes == [13, 13],
          "connect to each worker socket: " + ", ".join("denied" if c == 13 else f"status {c}" for c in outcomes))


def two_tenants(stub) -> None:
    held = [stub.GenerateStream(generate_request("def fibonacci(n):", 900, gateway_pb2.SPECULATION_MODE_OFF),
                                metadata=key("alpha"), timeout=600) for _ in range(70)]
    admitted = refused = 0
    for stream in held:
        try:
            next(stream)
            admitted += 1
        except grpc.RpcError as exc:
            refused += exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    began = time.monotonic()
    try:
        stub.Generate(generate_request("x", 16), metadata=key("beta"), timeout=60)
        code = "OK"
    except grpc.RpcError as exc:
        code = exc.code().name
    check("one key holds 70 long streams, the other asks", code == "OK",
          f"alpha: {admitted} admitted, {refused} RESOURCE_EXHAUSTED; beta: {code} in "
          f"{time.monotonic() - began:.2f} s")
    for stream in held:
        stream.cancel()


def bursts(address: str) -> None:
    for n in range(2):
        channels = [grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
        stubs = [gateway_pb2_grpc.GatewayStub(c) for c in channels]
        calls = [stubs[i % 4].Generate.future(generate_request("def f():", 8), metadata=key(("alpha", "beta")[i % 2]),
                                              timeout=120) for i in range(200)]
        codes = collections.Counter(call.code().name for call in calls)
        for channel in channels:
            channel.close()
        check(f"burst {n + 1}: 200 streams over 4 connections", set(codes) <= {"OK", "RESOURCE_EXHAUSTED"},
              dict(codes).__repr__())


def main() -> int:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_target.py"), str(TINY)], check=True)
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("".join(f"{tenant} {value}\n" for tenant, value in KEYS.items()))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        serve = subprocess.Popen([sys.executable, "-m", "specd_cli", "serve", "--target", str(TINY),
                                  "--draft", f"tiny={TINY}", "--port", str(port), "--api-keys", str(keys)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        assert serve.stdout is not None
        for line in serve.stdout:
            lines.append(line)
            if "specd serve: ready" in line:
                break
        threading.Thread(target=lambda: [None for _ in serve.stdout], daemon=True).start()  # type: ignore[union-attr]
        text = "".join(lines)
        pids = {name: int(re.search(rf"{name} running as pid (\d+)", text).group(1))  # type: ignore[union-attr]
                for name in ("draft", "verifier")}
        sockets = [Path(p) for p in re.search(r"private sockets unix:(\S+), unix:(\S+)\)", text).groups()]  # type: ignore[union-attr]
        address = f"127.0.0.1:{port}"
        try:
            with grpc.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                draft_frozen(stub, pids["draft"])
                verifier_frozen(stub, channel, pids["verifier"])
                other_user(sockets)
                two_tenants(stub)
                bursts(address)
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    print(f"{len(failed)} check(s) failed" if failed else "every check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
