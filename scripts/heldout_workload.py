"""Write a `specd bench --workload` file of held-out prompts: text no model here trained on.

Code prompts are chunks of the Python standard library files that the demo pair's corpus
held out (`scripts/make_demo_pair.py`: real source nobody here wrote); prose prompts are
chunks of the held-out pydoc topics. Each chunk starts at a line boundary of a different
document and runs for about --chars characters. Deterministic: the same Python gives the
same prompts.

    python scripts/heldout_workload.py runs/heldout.json --per-task 16 [--tasks code]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from make_demo_pair import corpus_docs


def chunks(documents: list[str], count: int, chars: int, rng: random.Random) -> list[str]:
    """`count` chunks of about `chars` characters, each from a different document."""
    usable = [doc for doc in documents if len(doc) > 2 * chars]
    picked = []
    for doc in rng.sample(usable, min(count, len(usable))):
        lines = doc.splitlines(keepends=True)
        start = rng.randrange(0, max(1, len(lines) // 2))
        text = ""
        for line in lines[start:]:
            if len(text) + len(line) > chars and text:
                break
            text += line
        picked.append(text)
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--per-task", type=int, default=16)
    parser.add_argument("--chars", type=int, default=600)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--tasks", default="code,prose",
                        help="comma list of code and prose (code alone: real source only; its prompts are the same)")
    args = parser.parse_args()
    tasks = args.tasks.split(",")
    if not tasks or set(tasks) - {"code", "prose"}:
        parser.error("--tasks takes code, prose or both")
    rng = random.Random(args.seed)
    docs = corpus_docs()
    # Drawn in this order whatever is asked, so code alone gives the same code prompts.
    drawn = {task: chunks(docs[task]["val"], args.per_task, args.chars, rng) for task in ("code", "prose")}
    workload = {task: drawn[task] for task in tasks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(workload, indent=1))
    print(f"{args.out}: " + ", ".join(f"{len(p)} {t} prompts" for t, p in workload.items()))


if __name__ == "__main__":
    main()
