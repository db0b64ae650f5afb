"""What a draft that reads the target's features would accept on a target: trained and measured offline.

    python scripts/feature_draft_probe.py --target MODEL --samples WORK/samples.pt \
        --eval-questions data/chat_questions_heldout.txt --out DIR --time-budget 1800

`--samples` is the target's own answers as `specd distill --questions ... --work WORK` keeps
them (tokens and the target's top-64 probabilities at every position). The script computes
the target's features (its last hidden state) over them, trains a `FeatureDraft`
(`specd.worker.featuredraft`) by forward KL to the target's distributions at every depth
of a `--depth`-token proposal, then measures on held-out chat questions what
`specd distill` reports for a token-only draft: greedy match and tokens per step at γ, and
sampled α, here by depth. It also times one token's forward of the draft against a
layer-copy draft's (`--compare-draft`), both on one thread: the c that, with α, decides the
speed-up. specd does not serve such a draft yet: this is how to know what it would give.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specd.devices import bf16_is_fast  # noqa: E402
from specd.worker import hub, sharing  # noqa: E402
from specd.worker.featuredraft import FeatureDraft  # noqa: E402
from specd_cli.distill import (  # noqa: E402
    _config_eos,
    _distill_loss,
    _generate,
    _load_causal_lm,
    _vocabulary,
    chat_prompts,
    speculative_steps_by_depth,
)
from specd_cli.training import resume, save_atomic, train_for_budget  # noqa: E402

DEPTH_WEIGHT = 0.8  # depth k's loss weighs 0.8^(k-1), as EAGLE-3 weighs its unrolled steps


@torch.no_grad()
def target_features(target, samples: dict, path: Path, batch_rows: int = 16) -> list[torch.Tensor]:
    """Per sampled row, the target's features at its counted positions [valid, H] (bf16)."""
    if path.exists():
        return torch.load(path)
    features: list[torch.Tensor] = []
    started = time.monotonic()
    for seq, valid in zip(samples["seqs"], samples["valid"]):  # a sampled batch's rows share a length
        for first in range(0, len(seq), batch_rows):
            counted = valid[first:first + batch_rows].tolist()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_is_fast(torch.device("cpu"))):
                hidden = target.model(input_ids=seq[first:first + batch_rows, :max(counted)]).last_hidden_state
            features += [hidden[i, :n].to(torch.bfloat16) for i, n in enumerate(counted)]
    print(f"features of {len(features)} rows in {time.monotonic() - started:.0f}s", file=sys.stderr)
    save_atomic(features, path)
    return features


def train(draft: FeatureDraft, samples: dict, features: list[torch.Tensor], args, path: Path) -> dict:
    rows = [(b, r) for b, seq in enumerate(samples["seqs"]) for r in range(len(seq))]
    flat = {key: [row for batch in samples[key] for row in batch] for key in ("seqs", "top_ids", "top_probs")}
    index_of = torch.full((draft.head.vocab_size,), -1, dtype=torch.long)
    index_of[draft.head.ids] = torch.arange(len(draft.head.ids))
    trained = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    state = resume(path, draft, opt) or {"elapsed": 0.0, "step": 0, "kl": []}
    order: list[int] = []

    def batch_loss() -> torch.Tensor:
        nonlocal order
        if len(order) < args.batch_size:
            order = torch.randperm(len(rows)).tolist()
        picked = [order.pop() for _ in range(args.batch_size)]
        n = max(len(features[i]) for i in picked) - 1  # draft positions: x_1..x_{valid-1}
        k = flat["top_ids"][0].shape[-1]
        width = features[0].shape[-1]
        ids = torch.zeros((len(picked), n), dtype=torch.long)
        fed = torch.zeros((len(picked), n, width))
        goal = torch.zeros((len(picked), n, width))
        top_ids = torch.zeros((len(picked), n, k), dtype=torch.int32)
        top_probs = torch.zeros((len(picked), n, k), dtype=torch.float16)
        mask = torch.zeros((len(picked), n), dtype=torch.bool)
        for row, i in enumerate(picked):
            m = len(features[i]) - 1
            ids[row, :m] = flat["seqs"][i][1:m + 1]
            fed[row, :m] = features[i][:m].float()
            goal[row, :m] = features[i][1:m + 1].float()
            top_ids[row, :m] = flat["top_ids"][i][1:m + 1]
            top_probs[row, :m] = flat["top_probs"][i][1:m + 1]
            mask[row, :m] = True
        # float32 on every CPU: a trained draft then does not depend on bf16 kernels being there
        predicted = draft.unroll(ids, fed, args.depth)
        loss = torch.zeros(())
        for depth, guess in enumerate(predicted, start=1):
            reach = mask.clone()
            reach[:, :depth - 1] = False  # those indices start no proposal this deep
            scores = draft.head.linear(guess)
            kl_loss, kl = _distill_loss(scores, top_ids, top_probs, "fkl", reach, index_of)
            if depth == 1:
                state["kl"].append(float(kl))
            feature_loss = (torch.nn.functional.smooth_l1_loss(guess.float(), goal, reduction="none").mean(-1)
                            * reach).sum() / reach.sum().clamp_min(1)
            loss = loss + DEPTH_WEIGHT ** (depth - 1) * (kl_loss + args.feature_weight * feature_loss)
        return loss

    def on_step(state: dict, bar) -> None:
        if state["step"] % 10 == 0:
            bar.set_postfix(kl=f"{sum(state['kl'][-10:]) / 10:.3f}", step=state["step"])

    train_for_budget(draft, opt, state, budget=args.time_budget, peak_lr=args.lr, warmup_share=0.05,
                     warmup_floor=0.02, batch_loss=batch_loss, checkpoint=path, save_every_s=60,
                     desc="training feature draft", on_step=on_step)
    draft.eval()
    return state


