"""A draft unrelated to the demo target: the demo draft's shape and tokenizer, random weights.

    python scripts/make_unrelated_draft.py [OUT]      (default runs/unrelated-draft)

What the benchmarks use to check that AUTO falls back to plain decoding when a draft
never agrees with its target. Made once; an existing one is kept.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GENERIC = "models/demo/draft-generic"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/unrelated-draft")
    if (out / "config.json").exists():
        return
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(GENERIC)).save_pretrained(out)
    AutoTokenizer.from_pretrained(GENERIC).save_pretrained(out)


if __name__ == "__main__":
    main()
