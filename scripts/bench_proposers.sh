#!/usr/bin/env bash
# Model-free drafting on the demo pair (docs/proposers.md, "Measured"):
#   1. held-out prompts (chunks of Python source and pydoc text no model here trained on)
#      are written to runs/heldout.json;
#   2. `specd serve` runs with its defaults (the distilled draft, suffix and prompt lookup);
#   3. `specd bench --repeat 2`: target-only, AUTO (the hybrid), AUTO with each proposer
#      forced, beside transformers' generate and its prompt lookup, one table per pass
#      (pass 2 repeats pass 1's prompts: an agent's workload);
#   4. `specd bench --concurrency 8 --rounds 3`: AUTO against target-only under load, on 39
#      other held-out prompts, each sent once a round (fresh prompts: each round in user
#      segments of its own, so the cache meets no repeat), the two taking turns three times,
#      each round's ratio printed (on this 2-core machine one round's moves by ±0.1).
# Greedy, 64 new tokens. Reports land in bench-out/proposers/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
(cd scripts && ../.venv/bin/python heldout_workload.py ../runs/heldout.json --per-task "${PER_TASK:-12}" &&
  ../.venv/bin/python heldout_workload.py ../runs/heldout-load.json --per-task 24 --seed 11)
.venv/bin/specd serve --port 50062 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
bench=(.venv/bin/specd bench --gateway 127.0.0.1:50062 --max-new-tokens 64 --workload runs/heldout.json)
echo "== one request at a time, two passes over the same prompts"
"${bench[@]}" --repeat 2 --configs "cost,cost@suffix,cost@prompt-lookup,cost@draft-distilled" \
  --target models/demo/target --out bench-out/proposers/repeat
echo "== 8 in flight"
.venv/bin/specd bench --gateway 127.0.0.1:50062 --max-new-tokens 64 --workload runs/heldout-load.json \
  --concurrency 8 --requests-per-level 39 --rounds 3 --configs cost --out bench-out/proposers/load
