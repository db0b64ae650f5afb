"""What verifying a proposal costs against a plain step: one session's forward of k tokens
(γ = k − 1) over a cached prefix, ms and × the one-token forward, with each layer's sibling
projections packed as one product (as a worker packs them, `packing.pack_linears`' groups)
and packed apart, taking turns forward by forward in one run.

    python scripts/bench_verify.py --model MODEL [--draft-base TARGET] [--threads 2] [--prefix 128]

The ratio is the v(γ) of the goodput arithmetic in docs/models.md: on a CPU it decides how
much a rejected proposal costs. docs/serving-path.md ("Packed linear layers") keeps the
figures.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from specd.worker import forwards, hub, lean, packing, sharing
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd_cli.bench import machine

WIDTHS = (1, 2, 3, 5)


def load(path: Path, draft_base: Path | None, joined: bool, prefix: int):
    """The model packed as a worker packs it (sibling projections `joined` or apart), with
    the lean forward, and a session holding `prefix` tokens."""
    model = sharing.load(path, torch.float32, draft_base) if sharing.is_shared_draft(path) \
        else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    packing.pack_linears(model, groups=lean.joinable(model) if joined else ())
    use_paged_attention(model)
    config, cpu = model.config, torch.device("cpu")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, head_dim, torch.float32, cpu, 16,
                  (prefix + max(WIDTHS)) // 16 + 8)
    unmirrored = lean.install(model, pool, config.vocab_size, cpu)
    if unmirrored is not None:
        raise SystemExit(f"{path}: no lean forward ({unmirrored})")
    session = SessionKV(pool)
    assert session.reserve(prefix + max(WIDTHS))
    with torch.inference_mode():
        forwards.forward(model, [BatchRow(session, [(7 * j) % config.vocab_size for j in range(prefix)], 1)], cpu)
    return model, session


def verify(model, session: SessionKV, prefix: int, width: int) -> None:
    """One forward of `width` tokens after the prefix, keeping every one's logits."""
    session.crop(prefix)
    with torch.inference_mode():
        forwards.forward(model, [BatchRow(session, [5] * width, width)], torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft-base", type=Path, default=None,
                        help="the target a draft made by `specd distill` from the target alone shares weights with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = hub.resolve(args.model)
    draft_base = hub.resolve(str(args.draft_base)) if args.draft_base else None
    cases = {"joined": load(path, draft_base, True, args.prefix), "apart": load(path, draft_base, False, args.prefix)}
    runs = {(name, width): functools.partial(verify, model, session, args.prefix, width)
            for name, (model, session) in cases.items() for width in WIDTHS}
    for run in runs.values():
        run()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            began = time.perf_counter()
            run()
            times[key].append((time.perf_counter() - began) * 1e3)
    ms = {key: statistics.median(taken) for key, taken in times.items()}
    print(f"{machine()}; {args.model}, {args.threads} threads, {args.prefix} cached tokens; median ms of one forward "
          f"(× that case's one-token forward)")
    print(f"{'tokens':>6} " + " ".join(f"{name:>16}" for name in cases) + f" {'joined ÷ apart':>15}")
    for width in WIDTHS:
        cells = [f"{ms[name, width]:>7.2f} ({ms[name, width] / ms[name, 1]:.2f}×)" for name in cases]
        print(f"{width:>6} " + " ".join(f"{cell:>16}" for cell in cells)
              + f" {ms['joined', width] / ms['apart', width]:>15.2f}")


if __name__ == "__main__":
    main()
