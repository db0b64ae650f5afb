"""``specd distill``: train a draft model to agree with its target.

A draft agrees with its target most often when it learns from the target's own
outputs rather than from generic text. This module trains it so, for any pair of transformers causal LMs that
share a tokenizer, in three stages, each checkpointed in a work folder so that an
interrupted run resumes where it stopped:

1. **Sample** continuations from the target (temperature 1, under bf16 autocast where
   the CPU has bfloat16 kernels, unless ``--fp32-sampling``) for prompts cut from the ``--data`` files, keeping the
   target's top-k next-token probabilities at every position of every sequence.
2. **Train** the draft to match those distributions (DistillSpec-style forward KL
   to the target's probabilities at every position of target-sampled sequences, or
   with ``--divergence tvd`` their total variation distance, 1 − α).
   Plain next-token training on target completions is *not* used: it teaches the
   draft one sampled token per position and overfits a small sample set (the
   figures: README, "The demo pair and `specd distill`").
3. **Measure** acceptance before and after on held-out prompts with
   :func:`measure_acceptance`, and write the draft (safetensors + tokenizer) and a
   JSON report to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from gateway.stats.costmodel import expected_tokens
from specd.devices import bf16_is_fast
from specd.worker import hub, sharing
from specd.worker.sharing import SubsetHead
from specd_cli.training import resume, save_atomic, train_for_budget

__all__ = ["add_arguments", "run", "measure_acceptance", "check_same_tokenizer",
           "sample_prompts", "speculative_steps"]

# What draft training minimises (see _distill_loss).
DIVERGENCES = ("fkl", "tvd")


# ------------------------------------------------------------------------ arguments

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``specd distill``'s options to ``parser``."""
    parser.add_argument("--target", required=True, help="target model: a folder, a .gguf file or a hub id")
    parser.add_argument("--draft", default=None,
                        help="draft model folder to start from; must share the target's tokenizer (default: "
                             "a new draft made from the target alone, see --layers)")
    parser.add_argument("--layers", type=int, default=4,
                        help="without --draft: the new draft's decoder layers, copied from the target's first "
                             "ones; it shares the target's embedding (default 4)")
    parser.add_argument("--draft-vocabulary", type=int, default=8192, metavar="TOKENS",
                        help="without --draft: the tokens the new draft proposes, those the target emits most "
                             "on the training prompts (default 8192)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+", metavar="FILE",
                        help="text files to cut prompts from; without --eval-data the last "
                             "10%% of each is held out for evaluation")
    source.add_argument("--questions", metavar="FILE",
                        help="chat requests, one a line, each rendered as a user message with the target's "
                             "chat template; without --eval-questions the last 10%% are held out")
    parser.add_argument("--eval-data", nargs="+", metavar="FILE", default=None,
                        help="held-out text files, one report entry per file (default: the "
                             "held-out tail of each --data file)")
    parser.add_argument("--eval-questions", metavar="FILE", default=None,
                        help="held-out chat requests, one a line (with --questions)")
    parser.add_argument("--greedy-share", type=float, default=None,
                        help="share of the target's continuations decoded greedily, the rest sampled at "
                             "temperature 1 (default: 0.5 with --questions, else 0)")
    parser.add_argument("--out", required=True,
                        help="folder for the distilled draft and distill_report.json")
    parser.add_argument("--work", default=None,
                        help="folder for resumable checkpoints (default: OUT/checkpoints)")
    parser.add_argument("--time-budget", type=float, default=600.0, metavar="SECONDS",
                        help="seconds for sampling + training, not counting evaluation (default 600)")
    parser.add_argument("--sample-share", type=float, default=0.35,
                        help="largest share of the time budget spent sampling the target (default 0.35)")
    parser.add_argument("--samples", type=int, default=2048,
                        help="target-sampled sequences to make at most (default 2048)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default 32)")
    parser.add_argument("--new-tokens", type=int, default=128,
                        help="tokens sampled from the target per sequence (default 128)")
    parser.add_argument("--top-k", type=int, default=64,
                        help="target probabilities kept per position; the rest is one bucket (default 64)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per training batch (default 32)")
    parser.add_argument("--sample-batch-size", type=int, default=64,
                        help="sequences sampled from the target at once (default 64)")
    parser.add_argument("--fp32-sampling", action="store_true",
                        help="sample the target in fp32 (default: bf16 autocast where the CPU has "
                             "bfloat16 kernels (AVX512-BF16, AMX): about 2x faster with AMX; fp32 elsewhere, "
                             "where bf16 is emulated; acceptance is always measured in fp32)")
    parser.add_argument("--divergence", choices=DIVERGENCES, default="fkl",
                        help="what training minimises: fkl, forward KL to the target (default), or "
                             "tvd, total variation distance, i.e. 1 - acceptance")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    parser.add_argument("--eval-prompts", type=int, default=100,
                        help="held-out prompts per evaluation file (default 100)")
    parser.add_argument("--eval-new-tokens", type=int, default=64,
                        help="tokens generated per held-out prompt (default 64)")
    parser.add_argument("--gamma", type=int, default=4, help="draft tokens per step for tokens/step (default 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


# ---------------------------------------------------------------------- tokenizers

def check_same_tokenizer(target_dir: str | Path, draft_dir: str | Path):
    """Load both tokenizers and return the target's; raise ``ValueError`` if they differ.

    Speculative decoding compares token ids, so the two vocabularies must be
    identical id for id, not merely similar.
    """
    from transformers import AutoTokenizer

    tt = AutoTokenizer.from_pretrained(target_dir)
    dt = AutoTokenizer.from_pretrained(draft_dir)
    tv, dv = tt.get_vocab(), dt.get_vocab()
    if tv != dv:
        only_t = len(tv.keys() - dv.keys())
        only_d = len(dv.keys() - tv.keys())
        moved = sum(1 for k in tv.keys() & dv.keys() if tv[k] != dv[k])
        raise ValueError(
            f"draft {draft_dir} and target {target_dir} do not share a tokenizer: "
            f"{len(tv)} vs {len(dv)} tokens, {only_t} only in the target, {only_d} only in "
            f"the draft, {moved} with different ids. Speculative decoding needs one vocabulary.")
    return tt


# ------------------------------------------------------------------------- prompts

def sample_prompts(tokenizer, text: str, n: int, length: int, rng: random.Random) -> list[list[int]]:
    """Cut ``n`` prompts of exactly ``length`` tokens from random places in ``text``.

    Each prompt is tokenized from a slice of text and its first token dropped (it may
    be a fragment of a word cut mid-way); windows that cross an end-of-text marker
    are skipped so a prompt never spans two documents.
    """
    eos = tokenizer.eos_token
    span = length * 12  # characters: enough for `length` tokens at any sane ratio
    if len(text) <= span:
        raise ValueError(f"text of {len(text)} characters is too short for {length}-token prompts")
    prompts: list[list[int]] = []
    tries = 0
    while len(prompts) < n:
        tries += 1
        if tries > 50 * n:
            raise ValueError(f"could not cut {n} prompts of {length} tokens from the text")
        start = rng.randrange(0, len(text) - span)
        ids = tokenizer(text[start:start + span], add_special_tokens=False)["input_ids"][1:1 + length]
        if len(ids) < length or (eos and eos in tokenizer.decode(ids)):
            continue
        prompts.append(ids)
    return prompts


# ---------------------------------------------------------------------- generation

@torch.no_grad()
def _generate(model, prompts: torch.Tensor, new_tokens: int, temperature: float,
              generator: torch.Generator | None = None, top_k: int = 0, bf16: bool = False):
    """Continue equal-length ``prompts`` [B, P] by ``new_tokens`` tokens with a KV cache.

    ``temperature`` 0 is greedy. With ``top_k`` > 0 also return the model's top-k
    next-token probabilities at every position but the last ([B, P+N-1, k] ids and
    probabilities): sampling computes them anyway, so keeping them costs nothing.
    ``bf16`` runs the forwards under bf16 autocast (faster; the probabilities move by
    the rounding of bf16 logits, a few percent at most).
    """
    from transformers import DynamicCache

    def forward(**kwargs):
        with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=bf16):
            return model(**kwargs)

    cache = DynamicCache(config=model.config)
    out = forward(input_ids=prompts, cache=cache, use_cache=True)
    logits = out.logits.float()
    seqs, top_ids, top_probs = [prompts], [], []
    for i in range(new_tokens):
        probs = None
        if top_k:
            probs = logits.softmax(-1)
            p, ids = probs.topk(top_k, dim=-1)
            top_ids.append(ids.to(torch.int32))
            top_probs.append(p.to(torch.float16))
        last = logits[:, -1]
        if temperature == 0:
            nxt = last.argmax(-1, keepdim=True)
        else:
            pl = probs[:, -1] if probs is not None and temperature == 1 else (last / temperature).softmax(-1)
            nxt = torch.multinomial(pl, 1, generator=generator)
        seqs.append(nxt)
        if i + 1 < new_tokens:  # the last token's successor is never needed
            out = forward(input_ids=nxt, cache=out.cache, use_cache=True)
            logits = out.logits.float()
    seq = torch.cat(seqs, dim=1)
    if top_k:
        return seq, torch.cat(top_ids, dim=1), torch.cat(top_probs, dim=1)
    return seq


