#!/usr/bin/env bash
# specd's own cost per step (docs/performance.md), from one command, in two parts:
#   1. a near-free target (3 layers × 128): target-only through `specd serve` against
#      transformers' batched generate of the same model, at 1, 8 and 32 requests in flight;
#   2. the demo pair: target-only, fixed γ=4 and AUTO against transformers' generate at 1
#      and 8 in flight.
# Greedy, 48 new tokens, the built-in demo workload. Reports land in bench-out/overhead/.
# Extra arguments go to `specd serve` (e.g. --threads 1). Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python scripts/make_tiny_target.py runs/tiny-target
serve() {
  .venv/bin/specd serve --port 50081 "$@" >bench-out/overhead/serve.log 2>&1 &
  server=$!
  for _ in $(seq 120); do grep -q "ready on" bench-out/overhead/serve.log 2>/dev/null && return; sleep 1; done
  echo "specd serve did not start; see bench-out/overhead/serve.log" >&2
  exit 1
}
stop() { kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; }
trap stop EXIT
mkdir -p bench-out/overhead
bench=(.venv/bin/specd bench --gateway 127.0.0.1:50081 --max-new-tokens 48)
echo "== near-free target: target-only vs transformers' batched generate"
serve --target runs/tiny-target --draft runs/tiny-target "$@"
"${bench[@]}" --configs off --concurrency 1,8,32 --requests-per-level 64 --target runs/tiny-target \
  --out bench-out/overhead/tiny
stop
echo "== demo pair: target-only, fixed γ=4 and AUTO vs transformers' generate"
serve "$@"
"${bench[@]}" --configs fixed:4,cost --concurrency 1,8 --requests-per-level 32 --target models/demo/target \
  --out bench-out/overhead/demo
