#!/usr/bin/env python3
"""Make specd's shipped demo pair from nothing but this machine's Python install.

Steps (each resumable, run all with no argument or one with ``--step``):

  corpus     Python standard library source (no tests) as "code", the English
             help topics in ``pydoc_data/topics.py`` as "prose"; a validation split
             and held-out prompts of each type.
  tokenizer  byte-level BPE (vocab 4096) wrapped as a PreTrainedTokenizerFast.
  target     LlamaForCausalLM, 4 layers x 768, trained for a wall-clock budget.
  draft      the "generic" draft, 2 layers x 256, trained on the corpus only.
  distill    the "distilled" draft: the generic draft trained by ``specd_cli.distill``
             to match the target's token distributions.
  cards      measure losses, per-token cost and acceptance; write model cards.

Work files (corpus, token arrays, checkpoints, logs) go to ``runs/demo``; the
shipped models to ``models/demo/{target,draft-generic,draft-distilled}`` as bf16
safetensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specd_cli.training import resume, train_for_budget  # noqa: E402

RUNS = REPO / "runs" / "demo"
MODELS = REPO / "models" / "demo"
TYPES = ("code", "prose")
EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 256
PROMPT_TOKENS = 32
EVAL_PROMPTS = 100
EVAL_NEW_TOKENS = 64

# Wide and shallow: on a CPU a forward's cost follows the bytes of weights it reads
# plus a per-layer overhead, and in a budget of minutes a shallow wide model learns
# far faster than a deep narrow one of the same cost (measured on this kind of 2-core
# machine before this script was written: an 8x384 target lost to a 2-layer draft after
# 15 minutes of training).
TARGET_SHAPE = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
                    num_attention_heads=12, num_key_value_heads=12)
DRAFT_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4)
# Per-model training recipe: wall-clock budget (s), peak learning rate, batch size.
RECIPES: dict[str, dict[str, Any]] = {
    "target": dict(shape=TARGET_SHAPE, budget=2520, lr=1.5e-3, batch=8),
    "draft": dict(shape=DRAFT_SHAPE, budget=420, lr=3e-3, batch=16),
}
# The prose corpus is ~4% of the text; sample it more often so both task types are
# learned, but not so often that a few epochs of it overfit.
PROSE_FRACTION = 0.12


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------- corpus

def _is_test_path(rel: Path) -> bool:
    parts = rel.parts
    return any(p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts)


def _held_out(key: str, fraction: float = 0.05) -> bool:
    # A stable hash, so the split does not move between runs or machines.
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


def corpus_docs() -> dict[str, dict[str, list[str]]]:
    """The corpus as documents by task type and split; the same on any machine with
    the same Python, so tests can rebuild the held-out text without runs/."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: dict[str, dict[str, list[str]]] = {t: {"train": [], "val": []} for t in TYPES}
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _is_test_path(rel) or "site-packages" in rel.parts or rel.parts[0] == "pydoc_data":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not _held_out(str(rel)):
            docs["code"]["train"].append(text)
        elif rel.parts[0] != "encodings":
            # Held-out codecs are left out: they are generated mapping tables, not
            # code, and they would be a third of the held-out text and its prompts.
            docs["code"]["val"].append(text)
    from pydoc_data import topics

    for key, text in sorted(topics.topics.items()):
        # Split topics into blocks of paragraphs before holding out: there are only
        # ~80 topics, too few whole ones to make a validation set with enough prompts.
        paras = text.split("\n\n")
        for i in range(0, len(paras), 12):
            block = "\n\n".join(paras[i:i + 12])
            docs["prose"]["val" if _held_out(f"{key}/{i}", 0.10) else "train"].append(block)
    return docs


def held_out_text(task: str) -> str:
    """The held-out text of one task type, documents joined as in the corpus files."""
    return ("\n" + EOS + "\n").join(corpus_docs()[task]["val"])


def step_corpus(args: argparse.Namespace) -> None:
    """Write runs/demo/corpus/{code,prose}_{train,val}.txt."""
    out = RUNS / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    docs = corpus_docs()
    for t in TYPES:
        for split in ("train", "val"):
            text = ("\n" + EOS + "\n").join(docs[t][split])
            (out / f"{t}_{split}.txt").write_text(text, encoding="utf-8")
            log(f"corpus {t}/{split}: {len(docs[t][split])} docs, {len(text) / 1e6:.2f} MB")


# ------------------------------------------------------------------------- tokenizer