# ---------------------------------------------------------------------- acceptance

def speculative_steps(matches: list[bool], gamma: int) -> int:
    """Verification steps greedy speculative decoding takes to emit ``len(matches)`` tokens.

    ``matches[i]`` says whether the draft's greedy token equals the target's at
    position i of the target's greedy continuation. Each step the draft proposes up
    to ``gamma`` tokens; the leading run that matches is accepted and the target adds
    one token of its own (the correction, or the bonus after a full run). While the
    draft agrees, its proposals are exactly its greedy tokens on the target's own
    prefix, so this simulation equals running the decoder.
    """
    return speculative_steps_by_depth([matches] * gamma, gamma)


def speculative_steps_by_depth(matches: list[list[bool]], gamma: int) -> int:
    """`speculative_steps` for a draft whose token depends on its place in a proposal (one
    that reads its own earlier predictions): ``matches[k][i]`` is whether the (k+1)-th
    token of a proposal is right at position i, so a proposal starting at s accepts while
    ``matches[k][s + k]`` holds."""
    i = steps = 0
    n = len(matches[0])
    while i < n:
        k = 0
        while k < gamma and i + k < n and matches[k][i + k]:
            k += 1
        i += k + 1
        steps += 1
    return steps


@torch.no_grad()
def measure_acceptance(target, draft, prompts_ids, gamma: int = 4, max_new_tokens: int = 64,
                       batch_size: int = 16, seed: int = 0, progress: bool = True) -> dict:
    """Measure how well ``draft`` predicts ``target`` on continuations of ``prompts_ids``.

    ``prompts_ids`` is a list of token-id lists (prompts of equal length are batched).
    Both models are run as loaded (use fp32 for exact figures). Returns:

    - ``greedy_match``: fraction of the target's greedy tokens that the draft's greedy
      choice on the same prefix equals;
    - ``tokens_per_step``: tokens emitted per target verification in greedy
      speculative decoding with ``gamma`` proposals (simulated exactly, see
      :func:`speculative_steps`), counting the target's own token each step;
    - ``alpha``: sampled acceptance rate E[sum_v min(p(v), q(v))] at temperature 1,
      averaged over every position of target-sampled continuations (p target, q draft);
    - ``expected_tokens_per_step_sampled``: (1 - alpha^(gamma+1)) / (1 - alpha)
      (`gateway.stats.costmodel.expected_tokens`), the standard formula for sampled decoding if
      acceptances were independent;
    - ``prompts``, ``new_tokens``, ``gamma``.

    Continuations run for ``max_new_tokens`` whether or not the target emits its
    end-of-text token, so every prompt contributes the same number of positions.
    """
    target.eval()
    draft.eval()
    gen = torch.Generator().manual_seed(seed)
    groups: dict[int, list[list[int]]] = {}
    for p in prompts_ids:
        groups.setdefault(len(p), []).append(list(p))
    matched = positions = steps = 0
    alpha_sum = 0.0
    batches = [(plen, ps[i:i + batch_size]) for plen, ps in groups.items()
               for i in range(0, len(ps), batch_size)]
    for plen, batch in tqdm(batches, desc="acceptance", disable=not progress, leave=False):
        x = torch.tensor(batch, dtype=torch.long)
        # Greedy: the target's continuation, then the draft's argmax on each prefix.
        seq = _generate(target, x, max_new_tokens, temperature=0)
        dpred = draft(seq[:, :-1]).logits[:, plen - 1:].argmax(-1)
        m = dpred == seq[:, plen:]
        matched += int(m.sum())
        positions += m.numel()
        steps += sum(speculative_steps(row.tolist(), gamma) for row in m)
        # Sampled: overlap of the two distributions along target-sampled text.
        seq = _generate(target, x, max_new_tokens, temperature=1.0, generator=gen)
        p = target(seq[:, :-1]).logits[:, plen - 1:].float().softmax(-1)
        q = draft(seq[:, :-1]).logits[:, plen - 1:].float().softmax(-1)
        alpha_sum += float(torch.minimum(p, q).sum(-1).sum())
    alpha = alpha_sum / positions
    return {"greedy_match": matched / positions, "tokens_per_step": positions / steps,
            "alpha": alpha, "expected_tokens_per_step_sampled": expected_tokens(alpha, gamma),
            "prompts": len(prompts_ids), "new_tokens": max_new_tokens, "gamma": gamma}


