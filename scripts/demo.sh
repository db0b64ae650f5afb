#!/usr/bin/env bash
# Set up (if needed), start `specd serve` on the shipped demo pair, send one request, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/specd serve --port 50051 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
.venv/bin/specd generate "${1:-def fibonacci(n):}" --max-new-tokens 64 --wait 180