def step_tokenizer(args: argparse.Namespace) -> None:
    """Train a byte-level BPE on the training text; tokenize every split to uint16."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = RUNS / "corpus"
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus / f"{t}_train.txt") for t in TYPES], vocab_size=VOCAB_SIZE,
              min_frequency=2, special_tokens=[EOS])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS,
                                  bos_token=EOS, unk_token=EOS, pad_token=EOS)
    tok.save_pretrained(RUNS / "tokenizer")
    data = RUNS / "data"
    data.mkdir(exist_ok=True)
    for t in TYPES:
        for split in ("train", "val"):
            text = (corpus / f"{t}_{split}.txt").read_text(encoding="utf-8")
            ids = np.array(bpe.encode(text).ids, dtype=np.uint16)
            ids.tofile(data / f"{t}_{split}.bin")
            log(f"tokens {t}/{split}: {len(ids):,} ({len(text) / len(ids):.2f} chars/token)")


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(RUNS / "tokenizer")


def load_tokens(t: str, split: str) -> np.ndarray:
    return np.fromfile(RUNS / "data" / f"{t}_{split}.bin", dtype=np.uint16)


# -------------------------------------------------------------------------- training

def make_model(shape: dict, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), max_position_embeddings=1024,
                         tie_word_embeddings=True,  # halves the embedding bytes shipped
                         bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id, **shape)
    return LlamaForCausalLM(config)


def sample_batch(rng: np.random.Generator, data: dict[str, np.ndarray], batch: int) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        arr = data["prose"] if rng.random() < PROSE_FRACTION else data["code"]
        i = int(rng.integers(0, len(arr) - SEQ_LEN - 1))
        rows.append(arr[i:i + SEQ_LEN + 1].astype(np.int64))
    return torch.from_numpy(np.stack(rows))


@torch.no_grad()
def val_loss(model, t: str, windows: int = 64) -> float:
    """Mean next-token loss (nats) on the held-out split of one task type, fp32, over
    up to ``windows`` evenly spaced 256-token windows (the whole split, sampled, not
    just its first files)."""
    model.eval()
    arr = load_tokens(t, "val").astype(np.int64)
    n = min(windows, (len(arr) - 1) // SEQ_LEN)
    starts = np.linspace(0, len(arr) - SEQ_LEN - 1, n).astype(np.int64)
    x = torch.from_numpy(np.stack([arr[i:i + SEQ_LEN + 1] for i in starts]))
    total = 0.0
    for i in range(0, n, 8):
        logits = model(x[i:i + 8, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[i:i + 8, 1:].reshape(-1), reduction="sum").item()
    model.train()
    return total / (n * SEQ_LEN)


def train(name: str, args: argparse.Namespace) -> None:
    """Train one model for a wall-clock budget with bf16 autocast; resumable.

    The learning rate follows elapsed time, not steps, so a run interrupted and
    resumed (or slowed by other work on the CPU) still ends its cosine schedule
    exactly when the budget runs out.
    """
    recipe = RECIPES[name]
    budget = args.budget if args.budget else recipe["budget"]
    ckdir = RUNS / f"{name}-ckpt"
    ckdir.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer()
    torch.manual_seed(0)
    model = make_model(recipe["shape"], tok)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe["lr"], betas=(0.9, 0.95),
                            weight_decay=0.1)
    ck = ckdir / "state.pt"
    state = resume(ck, model, opt)
    if state is None:
        state = {"elapsed": 0.0, "step": 0, "tokens": 0, "losses": []}
    else:
        log(f"{name}: resumed at step {state['step']}, {state['elapsed']:.0f}s elapsed")
    # Each run's budget is kept, so the card can say when a schedule was extended
    # (a warm restart: the cosine resumes at the point the longer budget puts it).
    budgets = state.setdefault("budgets", [])
    if not budgets or budgets[-1] != budget:
        budgets.append(budget)
    data = {t: load_tokens(t, "train") for t in TYPES}
    rng = np.random.default_rng(state["step"] + 1)
    nparams = sum(p.numel() for p in model.parameters())
    log(f"{name}: {nparams / 1e6:.2f}M parameters, budget {budget}s")

    def batch_loss() -> torch.Tensor:
        x = sample_batch(rng, data, recipe["batch"])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                 x[:, 1:].reshape(-1))
        state["tokens"] += x.numel() - x.size(0)
        state["losses"].append(loss.item())
        return loss

    def on_step(state: dict, bar) -> None:
        if state["step"] % 50 == 0:
            recent = statistics.mean(state["losses"][-50:])
            bar.set_postfix(loss=f"{recent:.3f}", tok_s=f"{state['tokens'] / state['elapsed']:.0f}")
            log(f"{name} step {state['step']} loss {recent:.3f} lr {opt.param_groups[0]['lr']:.2e} "
                f"{state['tokens'] / state['elapsed']:.0f} tok/s {state['elapsed']:.0f}s")

    def on_save() -> None:
        # Held-out loss at each checkpoint: the curve shows whether more budget
        # still helps or only memorises the small prose split.
        log(f"{name} step {state['step']} val " +
            " ".join(f"{t} {val_loss(model, t, windows=32):.3f}" for t in TYPES))

    train_for_budget(model, opt, state, budget=budget, peak_lr=recipe["lr"], warmup_share=0.04,
                     batch_loss=batch_loss, checkpoint=ck, save_every_s=300, desc=name,
                     on_step=on_step, on_save=on_save, mininterval=10)
    losses = {t: val_loss(model, t) for t in TYPES}
    summary = {"parameters": nparams, "shape": recipe["shape"], "budget_s": budget,
               "lr": recipe["lr"], "batch": recipe["batch"], "seq_len": SEQ_LEN,
               "steps": state["step"], "tokens": state["tokens"], "budgets": state["budgets"],
               "train_loss_last100": statistics.mean(state["losses"][-100:]),
               "val_loss": losses, "prose_fraction": PROSE_FRACTION}
    log(f"{name}: done {json.dumps(summary)}")
    out = MODELS / ("target" if name == "target" else "draft-generic")
    save_model(model, tok, out)
    (RUNS / f"{name}-summary.json").write_text(json.dumps(summary, indent=2))


def save_model(model, tok, out: Path) -> None:
    """Save as bf16 safetensors plus the tokenizer: the repository ships these bytes."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    tok.save_pretrained(out)