# ------------------------------------------------------------------------ training

def _distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor,
                  divergence: str = "fkl", mask: torch.Tensor | None = None,
                  index_of: torch.Tensor | None = None):
    """The draft's distance to the target's top-k distribution plus a tail bucket.

    The target's distribution is kept as its k most likely tokens and one bucket
    holding the remaining mass; the draft is scored on the same partition, so no mass
    is silently dropped. A draft over part of the vocabulary (`index_of`: each token's
    column in `logits`, −1 outside it) puts the target's mass on tokens it cannot
    propose into the bucket. `mask` weighs the positions (0: past the end of a sequence).
    ``fkl`` minimises the exact cross-entropy between the two coarsened
    distributions (forward KL plus the target's constant entropy); ``tvd``
    minimises their total variation distance, which is 1 − α on that partition: the
    rejection rate itself (DistillSpec's TVD objective; on the demo pair forward KL
    did better, see the README).
    Returns (mean loss, mean KL) per position; the KL is reported whatever the loss.
    """
    logq = logits.float().log_softmax(-1)
    ids = top_ids.long()
    p = top_probs.float()
    inside = None
    if index_of is not None:
        ids = index_of[ids]
        inside = ids >= 0
        ids, p = ids.clamp_min(0), p * inside
    logq_top = logq.gather(-1, ids)
    rest_p = (1 - p.sum(-1)).clamp_min(0)
    q_top = logq_top.exp() if inside is None else logq_top.exp() * inside
    rest_logq = torch.log1p(-q_top.sum(-1).clamp(max=1 - 1e-6))
    ce = -(p * logq_top).sum(-1) - rest_p * rest_logq
    weight = torch.ones_like(ce) if mask is None else mask.float()
    count = weight.sum().clamp_min(1)
    with torch.no_grad():
        ent = -(p * p.clamp_min(1e-12).log()).sum(-1) - rest_p * rest_p.clamp_min(1e-12).log()
    kl = ((ce.detach() - ent) * weight).sum() / count
    if divergence == "tvd":
        rest_q = (1 - q_top.sum(-1)).clamp_min(0)
        tvd = 0.5 * ((p - q_top).abs().sum(-1) + (rest_p - rest_q).abs())
        return (tvd * weight).sum() / count, kl
    return (ce * weight).sum() / count, kl


