#!/usr/bin/env bash
# On a CUDA machine: the exactness tests with the services' models on the GPU in bf16, then
# `specd bench --concurrency 1,8,32` on the demo pair and on a random-weight pair shaped like
# a real one (~1B target, ~100M draft), each beside transformers' own generate on the GPU.
# Appends the figures, with the machine and the commands, to docs/performance.md.
#
#   scripts/gpu_check.sh            # about 15 minutes on one H100/H200-class GPU
#
# Never needed for the test suite; see docs/performance.md ("GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
py=.venv/bin/python
$py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this check needs a GPU'"
out=bench-out/gpu
mkdir -p "$out"
report=docs/performance.md
gpu=$($py -c "import torch; print(torch.cuda.get_device_name(0))")

echo "== exactness on $gpu (bf16)"
SPECD_TEST_DEVICE=cuda SPECD_TEST_DTYPE=bfloat16 $py -m pytest -q tests/test_pipeline.py tests/test_batching.py \
  tests/test_sampled_distribution.py tests/test_rejection.py 2>&1 | tee "$out/exactness.txt"

$py scripts/make_sized_pair.py runs/sized-pair
serve() {  # target draft port: the three services, the workers on the GPU in bf16
  .venv/bin/specd verifier --target "$1" --device cuda --dtype bfloat16 --port $(($3 + 1)) >"$out/verifier.log" 2>&1 &
  pids=($!)
  .venv/bin/specd draft --draft "$2" --device cuda --dtype bfloat16 --port $(($3 + 2)) >"$out/draft.log" 2>&1 &
  pids+=($!)
  .venv/bin/specd gateway --port "$3" --verifier-address "127.0.0.1:$(($3 + 1))" \
    --draft-address "127.0.0.1:$(($3 + 2))" >"$out/gateway.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 180); do grep -q "listening" "$out/gateway.log" 2>/dev/null && return; sleep 1; done
  echo "the services did not start; see $out/*.log" >&2
  exit 1
}
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap stop EXIT
for pair in "demo models/demo/target models/demo/draft-distilled" \
            "sized runs/sized-pair/target runs/sized-pair/draft"; do
  read -r name target draft <<<"$pair"
  echo "== $name pair"
  serve "$target" "$draft" 50161
  .venv/bin/specd bench --gateway 127.0.0.1:50161 --configs fixed:4,cost --concurrency 1,8,32 \
    --requests-per-level 64 --max-new-tokens 64 --target "$target" --dtype bfloat16 \
    --out "$out/$name" | tee "$out/$name.txt"
  stop
done

{
  echo
  echo "### GPU check, $(date -u +%Y-%m-%d), $gpu"
  echo
  echo "\`scripts/gpu_check.sh\` (commit $(git rev-parse --short HEAD)). Exactness (bf16):"
  echo
  echo '```'
  tail -3 "$out/exactness.txt"
  echo '```'
  for name in demo sized; do
    echo
    echo "$name pair, \`specd bench --concurrency 1,8,32\` (greedy, 64 new tokens):"
    echo
    echo '```'
    grep -A 40 "N configuration" "$out/$name.txt" | grep -v "^report"
    echo '```'
  done
} >>"$report"
echo "figures appended to $report"