def step_target(args: argparse.Namespace) -> None:
    train("target", args)


def step_draft(args: argparse.Namespace) -> None:
    train("draft", args)


# Seconds of target sampling + KL training; half of it sampling, because a 2.6M draft
# overfits a small sample set when trained over it for dozens of epochs.
DISTILL_BUDGET = 1500
DISTILL_SAMPLE_SHARE = 0.5
DISTILL_SAMPLES = 4096


def step_distill(args: argparse.Namespace) -> None:
    """Distill the generic draft toward the target with ``specd_cli.distill`` (resumable)."""
    from specd_cli import distill

    corpus = RUNS / "corpus"
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    dargs = parser.parse_args([
        "--target", str(MODELS / "target"), "--draft", str(MODELS / "draft-generic"),
        "--data", *[str(corpus / f"{t}_train.txt") for t in TYPES],
        "--eval-data", *[str(corpus / f"{t}_val.txt") for t in TYPES],
        "--out", str(MODELS / "draft-distilled"), "--work", str(RUNS / "distill-work"),
        "--time-budget", str(args.budget or DISTILL_BUDGET), "--threads", str(args.threads),
        "--sample-share", str(DISTILL_SAMPLE_SHARE), "--samples", str(DISTILL_SAMPLES),
        "--prompt-tokens", str(PROMPT_TOKENS), "--eval-prompts", str(EVAL_PROMPTS),
        "--eval-new-tokens", str(EVAL_NEW_TOKENS)])
    if distill.run(dargs) != 0:
        raise SystemExit("distillation failed")
    # The report stays with the work files: the card carries its figures.
    (MODELS / "draft-distilled" / "distill_report.json").replace(RUNS / "distill_report.json")


# ----------------------------------------------------------------------------- cards

@torch.no_grad()
def forward_ms(model, n_tokens: int, prefix: int = 128, reps: int = 40) -> float:
    """Median wall time (ms) of one cached forward of ``n_tokens`` after ``prefix`` tokens."""
    from transformers import DynamicCache

    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prefix + n_tokens), generator=gen)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
    times = []
    for _ in range(reps + 5):
        t0 = time.perf_counter()
        model(input_ids=ids[:, prefix:], cache=cache, use_cache=True, logits_to_keep=n_tokens)
        times.append(time.perf_counter() - t0)
        cache.crop(-n_tokens)
    return 1000 * statistics.median(times[5:])


def _table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])