def _load_causal_lm(path):
    from transformers import AutoModelForCausalLM

    # fp32 whatever the stored dtype: exact acceptance figures, and fp32 master
    # weights for training under bf16 autocast.
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question as a user message, rendered with the tokenizer's chat template up to
    the assistant's turn: the prompts a chat server's target continues."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for q in questions]


def _valid_positions(seq: torch.Tensor, prompt_len: int, eos_ids: list[int]) -> torch.Tensor:
    """Per row of `seq` [B, L], the leading positions whose next token counts: up to the
    one that predicts the continuation's first EOS (what follows it is never served)."""
    continuation = seq[:, prompt_len:]
    ended = torch.isin(continuation, torch.tensor(eos_ids, dtype=seq.dtype))
    first = torch.where(ended.any(1), ended.int().argmax(1), continuation.shape[1] - 1)
    return prompt_len + first


def _sample_target(target, draw, eos_ids: list[int], args, path: Path) -> dict:
    """Stage 1: continue prompts with the target, greedily for ``--greedy-share`` of the
    batches and at temperature 1 for the rest, keeping its top-k distribution at every
    position; stops at ``--samples`` or the sampling share of the budget.

    ``draw(n, rng)`` gives the next ``n`` prompts, of one length. Checkpointed about once
    a minute; a finished set is marked done so a resumed run trains on exactly the same
    data.
    """
    samples: dict[str, Any] = torch.load(path) if path.exists() else \
        {"seqs": [], "top_ids": [], "top_probs": [], "valid": [], "elapsed": 0.0, "done": False}
    budget = args.time_budget * args.sample_share
    have = sum(len(s) for s in samples["seqs"])
    # Seeded by progress so that a resumed run draws new prompts, not the same ones.
    gen = torch.Generator().manual_seed(args.seed + have)
    rng = random.Random(args.seed * 1_000_003 + have)
    last_save = time.monotonic()
    bar = tqdm(total=args.samples, initial=have, desc="sampling target", unit="seq")
    while not samples["done"] and have < args.samples and samples["elapsed"] < budget:
        t0 = time.monotonic()
        prompts = draw(min(args.sample_batch_size, args.samples - have), rng)
        temperature = 0.0 if rng.random() < args.greedy_share else 1.0
        seq, ids, probs = _generate(target, torch.tensor(prompts), args.new_tokens, temperature, gen,
                                    args.top_k, bf16=_bf16(args))
        samples["seqs"].append(seq)
        samples["top_ids"].append(ids)
        samples["top_probs"].append(probs)
        samples["valid"].append(_valid_positions(seq, len(prompts[0]), eos_ids))
        n = len(prompts)
        samples["elapsed"] += time.monotonic() - t0
        have += n
        bar.update(n)
        if time.monotonic() - last_save > 60:
            save_atomic(samples, path)
            last_save = time.monotonic()
    bar.close()
    if not samples["done"]:
        samples["done"] = True
        save_atomic(samples, path)
    return samples


