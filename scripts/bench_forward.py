"""The batched forward on its own: ms per decoding forward of the paged KV store at 1, 8
and 32 sessions, through transformers' layers and through specd's lean forward
(specd.worker.lean), beside the same sessions one at a time and transformers' own one-token
step of as many rows with a DynamicCache, side by side in one run.

    python scripts/bench_forward.py [--model models/demo/target] [--draft-base TARGET] [--threads 2] [--prefix 128]
        [--cpu-linear onednn|torch] [--draft-cpu-weights float16|as-loaded]

Each session holds `prefix` cached tokens and feeds one new token per forward (a plain
decoding step). The paged forward's linear layers are packed for oneDNN as a worker's are
(`--cpu-linear`, specd.worker.packing; `--draft-cpu-weights float16` as a draft worker's);
transformers' step keeps torch's own. The paged
batch through transformers' layers and through the lean forward take turns, forward by
forward, so that a machine whose speed drifts slows both alike. Prints the median ms of
each case; docs/performance.md keeps the figures.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specd.config import DEMO_TARGET
from specd.worker import forwards, hub, lean, packing, sharing
from specd.worker.attention import use_paged_attention
from specd.worker.kvstore import KVPool, SessionKV
from specd.worker.layout import BatchRow
from specd.worker.settings import CPU_LINEARS, DRAFT_CPU_WEIGHTS
from specd_cli.bench import machine


def median_ms(*runs, repeats: int) -> list[float]:
    """The median ms of each of `runs`, timed in turns: one of each, `repeats` times."""
    for run in runs:
        for _ in range(3):
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, taken in zip(runs, times):
            began = time.perf_counter()
            run()
            taken.append((time.perf_counter() - began) * 1e3)
    return [statistics.median(taken) for taken in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_TARGET))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--draft-base", type=Path, default=None,
                        help="the target a draft made by `specd distill` from the target alone shares weights with")
    parser.add_argument("--prefix", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--cpu-linear", choices=CPU_LINEARS, default="onednn",
                        help="the paged forward's linear layers, as a worker's --cpu-linear")
    parser.add_argument("--draft-cpu-weights", choices=DRAFT_CPU_WEIGHTS, default="as-loaded",
                        help="float16: the packed layers' weights in float16, as a draft worker's (its default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = hub.resolve(args.model)  # a directory, a .gguf file (converted once) or a hub id
    draft_base = hub.resolve(str(args.draft_base)) if args.draft_base else None
    if sharing.is_shared_draft(path):
        model = sharing.load(path, torch.float32, draft_base)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg, cpu = model.config, torch.device("cpu")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    prompt = [(7 * j) % cfg.vocab_size for j in range(args.prefix)]
    references = {count: transformers_step_ms(model, prompt, count, args.repeats) for count in (1, 8, 32)}
    use_paged_attention(model)
    if args.cpu_linear == "onednn":
        layout = packing.draft_layout(torch.float32) if args.draft_cpu_weights == "float16" else "onednn"
        packing.pack_linears(model, groups=lean.joinable(model), layout=layout)
    # Blocks of 16 positions for every session of every case below (1 + 8 + 32), kept to the end,
    # and 4 for the lean forward's trial at install.
    pool = KVPool(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, head_dim, torch.float32, cpu, 16,
                  41 * ((args.prefix + 1) // 16 + 2) + 5)
    print(f"{machine()}; {args.model}, {torch.get_num_threads()} threads, {args.prefix} cached tokens per session, "
          f"paged forward's linear layers: {args.cpu_linear}"
          f"{', float16' if args.cpu_linear == 'onednn' and args.draft_cpu_weights == 'float16' else ''}")
    own = functools.partial(forwards.own_forward, model)
    unmirrored = lean.install(model, pool, cfg.vocab_size, cpu)
    decoder = None if unmirrored is not None else lean.LeanDecoder(model)
    print(f"lean forward: {unmirrored or 'on'}")
    print(f"{'sessions':>8} {'paged batch':>12} {'lean batch':>11} {'one at a time':>14} {'ms per session':>15} "
          f"{'transformers':>13}   (median ms per forward; paged and one at a time: transformers' layers)")
    for count in (1, 8, 32):
        sessions = [SessionKV(pool) for _ in range(count)]
        for session in sessions:
            assert session.reserve(args.prefix + 1)
            forwards.forward(model, [BatchRow(session, prompt, 1)], cpu)
        batched = functools.partial(step, model, sessions, args.prefix, True)
        if decoder is None:  # a model the lean forward does not mirror: nothing to time beside it
            together, leaner = median_ms(batched, repeats=args.repeats)[0], float("nan")
        else:
            together, leaner = median_ms(using(model, own, batched), using(model, decoder, batched),
                                         repeats=args.repeats)
        forwards.use_forward(model, own)
        apart, = median_ms(functools.partial(step, model, sessions, args.prefix, False),
                           repeats=max(3, args.repeats // 4))
        print(f"{count:>8} {together:>12.2f} {leaner:>11.2f} {apart:>14.2f} {together / count:>15.2f} "
              f"{references[count]:>13.2f}")


def using(model, forward, run):
    """`run`, with the store sending `model`'s batched forwards through `forward`."""
    def run_with() -> None:
        forwards.use_forward(model, forward)
        run()
    return run_with


def transformers_step_ms(model, prompt: list[int], count: int, repeats: int) -> float:
    """Median ms of transformers' own one-token forward of `count` rows of `prompt` with a
    DynamicCache (as its batched `generate` steps, equal lengths, no padding)."""
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        # A sliding-window layer keeps what it drops past its window, so `crop` can roll it back.
        cache.activate_past_recording()
        model(torch.tensor([prompt] * count), cache=cache, use_cache=True)
        ids, position = torch.full((count, 1), 5), torch.full((count, 1), len(prompt))

        def step() -> None:
            model(ids, cache=cache, use_cache=True, position_ids=position, logits_to_keep=1)
            cache.crop(-1)

        return median_ms(step, repeats=repeats)[0]


def step(model, sessions: list[SessionKV], prefix: int, batched: bool) -> None:
    """Every session feeds one token after `prefix` cached ones: in one forward, or one each."""
    cpu = torch.device("cpu")
    for session in sessions:
        session.crop(prefix)
    if batched:
        forwards.forward(model, [BatchRow(session, [5], 1) for session in sessions], cpu)
    else:
        for session in sessions:
            forwards.forward(model, [BatchRow(session, [5], 1)], cpu)


if __name__ == "__main__":
    main()