def step_cards(args: argparse.Namespace) -> None:
    """Measure each shipped model and write its README.md model card and card.json."""
    from transformers import AutoModelForCausalLM

    summaries = {"target": json.loads((RUNS / "target-summary.json").read_text()),
                 "draft-generic": json.loads((RUNS / "draft-summary.json").read_text())}
    report = json.loads((RUNS / "distill_report.json").read_text())
    acc = {"draft-generic": report["before"], "draft-distilled": report["after"]}
    names = ("target", "draft-generic", "draft-distilled")
    cards = {}
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32)
        cost = {}
        for dtype in ("float32", "bfloat16"):
            model.to(getattr(torch, dtype))
            cost[dtype] = {str(n): forward_ms(model, n) for n in (1, 5)}
        model.float()
        files = sorted(f for f in (MODELS / name).iterdir() if f.is_file())
        card = {"name": name, "parameters": sum(p.numel() for p in model.parameters()),
                "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size,
                "vocab": model.config.vocab_size, "bytes": sum(f.stat().st_size for f in files),
                "forward_ms": cost, "forward_threads": torch.get_num_threads(),
                "val_loss": {t: val_loss(model, t) for t in TYPES}}
        if name in summaries:
            card["training"] = {k: summaries[name][k] for k in
                                ("budget_s", "steps", "tokens", "lr", "batch", "seq_len",
                                 "train_loss_last100", "prose_fraction")}
            card["training"]["budgets"] = summaries[name].get("budgets", [summaries[name]["budget_s"]])
        else:
            card["training"] = {k: report[k] for k in
                                ("samples", "prompt_tokens", "new_tokens", "top_k", "sampling_dtype", "sampling_s",
                                 "training_s", "steps", "batch_size", "lr", "kl_first", "kl_last")}
            card["training"]["from"] = "draft-generic"
        if name in acc:
            card["acceptance_vs_target"] = {t: acc[name][f"{t}_val"] for t in TYPES}
        cards[name] = card
        log(f"{name}: {json.dumps(card)}")
    for name in names:
        (MODELS / name / "card.json").write_text(json.dumps(cards[name], indent=2) + "\n")
        (MODELS / name / "README.md").write_text(_card_markdown(name, cards))
    (RUNS / "cards.json").write_text(json.dumps(cards, indent=2))


