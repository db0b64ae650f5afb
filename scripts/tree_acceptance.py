"""What proposing a tree instead of a chain would give a draft under greedy decoding.

    python scripts/tree_acceptance.py --target MODEL --draft DRAFT \
        --questions data/chat_questions_heldout.txt [--prompts 48] [--new-tokens 64]

A tree proposal has `w_d` children under every node of depth d - 1: the draft's top `w_d`
tokens there. Under greedy decoding only the branch along the target's own tokens can be
accepted, so depth d's token is accepted exactly when the target's token ranks below `w_d`
in the draft's distribution on the target's own prefix, and the draft's ranks along the
target's greedy answers, from one draft forward per answer, price every tree shape. Prints,
for each shape, the tokens verified a step (the tree's nodes) and the tokens emitted a step
(accepted + the target's own), and how often the target's token is in the draft's top k.
specd proposes chains; docs/models.md keeps the figures and what they say.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specd.worker import hub, sharing  # noqa: E402
from specd_cli.distill import (  # noqa: E402
    _generate,
    _load_causal_lm,
    chat_prompts,
    speculative_steps_by_depth,
)

SHAPES = ([1], [1, 1], [1, 1, 1], [1, 1, 1, 1], [2, 1, 1], [2, 1, 1, 1], [3, 1, 1], [4, 1, 1],
          [2, 2, 1], [2, 2, 2], [4, 2, 1], [8, 1, 1])


def steps(ranks: list[int], widths: list[int]) -> int:
    """Greedy speculative steps to emit `len(ranks)` tokens with trees of `widths`: the
    proposal's token at depth d is right where the target's ranks below `widths[d]`."""
    return speculative_steps_by_depth([[rank < width for rank in ranks] for width in widths], len(widths))


def nodes(widths: list[int]) -> int:
    """Tokens a tree of `widths` asks the target to verify."""
    total, level = 0, 1
    for width in widths:
        level *= width
        total += level
    return total


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True, help="a draft folder (a layer copy shares the target's weights)")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = hub.resolve(args.target)
    target = _load_causal_lm(target_dir).eval()
    draft = sharing.load(Path(args.draft), torch.float32, target_dir).eval()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    questions = [q for q in Path(args.questions).read_text(encoding="utf-8").splitlines() if q.strip()]
    ranks: list[list[int]] = []
    for prompt in chat_prompts(tokenizer, questions[:args.prompts]):
        answer = _generate(target, torch.tensor([prompt]), args.new_tokens, 0.0)
        logits = draft(answer).logits[0, len(prompt) - 1:-1]
        truth = answer[0, len(prompt):]
        ranks.append((logits > logits.gather(-1, truth[:, None])).sum(-1).tolist())
    emitted = sum(len(r) for r in ranks)
    every = [rank for answer_ranks in ranks for rank in answer_ranks]
    report = {
        "top_k_share": {k: round(sum(rank < k for rank in every) / len(every), 3) for k in (1, 2, 3, 4, 8)},
        "shapes": [{"widths": widths, "verified": nodes(widths),
                    "tokens_per_step": round(emitted / sum(steps(r, widths) for r in ranks), 3)}
                   for widths in SHAPES],
        "prompts": len(ranks), "new_tokens": args.new_tokens,
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