@torch.no_grad()
def measure(target, draft: FeatureDraft, prompts: list[list[int]], gamma: int, new_tokens: int, seed: int) -> dict:
    """Greedy match and tokens per step at `gamma` (exact for greedy: along an accepted
    proposal the draft's tokens are the target's), and sampled α, by depth."""
    gen = torch.Generator().manual_seed(seed)
    matched = torch.zeros(gamma)
    overlap = torch.zeros(gamma)
    counted = torch.zeros(gamma)
    steps = emitted = 0
    for prompt in prompts:
        x = torch.tensor([prompt])
        plen = len(prompt)
        for sampled in (False, True):
            seq = _generate(target, x, new_tokens, 1.0 if sampled else 0.0, gen if sampled else None)
            hidden = target.model(input_ids=seq).last_hidden_state  # f_0..f_{L-1}
            p = target.lm_head(hidden).softmax(-1)
            # draft index i reads x_{i+1} and f_i and predicts x_{i+2}; the continuation's
            # tokens x_plen.. are predicted at indices plen-2..L-3
            predicted = draft.unroll(seq[:, 1:-1], hidden[:, :-2], gamma)
            first, last = plen - 2, seq.shape[1] - 3
            window = slice(first, last + 1)
            correct = []
            for depth, guess in enumerate(predicted, start=1):
                q = draft.logits(guess[0, window]).softmax(-1)
                if sampled:
                    overlap[depth - 1] += float(torch.minimum(p[0, 1:-1][window], q).sum())
                else:
                    hits = q.argmax(-1) == seq[0, plen:]
                    matched[depth - 1] += float(hits.sum())
                    counted[depth - 1] += len(hits)
                    correct.append(hits.tolist())
            if not sampled:
                steps += speculative_steps_by_depth(correct, gamma)
                emitted += seq.shape[1] - plen
    by_depth_match = (matched / counted).tolist()
    by_depth_alpha = (overlap / counted).tolist()
    return {"greedy_match_by_depth": by_depth_match, "alpha_by_depth": by_depth_alpha,
            "tokens_per_step": emitted / steps, "prompts": len(prompts), "new_tokens": new_tokens, "gamma": gamma}


def forward_ms(module, inputs: tuple, repeats: int = 200) -> float:
    with torch.no_grad():
        for _ in range(20):
            module(*inputs)
        started = time.perf_counter()
        for _ in range(repeats):
            module(*inputs)
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--samples", required=True, help="samples.pt from specd distill's --work folder")
    parser.add_argument("--eval-questions", required=True)
    parser.add_argument("--eval-prompts", type=int, default=48)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True, help="folder for the features, checkpoint and report")
    parser.add_argument("--time-budget", type=float, default=1800.0, metavar="SECONDS")
    parser.add_argument("--draft-vocabulary", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=3, help="proposal depth trained on (default 3)")
    parser.add_argument("--feature-weight", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--compare-draft", default=None, help="a layer-copy draft folder to time against")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = hub.resolve(args.target)
    target = _load_causal_lm(target_dir).eval()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(target_dir)
    eos_ids = sorted({*([tok.eos_token_id] if tok.eos_token_id is not None else []), *_config_eos(target)})
    samples = torch.load(args.samples)
    features = target_features(target, samples, out / "features.pt")
    draft = FeatureDraft(target, _vocabulary(samples, args.draft_vocabulary, eos_ids))
    state = train(draft, samples, features, args, out / "train.pt")
    questions = [q for q in Path(args.eval_questions).read_text(encoding="utf-8").splitlines() if q.strip()]
    questions = questions[:args.eval_prompts]
    prompts = chat_prompts(tok, questions) if tok.chat_template else [tok.encode(q) for q in questions]
    result = measure(target, draft, prompts, args.gamma, args.eval_new_tokens, args.seed)
    torch.set_num_threads(1)
    width = target.config.hidden_size
    one = (torch.tensor([[1]]), torch.zeros(1, 1, width))
    result["draft_forward_ms_1_thread"] = forward_ms(lambda i, f: draft.logits(draft.unroll(i, f, 1)[0]), one)
    if args.compare_draft:
        layered = sharing.load(Path(args.compare_draft), torch.float32, target_dir)
        result["compare_draft_forward_ms_1_thread"] = forward_ms(lambda i: layered(i).logits, (one[0],))
    result.update(training_s=state["elapsed"], steps=state["step"], samples=len(features),
                  positions=sum(len(f) for f in features),
                  kl_last=sum(state["kl"][-10:]) / max(len(state["kl"][-10:]), 1))
    (out / "report.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