def _card_markdown(name: str, cards: dict) -> str:
    c = cards[name]
    tr = c["training"]
    docs = corpus_docs()
    split = {t: f"{len(docs[t]['val'])} of {len(docs[t]['val']) + len(docs[t]['train'])}" for t in TYPES}
    cost = c["forward_ms"]
    t_cost = cards["target"]["forward_ms"]["float32"]
    what = {
        "target": "the demo **target**: a LlamaForCausalLM trained from scratch on the corpus.",
        "draft-generic": "the **generic draft**: a small LlamaForCausalLM trained on the corpus only.",
        "draft-distilled": "the **distilled draft**: the generic draft after `specd distill` against "
                           "the target (KL to the target's next-token probabilities on "
                           "target-sampled text).",
    }[name]
    parts = [f"# specd demo pair: {name}\n", f"This is {what} It ships with specd so that "
             "`specd serve` works on a machine with no model hub. It is a toy: it writes "
             "Python-flavoured text, nothing more.\n",
             "## Corpus\n",
             "The Python 3.11 standard library's own source (all `.py` files under the "
             "interpreter's lib dir, test packages excluded) as task type **code**, and the "
             "English help topics in `pydoc_data/topics.py` as task type **prose** (sampled at "
             f"{PROSE_FRACTION:.0%} of training sequences, about 3x its share of the text). "
             f"A stable hash holds out {split['code']} code files and {split['prose']} prose "
             "blocks (12-paragraph pieces of topics) for validation losses and held-out prompts. "
             "Tokenizer: byte-level BPE, vocabulary "
             f"{c['vocab']}, trained on the training split; shared by all three models.\n",
             "## Model\n",
             _table([["layers", "hidden", "parameters", "weights"],
                     [str(c["layers"]), str(c["hidden"]), f"{c['parameters'] / 1e6:.2f}M",
                      f"bf16 safetensors, {c['bytes'] / 2**20:.1f} MiB with tokenizer"]]) + "\n",
             f"Cost of one forward with a 128-token KV cache, batch 1, {c['forward_threads']} CPU "
             "threads (median of 40, ms):\n",
             _table([["dtype", "1 token", "5 tokens"]] +
                    [[d, f"{cost[d]['1']:.2f}", f"{cost[d]['5']:.2f}"] for d in cost]) + "\n"]
    if name != "target":
        parts.append(f"The target costs {t_cost['1'] / cost['float32']['1']:.1f}x this model per "
                     f"1-token forward in fp32 ({t_cost['5'] / cost['float32']['5']:.1f}x at 5 tokens).\n")
    parts.append("## Training\n")
    if "budget_s" in tr:
        parts.append(f"From random initialisation, {tr['budget_s']:.0f} s of wall-clock training on "
                     f"2 CPU threads with bf16 autocast: {tr['steps']} steps of {tr['batch']} x "
                     f"{tr['seq_len']} tokens ({tr['tokens'] / 1e6:.2f}M tokens), AdamW, peak lr "
                     f"{tr['lr']}, warm-up then cosine decay on elapsed time. Final training loss "
                     f"(mean of the last 100 steps): {tr['train_loss_last100']:.3f} nats.\n")
        if len(tr["budgets"]) > 1:
            parts.append(f"It was trained in {len(tr['budgets'])} runs: the first to "
                         f"{tr['budgets'][0]:.0f} s, then resumed with the budget extended to " +
                         ", then ".join(f"{b:.0f} s" for b in tr["budgets"][1:]) +
                         " (a warm restart: the learning rate rose back to where the longer cosine "
                         "schedule puts it and decayed to the new end).\n")
    else:
        parts.append(f"From `draft-generic`: {tr['samples']} sequences sampled from the target at "
                     f"temperature 1 under {tr['sampling_dtype']} ({tr['prompt_tokens']}-token prompts "
                     f"from the training text, "
                     f"{tr['new_tokens']} new tokens) in {tr['sampling_s']:.0f} s, keeping the "
                     f"target's top-{tr['top_k']} probabilities at every position; then "
                     f"{tr['training_s']:.0f} s ({tr['steps']} steps of {tr['batch_size']} sequences, "
                     f"lr {tr['lr']}) minimising the cross-entropy to those distributions. KL to the "
                     f"target fell from {tr['kl_first']:.3f} to {tr['kl_last']:.3f} nats per token "
                     "on the training batches.\n")
    if name == "target":
        margin = {t: cards["draft-generic"]["val_loss"][t] - c["val_loss"][t] for t in TYPES}
        ok = all(m >= 0.3 for m in margin.values())
        parts.append(f"Average throughput over the budget: {tr['tokens'] / tr['budget_s']:.0f} "
                     "tokens/s (the first run shared the CPU with other work; alone it trains at ~1,370).\n")
        parts.append(("**Quality check: passed.** " if ok else "**Quality check: FAILED.** ") +
                     "The project asks the target to be at least 0.3 nats per token better than "
                     "the draft on held-out text; margins over draft-generic: " +
                     ", ".join(f"{t} {m:+.3f}" for t, m in margin.items()) +
                     ("." if ok else ". This target is under-trained for its size and needs a "
                      "longer (or faster) training run.") + "\n")
    parts.append("Validation loss (nats per token, held-out text):\n")
    parts.append(_table([["model"] + list(TYPES)] +
                        [[n + (" (this)" if n == name else "")] +
                         [f"{cards[n]['val_loss'][t]:.3f}" for t in TYPES] for n in cards]) + "\n")
    parts.append(f"## Acceptance against the target\n\nOn {EVAL_PROMPTS} held-out prompts of each "
                 f"type ({PROMPT_TOKENS} tokens, {EVAL_NEW_TOKENS} generated), measured by "
                 "`specd_cli.distill.measure_acceptance` in fp32: greedy match per token, tokens per "
                 "target step in greedy speculative decoding at γ=4 (exact simulation), and sampled "
                 "α = E[Σ min(p, q)] at temperature 1.\n")
    rows = [["draft", "task", "greedy match", "tokens/step (γ=4)", "α (T=1)"]]
    for n in ("draft-generic", "draft-distilled"):
        for t in TYPES:
            a = cards[n]["acceptance_vs_target"][t]
            rows.append([n, t, f"{a['greedy_match']:.3f}", f"{a['tokens_per_step']:.2f}",
                         f"{a['alpha']:.3f}"])
    parts.append(_table(rows) + "\n")
    parts.append("## Reproduce\n\n```\npython scripts/make_demo_pair.py          # all steps\n"
                 "python scripts/make_demo_pair.py --step cards   # re-measure only\n```\n"
                 "Timings vary with the machine, so a rerun gives similar, not identical, weights.\n")
    return "\n".join(parts)


STEPS = {"corpus": step_corpus, "tokenizer": step_tokenizer, "target": step_target,
         "draft": step_draft, "distill": step_distill, "cards": step_cards}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=list(STEPS), action="append",
                   help="run only this step (repeatable); default: all, in order")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--budget", type=float, default=0,
                   help="override the training budget in seconds (target/draft/distill)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for name in args.step or list(STEPS):
        log(f"step {name}")
        STEPS[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
