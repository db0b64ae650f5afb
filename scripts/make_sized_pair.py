"""A random-weight pair shaped like a real one, for GPU checks: a target of about 1B
parameters (16 layers × 2048) and a draft of about 100M (6 layers × 768), Llama-style,
with the demo tokenizer (vocabulary 4096, so the parameters sit in the layers).

    python scripts/make_sized_pair.py [DIR]   # writes DIR/target and DIR/draft (default runs/sized-pair)

Acceptance means nothing with random weights; the pair measures speed and exactness only.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from specd.config import DEMO_TARGET

SHAPES = {  # name: (layers, hidden, intermediate, heads, KV heads)
    "target": (16, 2048, 8192, 16, 8),
    "draft": (6, 768, 3072, 12, 4),
}


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/sized-pair")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    for name, (layers, hidden, intermediate, heads, kv_heads) in SHAPES.items():
        out = root / name
        if (out / "config.json").is_file():
            continue
        torch.manual_seed(len(name))
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id, dtype="bfloat16")
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)


if __name__ == "__main__":
    main()
