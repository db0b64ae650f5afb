"""The sampling surface under attack: issue #67's bars, against a real `specd serve` on the demo pair.

    python scripts/surface_check.py [--http-port 8000] [--port 50051]

`specd serve` runs with API keys (two tenants) and `--chat-template models/demo/chat.jinja`.
Beside each attack, a 4-token gRPC request's and `/health`'s median latency, against their
quiet medians. In turn:
- one request with a 150-byte ambiguous grammar and max_tokens 300: how it ends, and when;
- three clients sending 40 bodies each with a 90,000-entry `logit_bias` (each refused):
  the gateway's RSS before and after;
- two clients looping a 200 KB JSON schema, the same one; then two clients sending a new
  200 KB schema each time;
- one tenant, salt "userX", completes a prompt in AUTO; salt "userY" of the same tenant,
  then another tenant, send the same prompt: their mean acceptance lengths.
Each figure is printed beside its bar.
"""
from __future__ import annotations

import argparse
import json
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

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | "ab" | "ba" | "aab"\n'


def post(http_port: int, path: str, body: dict | bytes, key: str = KEYS["alpha"],
         timeout: float = 120) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}{path}", data=data,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def generate_ms(stub: gateway_pb2_grpc.GatewayStub) -> float:
    began = time.perf_counter()
    stub.Generate(gateway_pb2.GenerateRequest(prompt="def fibonacci(n):",
                                              sampling=gateway_pb2.SamplingParams(max_new_tokens=4)),
                  metadata=(("authorization", f"Bearer {KEYS['beta']}"),), timeout=60)
    return (time.perf_counter() - began) * 1000


def health_ms(http_port: int) -> float:
    began = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=60) as response:
        response.read()
    return (time.perf_counter() - began) * 1000


def medians(stub, http_port: int, seconds: float | None = None, n: int = 30) -> tuple[float, float, float]:
    """Median 4-token and /health latencies (and the worst /health), n pairs or for `seconds`."""
    grpc_ms: list[float] = []
    http_ms: list[float] = []
    until = time.monotonic() + (seconds or 0.0)
    while time.monotonic() < until if seconds else len(grpc_ms) < n:
        grpc_ms.append(generate_ms(stub))
        http_ms.append(health_ms(http_port))
        time.sleep(0.05)
    return statistics.median(grpc_ms), statistics.median(http_ms), max(http_ms)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def gateway_pid(serve_pid: int) -> int:
    children = subprocess.run(["pgrep", "-P", str(serve_pid)], capture_output=True, text=True).stdout.split()
    for pid in children:
        if " gateway" in Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
            return int(pid)
    raise RuntimeError(f"no gateway among {children}")


