#!/usr/bin/env bash
# The README's overlap figures: overlapped vs sequential speculation on the demo pair,
# greedy, one request in flight, draft and verifier pinned to their own cores as if each
# owned a GPU; then again with the target on both cores (the draft sharing one of them).
# Every configuration runs on every prompt in turn (specd bench); outputs are compared
# with target-only's. Reports land in bench-out/overlap/.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
configs=fixed:4,fixed:4+overlap,cost,cost+overlap
run() {  # $1: name, then specd serve's pinning flags
  local name=$1; shift
  .venv/bin/specd serve --port 50081 "$@" &
  local server=$!
  trap "kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true" EXIT
  echo "== $name"
  .venv/bin/specd bench --gateway 127.0.0.1:50081 --configs "$configs" --max-new-tokens 64 \
    --rounds "${ROUNDS:-2}" --out "bench-out/overlap/$name"
  kill -TERM $server; wait $server 2>/dev/null || true
  trap - EXIT
}
run target-1-core --draft-cpus 0 --verifier-cpus 1
run target-2-cores --draft-cpus 0 --verifier-cpus 0-1