def _train_draft(draft, samples: dict, budget: float, args, path: Path) -> dict:
    """Stage 2: train ``draft`` in place toward the sampled target distributions for
    ``budget`` seconds (AdamW, under bf16 autocast where the CPU has bfloat16 kernels);
    checkpointed about once a minute.
    Returns the training state (elapsed seconds, steps, per-step KL)."""
    # Rows of the sampled batches, which may differ in length (chat prompts do): a training
    # batch pads its rows to the longest, the padding masked out.
    rows = [(b, r) for b, seq in enumerate(samples["seqs"]) for r in range(len(seq))]
    subset = isinstance(draft.lm_head, SubsetHead)
    index_of = None
    if subset:  # each token's column in the draft's head, -1 for a token it never proposes
        index_of = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
        index_of[draft.lm_head.ids] = torch.arange(len(draft.lm_head.ids))
    trained = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def batch(picked: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        length = max(int(samples["valid"][b][r]) for b, r in picked)
        k = samples["top_ids"][0].shape[-1]
        ids = torch.zeros((len(picked), length), dtype=torch.long)
        top_ids = torch.zeros((len(picked), length, k), dtype=torch.int32)
        top_probs = torch.zeros((len(picked), length, k), dtype=torch.float16)
        mask = torch.zeros((len(picked), length), dtype=torch.bool)
        for i, (b, r) in enumerate(picked):
            n = int(samples["valid"][b][r])
            ids[i, :n] = samples["seqs"][b][r, :n]
            top_ids[i, :n] = samples["top_ids"][b][r, :n]
            top_probs[i, :n] = samples["top_probs"][b][r, :n]
            mask[i, :n] = True
        return ids, top_ids, top_probs, mask

    def check(saved: dict) -> None:
        # A checkpoint from before --divergence existed was trained on forward KL.
        trained_on = saved.get("divergence", "fkl")
        if trained_on != args.divergence:
            raise ValueError(f"{path} was trained with --divergence {trained_on}; resume with that, "
                             f"or give a new --work folder to train with {args.divergence}")

    state = resume(path, draft, opt, check) or {"elapsed": 0.0, "step": 0, "kl": [], "divergence": args.divergence}
    order: list[int] = []

    def batch_loss() -> torch.Tensor:
        nonlocal order
        if len(order) < args.batch_size:
            order = torch.randperm(len(rows)).tolist()
        ids, top_ids, top_probs, mask = batch([rows[order.pop()] for _ in range(args.batch_size)])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_is_fast(torch.device("cpu"))):
            if subset:  # the scores over the draft's own vocabulary, not the whole one it pads to
                logits = draft.lm_head.linear(draft.model(input_ids=ids).last_hidden_state)
            else:
                logits = draft(ids).logits
        loss, kl = _distill_loss(logits, top_ids, top_probs, args.divergence, mask, index_of)
        state["kl"].append(float(kl))
        return loss

    def on_step(state: dict, bar: tqdm) -> None:
        if state["step"] % 10 == 0:
            bar.set_postfix(kl=f"{sum(state['kl'][-10:]) / 10:.3f}", step=state["step"])

    train_for_budget(draft, opt, state, budget=budget, peak_lr=args.lr, warmup_share=0.05, warmup_floor=0.02,
                     batch_loss=batch_loss, checkpoint=path, save_every_s=60, desc="distilling draft",
                     on_step=on_step)
    draft.eval()
    return state


