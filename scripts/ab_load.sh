#!/usr/bin/env bash
# Two source trees of specd, A and B, measured under load in pairs of fresh servers: for
# each pair, `specd serve` from one tree, then `specd bench --configs cost` against it (AUTO
# and target-only taking turns), then the same for the other tree, the order swapped from
# pair to pair so that a machine whose speed drifts slows both alike. A fresh server each
# run, because what the gateway learns (the load cap, the suffix cache) persists in it.
#
#   scripts/ab_load.sh A_DIR B_DIR [PAIRS] [OUT_DIR]
#
# A_DIR and B_DIR are checkouts (e.g. a clean clone of main and a working tree); both run
# with this checkout's .venv and PYTHONPATH set to their own root. The workload is the
# held-out prompts of real Python source (scripts/heldout_workload.py), 8 in flight, 64 new
# tokens, greedy: the figure behind the "8 in flight" bar of docs/proposers.md. Each run
# prints AUTO ÷ target-only round by round, and the load cap per load level after it
# (`specd_spec_decode_load_cap`). Run it on a quiet machine: nothing else beside it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd)
pairs=${3:-3}
out=${4:-$root/bench-out/ab-load}
mkdir -p "$out" "$root/runs"
bin=$root/.venv/bin
workload=$root/runs/heldout-load.json
if [[ ! -f $workload ]]; then
  (cd "$root/scripts" && "$bin/python" heldout_workload.py "$workload" --per-task 24 --seed 11)
fi

run_one() {  # name dir pair
  local name=$1 dir=$2 pair=$3 port=50093 metrics=9493 server
  (cd "$dir" && PYTHONPATH=$dir exec "$bin/specd" serve --port $port --metrics-port $metrics) \
    > "$out/serve-$name-$pair.log" 2>&1 &
  server=$!
  # A bench that fails ends this script (set -e): its server goes too, not left holding the port.
  trap "kill -TERM $server 2>/dev/null || true" EXIT
  for _ in $(seq 180); do curl -sf "127.0.0.1:$metrics/metrics" > /dev/null && break; sleep 1; done
  (cd "$dir" && PYTHONPATH=$dir "$bin/specd" bench --gateway 127.0.0.1:$port --max-new-tokens 64 \
    --workload "$workload" --concurrency 8 --requests-per-level 39 --rounds 4 --configs cost \
    --out "$out/bench-$name-$pair") > "$out/bench-$name-$pair.log" 2>&1
  local caps
  caps=$(curl -s "127.0.0.1:$metrics/metrics" | sed -n 's/^specd_spec_decode_load_cap{load="\([0-9]*\)".*} \(.*\)/L\1:\2/p' | tr '\n' ' ')
  kill -TERM $server; wait $server 2>/dev/null || true
  trap - EXIT
  echo "$name pair $pair  $(grep 'round by round' "$out/bench-$name-$pair.log" | sed 's/.*round by round: //')  caps: $caps"
}

for pair in $(seq "$pairs"); do
  if (( pair % 2 )); then run_one A "$a" "$pair"; run_one B "$b" "$pair"
  else run_one B "$b" "$pair"; run_one A "$a" "$pair"; fi
done