def in_threads(count: int, target, *args) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i, *args)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def schema(salt: str) -> dict:
    """A JSON schema of about 200 KB: 3,000 string properties."""
    return {"type": "object", "properties": {f"{salt}field_number_{i}": {"type": "string", "maxLength": 20}
                                             for i in range(3000)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--http-port", type=int, default=8000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="specd-surface-"))
    (work / "keys").write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    log = open(work / "serve.log", "wb")
    serve = subprocess.Popen(
        [str(Path(sys.executable).with_name("specd")), "serve", "--port", str(args.port), "--http-port",
         str(args.http_port), "--api-keys", str(work / "keys"), "--chat-template", "models/demo/chat.jinja"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{args.port}")
        grpc.channel_ready_future(channel).result(timeout=180)
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(240):
            try:
                health_ms(args.http_port)
                break
            except OSError:
                time.sleep(0.5)
        medians(stub, args.http_port, n=5)  # warm-up
        quiet_grpc, quiet_http, _ = medians(stub, args.http_port)
        bar = 3 * quiet_grpc + 50
        print(f"quiet: 4-token gRPC median {quiet_grpc:.1f} ms, /health median {quiet_http:.1f} ms; "
              f"the bar beside each attack: 4-token median under {bar:.1f} ms, /health under 200 ms")

        def report(what: str, figures: tuple[float, float, float]) -> None:
            grpc_ms, http_ms, worst = figures
            print(f"  beside {what}: 4-token median {grpc_ms:.1f} ms {'ok' if grpc_ms < bar else 'MISSED'}, "
                  f"/health median {http_ms:.1f} ms (worst {worst:.1f}) {'ok' if http_ms < 200 else 'MISSED'}")

        # 1. The ambiguous grammar.
        ending: dict = {}

        def ambiguous(_: int) -> None:
            began = time.perf_counter()
            ending["status"], ending["body"] = post(args.http_port, "/v1/completions", {
                "model": "target", "prompt": "ab", "max_tokens": 300, "temperature": 1.0, "seed": 1,
                "logit_bias": {"0": -100}, "structured_outputs": {"grammar": AMBIGUOUS}})
            ending["s"] = time.perf_counter() - began

        threads = in_threads(1, ambiguous)
        time.sleep(0.5)
        figures = medians(stub, args.http_port, n=10)
        for thread in threads:
            thread.join()
        body = ending["body"]
        said = body.get("error", {}).get("message", "")[:160] if ending["status"] != 200 else \
            f"finish {body['choices'][0]['finish_reason']}, {body['usage']['completion_tokens']} tokens"
        print(f"the 150-byte ambiguous grammar, max_tokens 300: {ending['status']} after {ending['s']:.1f} s "
              f"(bar: within 30 s) {'ok' if ending['s'] < 30 else 'MISSED'}: {said}")
        report("it", figures)

        # 2. Refused bodies with a 90,000-entry logit_bias.
        bias = json.dumps({"model": "target", "prompt": "x", "max_tokens": 4,
                           "logit_bias": {str(i): 1 for i in range(90_000)}}, separators=(",", ":")).encode()
        pid = gateway_pid(serve.pid)
        before = rss_mb(pid)
        statuses: list[int] = []

        def flood(_: int) -> None:
            for _ in range(40):
                statuses.append(post(args.http_port, "/v1/completions", bias)[0])

        threads = in_threads(3, flood)
        figures = medians(stub, args.http_port, n=10)
        for thread in threads:
            thread.join()
        grown = rss_mb(pid) - before
        print(f"3 × 40 bodies of {len(bias) / 1e3:.0f} KB with a 90,000-entry logit_bias (statuses "
              f"{sorted(set(statuses))}): the gateway's RSS {before:.0f} → {before + grown:.0f} MB, +{grown:.0f} MB "
              f"(bar: at most 300) {'ok' if grown <= 300 else 'MISSED'}")
        report("them", figures)

        # 3. 200 KB JSON schemas: the same one looped, then a new one each time.
        for fresh in (False, True):
            stop = threading.Event()
            answers: list[int] = []

            def loop(i: int, stop: threading.Event, fresh: bool, answers: list[int]) -> None:
                sent = 0
                while not stop.is_set():
                    sent += 1
                    salt = f"c{i}r{sent}_" if fresh else ""
                    answers.append(post(args.http_port, "/v1/completions", {
                        "model": "target", "prompt": "{", "max_tokens": 16, "temperature": 0,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "big", "schema": schema(salt)}}})[0])

            size = len(json.dumps(schema("c0r0_" if fresh else ""))) / 1e3
            threads = in_threads(2, loop, stop, fresh, answers)
            time.sleep(1.0)
            figures = medians(stub, args.http_port, seconds=20)
            stop.set()
            for thread in threads:
                thread.join()
            server_errors = sum(status >= 500 for status in answers)
            print(f"2 clients looping a {size:.0f} KB JSON schema, {'a new one each time' if fresh else 'the same one'}"
                  f": {len(answers)} answered, statuses {sorted(set(answers))}, {server_errors} 5xx (bar: none) "
                  f"{'ok' if not server_errors else 'MISSED'}")
            report("them", figures)

        # 4. Salts within a tenant, in the suffix cache.
        prompt = "def merge_sorted(left, right):\n    result = []\n"

        def drafted(key: str, salt: str, text: str = prompt) -> float:
            status, body = post(args.http_port, "/v1/completions", {
                "model": "target", "prompt": text, "max_tokens": 64, "temperature": 0, "cache_salt": salt},
                key=key)
            assert status == 200, body
            return body["usage"]["speculation"]["mean_acceptance_length"]

        # Both tenants first send the same other prompts, so that their γ policies have seen
        # as much (a policy's acceptance estimate is pooled per tenant and task, over salts).
        for warm in ("class Stack:\n    def __init__(self):\n", "def binary_search(items, target):\n"):
            for key in KEYS.values():
                drafted(key, "warm-up", warm)
        x = drafted(KEYS["alpha"], "userX")
        y = drafted(KEYS["alpha"], "userY")
        other = drafted(KEYS["beta"], "userY")
        again = drafted(KEYS["alpha"], "userX")
        print(f"mean acceptance length on user X's prompt: X {x:.2f}, then user Y (same tenant, another salt) "
              f"{y:.2f}, another tenant {other:.2f}, X again {again:.2f} (bar: Y no better than the other tenant) "
              f"{'ok' if y <= other + 1e-9 else 'MISSED'}")
        channel.close()
    finally:
        serve.terminate()
        serve.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