def _stored_dtype(path) -> torch.dtype:
    # Save the distilled draft in the dtype the input draft was shipped in (bf16 keeps
    # the repository small); the in-memory model is fp32 either way.
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(path), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _vocabulary(samples: dict, size: int, eos_ids: list[int]) -> list[int]:
    """The `size` tokens the target emitted most in `samples` (up to each row's end), and
    its EOS ids: a new draft's vocabulary."""
    emitted = torch.cat([row[:n + 1] for seq, valid in zip(samples["seqs"], samples["valid"])
                         for row, n in zip(seq, valid.tolist())])
    counts = torch.bincount(emitted)
    ranked = [t for t in counts.argsort(descending=True).tolist() if counts[t] > 0]
    chosen = list(dict.fromkeys(eos_ids + ranked))[:size]
    return sorted(chosen)


def _prompts(args, tok) -> tuple[Any, dict[str, list[list[int]]]]:
    """A function drawing the training prompts (n of one length at a time), and the
    held-out prompts by name."""
    rng = random.Random(args.seed + 1)
    if args.questions:
        questions = [q for q in Path(args.questions).read_text(encoding="utf-8").splitlines() if q.strip()]
        if args.eval_questions:
            held = [q for q in Path(args.eval_questions).read_text(encoding="utf-8").splitlines() if q.strip()]
        else:
            cut = int(len(questions) * 0.9)
            questions, held = questions[:cut], questions[cut:]
        by_length: dict[int, list[list[int]]] = {}
        for prompt in chat_prompts(tok, questions):
            by_length.setdefault(len(prompt), []).append(prompt)
        lengths = sorted(by_length)

        def draw_questions(n: int, rng: random.Random) -> list[list[int]]:
            group = by_length[rng.choice(lengths)]  # one length, so that a batch needs no padding
            return [rng.choice(group) for _ in range(n)]

        return draw_questions, {"chat": chat_prompts(tok, held[:args.eval_prompts])}
    # Text: training prompts from each data file, held-out ones from --eval-data or from
    # the tail of each data file that training never sees.
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.data]
    if args.eval_data:
        train_texts = texts
        evals = {Path(f).stem: Path(f).read_text(encoding="utf-8", errors="replace") for f in args.eval_data}
    else:
        ends = [int(len(t) * 0.9) for t in texts]
        train_texts = [t[:c] for t, c in zip(texts, ends)]
        evals = {Path(f).stem: t[c:] for f, t, c in zip(args.data, texts, ends)}
    drawn = 0

    def draw_text(n: int, rng: random.Random) -> list[list[int]]:
        nonlocal drawn  # prompts cycle through the files, so each file (task type) gets an equal share
        prompts = [sample_prompts(tok, train_texts[(drawn + i) % len(train_texts)], 1, args.prompt_tokens, rng)[0]
                   for i in range(n)]
        drawn += n
        return prompts

    return draw_text, {name: sample_prompts(tok, text, args.eval_prompts, args.prompt_tokens, rng)
                       for name, text in evals.items()}


