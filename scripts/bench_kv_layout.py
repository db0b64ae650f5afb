"""Padded vs ragged batched forwards on the demo target, side by side in one run.

Each case is a batch of sessions with cached prefixes; every session feeds its new
tokens (a verify step: one committed token plus γ proposals; or a prompt being
prefilled). Prints median ms per batched forward for each layout, and for the same
rows run one session at a time (what specd did before batching).

    python scripts/bench_kv_layout.py [--model models/demo/target] [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from specd import kvstore
from specd.config import DEMO_TARGET
from specd.kvstore import BatchRow, SessionKV


def sessions(model, prefixes: list[int]) -> list[SessionKV]:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = []
    for n in prefixes:
        s = SessionKV(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, torch.float32,
                      torch.device("cpu"), 32)
        rows = [BatchRow(s, torch.randint(0, cfg.vocab_size, (n,)).tolist(), 1)]
        kvstore.forward(model, rows, "ragged", torch.float32, torch.device("cpu"))
        out.append(s)
    return out


def timed(model, sess, feeds, layout, repeats):
    times = []
    for _ in range(repeats):
        starts = [s.length for s in sess]
        rows = [BatchRow(s, f, len(f) if len(f) <= 9 else 1) for s, f in zip(sess, feeds)]
        began = time.perf_counter()
        if layout == "one at a time":
            for row in rows:
                kvstore.forward(model, [row], "ragged", torch.float32, torch.device("cpu"))
        else:
            kvstore.forward(model, rows, layout, torch.float32, torch.device("cpu"))
        times.append((time.perf_counter() - began) * 1e3)
        for s, n in zip(sess, starts):
            s.crop(n)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_TARGET))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    kvstore.use_layout(model, "ragged")  # the padded layout passes its own mask to SDPA
    vocab = model.config.vocab_size
    cases = {
        "8 verify steps (γ=4), prefixes 60-200": ([60, 80, 100, 120, 140, 160, 180, 200], [6] * 8),
        "8 plain steps, prefixes 60-200": ([60, 80, 100, 120, 140, 160, 180, 200], [1] * 8),
        "7 verify steps + one 256-token prefill": ([60, 80, 100, 120, 140, 160, 180, 1], [6] * 7 + [256]),
        "16 verify steps (γ=4), prefixes 100": ([100] * 16, [6] * 16),
    }
    print(f"{'case':42} {'padded':>8} {'ragged':>8} {'one at a time':>14}   (median ms per forward)")
    for name, (prefixes, widths) in cases.items():
        sess = sessions(model, prefixes)
        feeds = [torch.randint(0, vocab, (w,)).tolist() for w in widths]
        cells = [timed(model, sess, feeds, layout, args.repeats) for layout in ("padded", "ragged", "one at a time")]
        print(f"{name:42} " + " ".join(f"{c:8.1f}" for c in cells[:2]) + f" {cells[2]:14.1f}")


if __name__ == "__main__":
    main()
