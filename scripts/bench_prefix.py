"""Prefix caching's bars, against real `specd serve` processes on the demo pair.

    python scripts/bench_prefix.py [--rounds 8]

It starts two servers on this machine's loopback: one with prefix caching (the default)
and API keys for two tenants, and one with --no-prefix-caching, which stays idle until
the last measure. With the first it measures, each figure the median over --rounds:

- hit ÷ miss: 4 tokens after a prefix of about 600 tokens of real code (specd's own
  source) that an earlier request sent, against a prefix never sent (alternated);
- tenants: tenant B sending tenant A's prefix (÷ a miss: no hit), and A's repeat;
- a 6-turn chat over HTTP: each turn's time to first token ÷ turn 1's, and
  usage.prompt_tokens_details.cached_tokens;
- a soak of 1,000 requests with distinct prefixes: failures, and the verifier's indexed
  blocks against its pool.

Then the same prompts, sharing nothing, on both servers, alternated prompt by prompt, for
"no regression": tokens/s with caching ÷ without.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from specd.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "models/demo/target")


def code_chunks(tokens: int) -> list[str]:
    """Pieces of specd's own source, each about `tokens` tokens: real code no request sent."""
    chunks, text = [], ""
    for path in sorted((ROOT / "specd").rglob("*.py")) + sorted((ROOT / "gateway").rglob("*.py")):
        for line in path.read_text().splitlines(keepends=True):
            text += line
            if len(TOKENIZER(text)["input_ids"]) >= tokens:
                chunks.append(text)
                text = ""
    return chunks


class Server:
    """`specd serve` on the demo pair, in its own process group."""

    def __init__(self, port: int, http_port: int, *flags: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specd-bench-prefix-", suffix=".log", delete=False)
        self.process = subprocess.Popen([str(Path(sys.executable).with_name("specd")), "serve", "--port", str(port),
                                         "--http-port", str(http_port), "--model-free", "",
                                         "--chat-template", str(ROOT / "models/demo/chat.jinja"), *flags],
                                        stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=300)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.http = f"http://127.0.0.1:{http_port}/v1"
        self.model = self.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest()).target.name
        while True:  # the gateway answers once it has reached its workers
            try:
                self.generate("warm up", 2)
                break
            except grpc.RpcError:
                time.sleep(1)

    def generate(self, prompt: str, tokens: int, key: str = "") -> tuple[float, gateway_pb2.GenerateResponse]:
        request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=gateway_pb2.SamplingParams(
            max_new_tokens=tokens))
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        began = time.perf_counter()
        response = self.stub.Generate(request, metadata=metadata, timeout=600)
        return time.perf_counter() - began, response

    def close(self) -> None:
        self.channel.close()
        self.process.terminate()
        self.process.wait(60)


def chat_turns(server: Server, key: str, chunks: list[str], turns: int) -> list[tuple[float, int]]:
    """(time to first token, cached tokens) of each turn of one conversation over HTTP."""
    messages: list[dict[str, str]] = []
    figures = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn + 1}: what does this code do?\n"
                                                    + chunks[turn][:400]})
        body = json.dumps({"model": server.model, "messages": messages, "max_tokens": 8, "temperature": 0,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        request = urllib.request.Request(server.http + "/chat/completions", body, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}"})
        began, first, answer, cached = time.perf_counter(), None, "", 0
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
                for choice in event["choices"]:
                    if choice["delta"].get("content") and first is None:
                        first = time.perf_counter() - began
                    answer += choice["delta"].get("content") or ""
        messages.append({"role": "assistant", "content": answer})
        figures.append((first or 0.0, cached))
    return figures


def metric(server_log: str, text: str, name: str) -> float:
    """A verifier metric's value from its /metrics text (the first series of that name)."""
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.split()[-1])
    raise KeyError(f"{name} not in the metrics ({server_log})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--soak", type=int, default=1000)
    args = parser.parse_args()
    chunks = code_chunks(600)
    assert len(chunks) >= 3 * args.rounds + 6, f"only {len(chunks)} chunks of code"
    keys = Path(tempfile.mkdtemp()) / "keys.txt"
    keys.write_text("alpha alpha-key\nbeta beta-key\n")

    server = Server(50071, 8071, "--api-keys", str(keys), "--metrics-port", "9471")
    cold = Server(50072, 8072, "--no-prefix-caching")
    try:
        misses, hits, other_tenant, own_repeat = [], [], [], []
        for i in range(args.rounds):
            shared, fresh = chunks[2 * i], chunks[2 * i + 1]
            server.generate(shared + "\n# First question", 4, "alpha-key")
            miss_s, _ = server.generate(fresh + "\n# Another", 4, "alpha-key")
            hit_s, hit = server.generate(shared + "\n# Second question", 4, "alpha-key")
            misses.append(miss_s)
            hits.append(hit_s)
            assert hit.stats.cached_tokens > 0
            b_s, b = server.generate(shared + "\n# Third question", 4, "beta-key")
            assert b.stats.cached_tokens == 0
            other_tenant.append(b_s)
            a_s, _ = server.generate(shared + "\n# Fourth question", 4, "alpha-key")
            own_repeat.append(a_s)
        miss = statistics.median(misses)
        print(f"600-token prefix, 4 tokens, median of {args.rounds}: miss {miss * 1e3:.0f} ms, "
              f"hit {statistics.median(hits) * 1e3:.0f} ms → hit ÷ miss {statistics.median(hits) / miss:.2f}")
        print(f"tenants: B on A's prefix ÷ miss {statistics.median(other_tenant) / miss:.2f}, "
              f"A's repeat ÷ miss {statistics.median(own_repeat) / miss:.2f}")

        turns = chat_turns(server, "alpha-key", chunks[-6:], 6)
        first = turns[0][0]
        print("6-turn chat, time to first token ÷ turn 1: "
              + ", ".join(f"{ttft / first:.2f}" for ttft, _ in turns[1:])
              + "; cached tokens per turn: " + ", ".join(str(c) for _, c in turns))

        failures = 0
        for i in range(args.soak):
            try:
                server.generate(f"{i} " + chunks[i % len(chunks)][:200 + i % 50], 2, "alpha-key")
            except grpc.RpcError:
                failures += 1
        text = urllib.request.urlopen("http://127.0.0.1:9471/metrics", timeout=30).read().decode()
        print(f"soak of {args.soak} distinct prefixes: {failures} failed; the verifier indexes "
              f"{metric(server.log.name, text, 'specd_worker_prefix_cache_blocks'):.0f} blocks, hits "
              f"{metric(server.log.name, text, 'specd_worker_prefix_cache_hits_total'):.0f} of "
              f"{metric(server.log.name, text, 'specd_worker_prefix_cache_queries_total'):.0f} tokens looked up")
        # Prompts neither server has seen: the first lines of chunks the rounds did not use.
        distinct = [chunks[2 * args.rounds + i][:1200] for i in range(args.rounds)]
        warm_rate, cold_rate = [], []
        for prompt in distinct:
            seconds, response = server.generate(prompt, 32, "alpha-key")
            warm_rate.append((response.stats.generated_tokens, seconds))
            seconds, response = cold.generate(prompt, 32)
            cold_rate.append((response.stats.generated_tokens, seconds))
    finally:
        server.close()
        cold.close()
    on = sum(t for t, _ in warm_rate) / sum(s for _, s in warm_rate)
    off = sum(t for t, _ in cold_rate) / sum(s for _, s in cold_rate)
    print(f"prompts sharing nothing: {on:.1f} tokens/s with caching, {off:.1f} without → {on / off:.3f}")


if __name__ == "__main__":
    main()
