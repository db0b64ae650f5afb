"""`specd corpus`: the target's own greedy answers to chat requests, written for the gateway's
corpus proposer (`gateway.proposers.corpus`; `specd gateway --corpus FILE`).

Each request is a user message rendered with the target's chat template up to the
assistant's turn, and continued greedily by transformers' `generate` (batched, left-padded,
float32) until EOS or `--new-tokens`. The file keeps each answer with the last
`--prompt-tail` tokens of its prompt before it, so that the table also learns how answers
begin after the template's assistant header, and the target's tokenizer fingerprint, so a
gateway refuses it for a target that tokenizes otherwise.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from gateway.proposers.corpus import Corpus, write_corpus
from specd.worker import hub
from specd.worker.runtime import eos_ids, tokenizer_fingerprint
from specd_cli.distill import chat_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: a folder, a .gguf file or a hub id")
    parser.add_argument("--questions", required=True, metavar="FILE",
                        help="chat requests, one a line, of the kind the target will serve")
    parser.add_argument("--out", required=True, metavar="FILE", help="the corpus file to write (.safetensors)")
    parser.add_argument("--new-tokens", type=int, default=256, help="longest answer, in tokens (default 256)")
    parser.add_argument("--prompt-tail", type=int, default=16,
                        help="tokens of each prompt's end kept before its answer (default 16)")
    parser.add_argument("--batch-size", type=int, default=32, help="requests answered at once (default 32)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop answering after this long and write what is answered (default: answer all)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")


def run(args: argparse.Namespace) -> int:
    """Run ``specd corpus`` with parsed ``args``; return a process exit status."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size < 1 or args.new_tokens < 1 or args.prompt_tail < 0:
        print("specd corpus: --batch-size and --new-tokens must be 1 or more, --prompt-tail 0 or more",
              file=sys.stderr)
        return 2
    try:
        target_dir = hub.resolve(args.target)
        questions = [line.strip() for line in Path(args.questions).read_text(encoding="utf-8").splitlines()
                     if line.strip()]
    except (ValueError, OSError, hub.ModelNotFound) as exc:
        print(f"specd corpus: {exc}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    if tokenizer.chat_template is None:
        print(f"specd corpus: {args.target} has no chat template to render the requests with", file=sys.stderr)
        return 2
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = set(eos_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    prompts = chat_prompts(tokenizer, questions)
    # Similar lengths batched together: less padding to compute.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    sequences: list[np.ndarray] = []
    began = time.monotonic()
    for start in range(0, len(order), args.batch_size):
        if args.time_budget is not None and time.monotonic() - began > args.time_budget:
            break
        batch = [prompts[i] for i in order[start:start + args.batch_size]]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=pad)
        for prompt, row in zip(batch, out[:, width:].tolist()):
            end = next((k + 1 for k, token in enumerate(row) if token in eos), len(row))
            tail = prompt[len(prompt) - args.prompt_tail:] if args.prompt_tail else []
            sequences.append(np.array(tail + row[:end], dtype=np.int32))
        print(f"{len(sequences)}/{len(prompts)} answered, {sum(map(len, sequences)):,} tokens, "
              f"{time.monotonic() - began:.0f} s", file=sys.stderr)
    if not sequences:
        print("specd corpus: no request was answered (no questions, or --time-budget spent before the first "
              "batch); nothing written", file=sys.stderr)
        return 2
    source = (f"{args.target}: greedy answers to {len(sequences)} requests of {args.questions}, at most "
              f"{args.new_tokens} tokens each")
    corpus = Corpus(sequences, tokenizer_fingerprint(tokenizer), source)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_corpus(out_path, corpus)
    print(f"wrote {out_path}: {len(sequences)} answers, {corpus.tokens:,} tokens in "
          f"{time.monotonic() - began:.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run as ``python -m specd_cli.corpus`` (the same options as ``specd corpus``)."""
    parser = argparse.ArgumentParser(prog="specd corpus", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
