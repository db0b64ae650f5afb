#!/usr/bin/env bash
# The README's figures under load, from one command: `specd serve` with the demo target and
# two drafts (distilled, and one unrelated to the target: random weights, the demo
# tokenizer), then `specd bench --concurrency` with
#   1. the distilled draft: target-only, fixed γ=4 and AUTO at 1, 4, 8 and 16 requests in
#      flight, with transformers' batched generate of the same target beside them;
#   2. the unrelated draft: AUTO against target-only at 1 and 8 in flight.
# Reports land in bench-out/load/. Greedy, 48 new tokens, the built-in demo workload.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python scripts/make_unrelated_draft.py
.venv/bin/specd serve --port 50071 \
  --draft distilled=models/demo/draft-distilled --draft unrelated=runs/unrelated-draft &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
bench=(.venv/bin/specd bench --gateway 127.0.0.1:50071 --max-new-tokens 48 "$@")
echo "== distilled draft under load"
"${bench[@]}" --draft-model distilled --configs fixed:4,cost --concurrency 1,4,8,16 \
  --requests-per-level 48 --target models/demo/target --out bench-out/load/distilled
echo "== unrelated draft: AUTO must not fall below target-only"
"${bench[@]}" --draft-model unrelated --configs cost --concurrency 1,8 --requests-per-level 32 \
  --out bench-out/load/unrelated
