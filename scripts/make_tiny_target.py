"""A near-free target for measuring specd's own cost: 3 layers × 128, random weights, the
demo tokenizer, saved to runs/tiny-target (or the directory given).

    python scripts/make_tiny_target.py [DIR]

Its forward takes well under a couple of milliseconds on a CPU, so what a benchmark of it
measures is mostly the serving path around the forward (docs/performance.md).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specd.config import DEMO_TARGET


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-target")
    if (out / "config.json").is_file():
        return
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
