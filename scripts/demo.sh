#!/usr/bin/env bash
# Set up (if needed), start `specd serve` on the shipped demo pair, send one request, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/specd serve --port 50051 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
.venv/bin/specd generate "${1:-def fibonacci(n):}" --max-new-tokens 64 --wait 180 &
client=$!
# Whichever ends first: a server that dies while starting ends the demo now, not after
# the client has waited out its 180 s.
status=0
wait -n -p ended "$server" "$client" || status=$?
if [[ "$ended" == "$server" ]]; then
  kill "$client" 2>/dev/null || true
  echo "demo: specd serve exited (status $status) before answering; see its messages above" >&2
  exit 1
fi
exit "$status"