def run(args: argparse.Namespace) -> int:
    """Run ``specd distill`` with parsed ``args``; return a process exit status."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.greedy_share is None:
        args.greedy_share = 0.5 if args.questions else 0.0
    try:
        target_dir = hub.resolve(args.target)
        if args.draft:
            tok = check_same_tokenizer(target_dir, args.draft)
        else:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(target_dir)
    except (ValueError, hub.ModelNotFound) as e:
        print(f"specd distill: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "checkpoints"
    work.mkdir(parents=True, exist_ok=True)
    target = _load_causal_lm(target_dir)
    draft = _load_causal_lm(args.draft) if args.draft else None
    if draft is not None and target.config.vocab_size != draft.config.vocab_size:
        print(f"specd distill: vocab sizes differ (target {target.config.vocab_size}, "
              f"draft {draft.config.vocab_size}) although the tokenizers match", file=sys.stderr)
        return 2
    if draft is None and not getattr(target.config, "tie_word_embeddings", False):
        print("specd distill: a draft made from the target alone shares its tied embedding and output layer; "
              f"{args.target} does not tie them. Give a --draft to start from", file=sys.stderr)
        return 2
    target.eval()
    torch.manual_seed(args.seed)
    eos_ids = sorted({*([tok.eos_token_id] if tok.eos_token_id is not None else []),
                      *_config_eos(target)})
    draw, eval_prompts = _prompts(args, tok)

    samples = _sample_target(target, draw, eos_ids, args, work / "samples.pt")
    positions = int(sum(v.sum() for v in samples["valid"]))
    sequences = sum(len(s) for s in samples["seqs"])
    print(f"sampled {sequences} sequences ({positions:,} positions) in {samples['elapsed']:.0f}s", file=sys.stderr)
    if draft is None:
        draft = sharing.build(target, list(range(args.layers)), _vocabulary(samples, args.draft_vocabulary, eos_ids))

    report_path = work / "eval_before.json"
    if report_path.exists():
        before = json.loads(report_path.read_text())
    else:
        before = {name: measure_acceptance(target, draft, ps, args.gamma, args.eval_new_tokens,
                                           seed=args.seed) for name, ps in eval_prompts.items()}
        report_path.write_text(json.dumps(before, indent=2))
    print(f"before: {json.dumps(before)}", file=sys.stderr)
    try:
        state = _train_draft(draft, samples, max(args.time_budget - samples["elapsed"], 0.0), args,
                             work / "train.pt")
    except ValueError as e:
        print(f"specd distill: {e}", file=sys.stderr)
        return 2

    # Stage 3: measure again, write the draft and the report.
    after = {name: measure_acceptance(target, draft, ps, args.gamma, args.eval_new_tokens,
                                      seed=args.seed) for name, ps in eval_prompts.items()}
    out.mkdir(parents=True, exist_ok=True)
    if args.draft:
        draft.to(_stored_dtype(args.draft)).save_pretrained(out, safe_serialization=True)
        draft.float()
    else:
        sharing.save(draft, out, target_dir, hub.model_name(args.target), torch.bfloat16)
    tok.save_pretrained(out)
    kl = state["kl"]
    report = {
        "target": str(args.target), "draft": str(args.draft) if args.draft else None,
        "layers": None if args.draft else args.layers,
        "draft_vocabulary": None if args.draft else len(draft.lm_head.ids),
        "data": args.data, "eval_data": args.eval_data,
        "questions": args.questions, "eval_questions": args.eval_questions, "greedy_share": args.greedy_share,
        "samples": sequences, "positions": positions, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "top_k": args.top_k,
        "sampling_dtype": "bf16-autocast" if _bf16(args) else "float32",
        "sampling_s": samples["elapsed"], "training_s": state["elapsed"],
        "steps": state["step"], "batch_size": args.batch_size, "lr": args.lr, "divergence": args.divergence,
        "kl_first": sum(kl[:10]) / max(len(kl[:10]), 1), "kl_last": sum(kl[-10:]) / max(len(kl[-10:]), 1),
        "before": before, "after": after,
    }
    (out / "distill_report.json").write_text(json.dumps(report, indent=2))
    # The card the workers serve with the draft (`ModelInfo.card_json`): its held-out
    # acceptance is where a gateway first prices the pair's load cap, and what doctor expects.
    (out / "card.json").write_text(json.dumps({"name": out.name, "acceptance_vs_target": after}, indent=2) + "\n")
    for name in after:
        b, a = before[name], after[name]
        print(f"{name}: greedy match {b['greedy_match']:.3f} -> {a['greedy_match']:.3f}, "
              f"tokens/step@{args.gamma} {b['tokens_per_step']:.2f} -> {a['tokens_per_step']:.2f}, "
              f"alpha {b['alpha']:.3f} -> {a['alpha']:.3f}")
    return 0


def _bf16(args: argparse.Namespace) -> bool:
    """Sample the target under bf16 autocast: asked (no --fp32-sampling) and fast here."""
    return not args.fp32_sampling and bf16_is_fast(torch.device("cpu"))


def _config_eos(model) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])


def main(argv: list[str] | None = None) -> int:
    """Run as ``python -m specd_cli.distill`` (the same options as ``specd distill``)."""
    parser = argparse.ArgumentParser(prog="specd distill", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
