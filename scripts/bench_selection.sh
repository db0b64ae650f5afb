#!/usr/bin/env bash
# The README's draft-selection figures (#13), from one command: a fresh `specd serve` hosting
# three drafts (distilled, generic, and an unrelated one made in runs/), then `specd bench`
# on the mixed demo workload (code + prose prompts, greedy, 64 new tokens), each draft pinned
# and the gateway choosing (AUTO policy), interleaved request by request. The gateway is
# fresh, so the selector's exploration is paid inside the run. ROUNDS passes (default 8).
# Report in bench-out/selection.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/python scripts/make_unrelated_draft.py
.venv/bin/specd serve --port 50071 \
  --draft distilled=models/demo/draft-distilled --draft generic=models/demo/draft-generic \
  --draft unrelated=runs/unrelated-draft &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
.venv/bin/specd bench --gateway 127.0.0.1:50071 --max-new-tokens 64 --rounds "${ROUNDS:-8}" \
  --configs cost@distilled,cost@generic,cost@unrelated,cost --out bench-out/selection "$@"
