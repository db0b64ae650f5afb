#!/usr/bin/env bash
# The README's speed and acceptance figures for the demo pair, from one command:
#   1. a draft unrelated to the target (random weights, the demo tokenizer) is made in runs/;
#   2. `specd serve` hosts three drafts (distilled, generic, unrelated) over the demo target;
#   3. `specd bench` runs every γ policy and target-only with the distilled draft (plus
#      transformers' own generate and assisted generation on the same pair), then the
#      generic draft, then AUTO with the unrelated draft against target-only.
# Reports land in bench-out/ (bench-out/bfloat16 with DTYPE=bfloat16). Greedy, 64 new tokens,
# the built-in demo workload. DTYPE=bfloat16 runs both models (and transformers) in bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python scripts/make_unrelated_draft.py
dtype=${DTYPE:-float32}
out=bench-out; [[ $dtype == float32 ]] || out=bench-out/$dtype
.venv/bin/specd serve --port 50061 --dtype "$dtype" \
  --draft distilled=models/demo/draft-distilled --draft generic=models/demo/draft-generic \
  --draft unrelated=runs/unrelated-draft &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
bench=(.venv/bin/specd bench --gateway 127.0.0.1:50061 --max-new-tokens 64 --dtype "$dtype" "$@")
echo "== distilled draft: every policy, target-only, transformers"
"${bench[@]}" --draft-model distilled --out "$out/distilled" \
  --target models/demo/target --draft models/demo/draft-distilled
echo "== generic draft"
"${bench[@]}" --draft-model generic --configs fixed:4,cost --out "$out/generic"
echo "== unrelated draft: AUTO (cost) must fall back to plain decoding"
"${bench[@]}" --draft-model unrelated --configs fixed:4,cost --out "$out/unrelated"
