"""A linear layer's product on a CPU for a few rows: torch's own against oneDNN's with the
weight packed once (specd.worker.packing), side by side in one run.

    python scripts/bench_linear.py [--threads 1] [--model models/demo/target]

For each weight shape of the model's decoder layers and output layer (and, without
--model, a range of shapes), and 1, 2, 5 and 17 rows (a plain step, and verifications of
γ = 1, 4 and 16), prints the median µs of each product. The weights fit in cache here, so
a whole forward, which reads them from memory, gains less: `scripts/bench_forward.py`
measures that. docs/serving-path.md ("Packed linear layers") keeps the figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import AutoConfig

from specd.worker.packing import PackedLinear

ROWS = (1, 2, 5, 17)
SHAPES = [(256, 688), (512, 512), (768, 768), (512, 1376), (1024, 1024), (768, 2048), (2048, 2048)]


def median_us(layer: nn.Module, hidden: torch.Tensor, repeats: int = 300) -> float:
    for _ in range(30):
        layer(hidden)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        layer(hidden)
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def model_shapes(model: str) -> list[tuple[int, int]]:
    """(in, out) of a Llama-shaped model's projections and its output layer."""
    config = AutoConfig.from_pretrained(model)
    hidden, inner = config.hidden_size, config.intermediate_size
    return sorted({(hidden, hidden), (hidden, inner), (inner, hidden), (hidden, config.vocab_size)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default="", help="a model directory whose shapes to measure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = model_shapes(args.model) if args.model else SHAPES
    print(f"{args.threads} thread(s); median µs of one product, torch / packed")
    print(f"{'in × out':>12} " + " ".join(f"{f'{rows} rows':>16}" for rows in ROWS))
    with torch.inference_mode():
        for fan_in, fan_out in shapes:
            linear = nn.Linear(fan_in, fan_out, bias=False)
            packed = PackedLinear.of(linear)
            cells = []
            for rows in ROWS:
                hidden = torch.randn(1, rows, fan_in)
                cells.append(f"{median_us(linear, hidden):>7.0f} / {median_us(packed, hidden):<6.0f}")
            print(f"{f'{fan_in} × {fan_out}':>12} " + " ".join(f"{cell:>16}" for cell in cells))


if __name__ == "__main__":
    main()
