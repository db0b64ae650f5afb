"""`specd bench --shared-prefix`: prefix caching's gain on workloads that share prefixes,
against a running gateway.

Two workloads: one long system prompt (about 600 tokens of specd's own source) before
many short questions, and a multi-turn conversation whose every turn resends what came
before. Each request runs twice, in turn: with the cache (a salt shared by the pass) and
without it (a salt of its own, which no other request has: its prefix is never found,
as with --no-prefix-caching, on the same server and in the same run). It prints time to
first token (the first streamed chunk) and tokens/s for both, and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time
import uuid
from pathlib import Path

import specd


def system_prompt(characters: int = 1800) -> str:
    """The first `characters` of specd's own sampling code: real code, the same every run."""
    return (Path(specd.__file__).parent / "sampling.py").read_text()[:characters]


QUESTIONS = ["What does penalized() do?", "Where is min_p applied?", "Why is temperature bounded below?",
             "What is a sparse transform?", "Which order are the rules applied in?", "What does top_p keep?",
             "What does greedy mean here?", "How are logit biases bounded?"]


def conversations(turns: int) -> list[str]:
    """The prompts of one conversation, turn by turn: each resends the turns before it."""
    prompts, history = [], f"user: Here is some code.\n{system_prompt()}\n"
    for turn in range(turns):
        history += f"user: {QUESTIONS[turn % len(QUESTIONS)]}\nassistant:"
        prompts.append(history)
        history += " (an answer)\n"
    return prompts


def _timed(stub, prompt: str, salt: str, max_new_tokens: int) -> tuple[float, float, int]:
    """(time to first token, total seconds, tokens) of one streamed request."""
    from specd.v1 import gateway_pb2

    request = gateway_pb2.GenerateRequest(prompt=prompt, cache_salt=salt, sampling=gateway_pb2.SamplingParams(
        max_new_tokens=max_new_tokens))
    began, first, tokens = time.perf_counter(), None, 0
    for chunk in stub.GenerateStream(request, timeout=600):
        if chunk.token_ids and first is None:
            first = time.perf_counter() - began
        tokens += len(chunk.token_ids)
    return first or 0.0, time.perf_counter() - began, tokens


def run(args: argparse.Namespace, stub) -> int:
    """Both workloads, each request with the cache and without, alternated; the table."""
    salt = f"bench-{uuid.uuid4().hex}"
    workloads = {"system prompt + questions": [f"{system_prompt()}\n# {q}\n" for q in QUESTIONS],
                 "6-turn conversation": conversations(6)}
    lines = [f"{'workload':<28} {'cache':>6} {'TTFT ms':>9} {'tokens/s':>9}"]
    for name, prompts in workloads.items():
        figures: dict[bool, list[tuple[float, float, int]]] = {True: [], False: []}
        # The first prompt fills the cache (not counted); then ABBA, so drift hits both alike.
        _timed(stub, prompts[0], salt, args.max_new_tokens)
        for i, prompt in enumerate(prompts[1:]):
            for cached in ((True, False) if i % 2 == 0 else (False, True)):
                own = salt if cached else f"bench-{uuid.uuid4().hex}"
                figures[cached].append(_timed(stub, prompt, own, args.max_new_tokens))
        ttft = {c: statistics.median(f[0] for f in figures[c]) for c in figures}
        rate = {c: sum(f[2] for f in figures[c]) / sum(f[1] for f in figures[c]) for c in figures}
        for cached in (True, False):
            lines.append(f"{name:<28} {'on' if cached else 'off':>6} {ttft[cached] * 1e3:9.0f} {rate[cached]:9.1f}")
        lines.append(f"{'':<28} {'on÷off':>6} {ttft[True] / ttft[False]:9.2f} {rate[True] / rate[False]:9.2f}")
    print("\n".join(lines))
    return 0
