"""Prefix caching's bars, against real `specd serve` processes on the demo pair.

    python scripts/bench_prefix.py [--rounds 8]

It starts two servers on this machine's loopback: one with prefix caching (the default)
and API keys for two tenants, and one with --no-prefix-caching, which stays idle until
the last measure. With the first it measures, each figure the median over --rounds:

- hit ÷ miss: 4 tokens after a prefix of about 600 tokens of real code (specd's own
  source) that an earlier request sent, against a prefix never sent (alternated);
- tenants: tenant B sending tenant A's prefix (÷ a miss: no hit), and A's repeat;
- a 6-turn chat over HTTP, about 600 tokens of code in the first turn and a short
  question in each next one: each turn's time to first token ÷ turn 1's, and
  usage.prompt_tokens_details.cached_tokens;
- n = 4 completions of a 600-token prompt, sampled, 8 tokens each, ÷ one completion of
  another such prompt, on this server and on the one without caching (the first
  completion prefills; the others start after its first step, `gateway.edge.choices`);
- a soak of 1,000 requests with distinct prefixes, more than the KV pool holds: how many
  failed (a full pool must evict cached blocks, not refuse), and how many hit.

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

    def __init__(self, port: int, http_port: int, *flags: str, key: str = "") -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="specd-bench-prefix-", suffix=".log", delete=False)
        self.process = subprocess.Popen([str(Path(sys.executable).with_name("specd")), "serve", "--port", str(port),
                                         "--http-port", str(http_port), "--model-free", "",
                                         "--chat-template", str(ROOT / "models/demo/chat.jinja"), *flags],
                                        stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=300)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.http = f"http://127.0.0.1:{http_port}/v1"
        metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.model = self.stub.GetGatewayInfo(gateway_pb2.GatewayInfoRequest(), metadata=metadata).target.name
        while True:  # the gateway answers once it has reached its workers
            try:
                self.generate("warm up", 2, key)
                break
            except grpc.RpcError:
                time.sleep(1)

    def generate(self, prompt: str, tokens: int, key: str = "",
                 n: int = 0) -> tuple[float, gateway_pb2.GenerateResponse]:
        """(seconds, response): greedy, or n completions sampled with seed 5."""
        sampling = gateway_pb2.SamplingParams(max_new_tokens=tokens, temperature=1.0 if n else 0.0, seed=5 if n else 0)
        request = gateway_pb2.GenerateRequest(prompt=prompt, sampling=sampling, n=n)
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
        question = f"What does this code do?\n{chunks[0]}" if turn == 0 else f"And what about line {turn}?"
        messages.append({"role": "user", "content": question})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--soak", type=int, default=1000)
    args = parser.parse_args()
    chunks = code_chunks(600)
    assert len(chunks) >= 3 * args.rounds + 1, f"only {len(chunks)} chunks of code"
    keys = Path(tempfile.mkdtemp()) / "keys.txt"
    keys.write_text("alpha alpha-key\nbeta beta-key\n")

    server = Server(50071, 8071, "--api-keys", str(keys), key="alpha-key")
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

        turns = chat_turns(server, "alpha-key", chunks[-1:], 6)
        first = turns[0][0]
        print("6-turn chat, time to first token ÷ turn 1: "
              + ", ".join(f"{ttft / first:.2f}" for ttft, _ in turns[1:])
              + "; cached tokens per turn: " + ", ".join(str(c) for _, c in turns))

        n_ratios = {}
        for name, target, key in (("with caching", server, "alpha-key"), ("without", cold, "")):
            ones, fours = [], []
            for i in range(4):  # prompts from the end of the chunks, which nothing else sends
                ones.append(target.generate(chunks[-2 - 2 * i] + "\n# Q", 8, key, n=1)[0])
                fours.append(target.generate(chunks[-3 - 2 * i] + "\n# Q", 8, key, n=4)[0])
            n_ratios[name] = statistics.median(fours) / statistics.median(ones)
        print("n = 4 ÷ n = 1, 600-token prompts, median of 4: "
              + ", ".join(f"{name} {ratio:.2f}" for name, ratio in n_ratios.items()))

        failures, soak_tokens, soak_hits = 0, 0, 0
        for i in range(args.soak):
            try:
                _, response = server.generate(f"{i} " + chunks[i % len(chunks)][:600 + i % 50], 2, "alpha-key")
                soak_tokens += response.stats.prompt_tokens
                soak_hits += response.stats.cached_tokens
            except grpc.RpcError:
                failures += 1
        print(f"soak of {args.soak} distinct prefixes ({soak_tokens} prompt tokens): "
              f"{failures} failed, {soak_hits} tokens hit")
        # Prompts neither server has seen: the first lines of chunks the rounds did not use.
        # In ABBA order, so a drift of the machine's speed hits both alike.
        distinct = [chunks[2 * args.rounds + i][:1200] for i in range(args.rounds)]
        warm_rate: list[tuple[int, float]] = []
        cold_rate: list[tuple[int, float]] = []
        for i, prompt in enumerate(distinct):
            for caching in ((True, False) if i % 2 == 0 else (False, True)):
                seconds, response = (server.generate(prompt, 64, "alpha-key") if caching
                                     else cold.generate(prompt, 64))
                (warm_rate if caching else cold_rate).append((response.stats.generated_tokens, seconds))
    finally:
        server.close()
        cold.close()
    on = sum(t for t, _ in warm_rate) / sum(s for _, s in warm_rate)
    off = sum(t for t, _ in cold_rate) / sum(s for _, s in cold_rate)
    print(f"prompts sharing nothing: {on:.1f} tokens/s with caching, {off:.1f} without → {on / off:.3f}")


if __name__ == "__main__":
    main()
