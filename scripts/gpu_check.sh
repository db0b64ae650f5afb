#!/usr/bin/env bash
# On a CUDA machine: the exactness tests with the services' models on the GPU in bf16, then
# `specd bench --concurrency 1,8,32` on a random-weight pair shaped like a real one (~1B
# target, ~100M draft) and, where its weights are here, on the demo pair, each beside
# transformers' own batched generate on the GPU. Writes the figures, with the machine and
# the commands, to bench-out/gpu/report.md (and $OUT/ when set) after every stage, and
# appends them to docs/performance.md at the end.
#
#   scripts/gpu_check.sh                       # 6 minutes, 9½ at most, on one H100/H200-class GPU
#   GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh  # a dry run of every stage on this CPU, tiny models
#
# Where .venv can be made (pip reaches a registry) it runs there. A lent GPU machine
# reaches none and gets no .venv: there, or wherever PYTHON names an interpreter, it runs
# on that Python (default python3) and its own torch, with the wheels scripts/gpu_wheels.sh
# put in .whl/ (docs/performance.md, "GPU check", says how to send them). Never needed for
# the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
device=${GPU_CHECK_DEVICE:-cuda}
out=bench-out/gpu
rm -rf "$out" && mkdir -p "$out"
if [[ -d .whl && ( -n ${PYTHON:-} || ! -x .venv/bin/python ) ]]; then
  py=${PYTHON:-python3}
  timeout 60 $py -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specd-site .whl/*.whl
  export PYTHONPATH=/tmp/specd-site:$PWD
else
  ./scripts/setup.sh
  py=.venv/bin/python
fi
if [[ $device == cuda ]]; then
  $py -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this check needs a GPU'"
  name=$($py -c "import torch; print(torch.cuda.get_device_name(0))")
  dtype=bfloat16
  pairs=("sized runs/sized-pair/target runs/sized-pair/draft")
  if [[ -s models/demo/target/model.safetensors ]]; then
    pairs+=("demo models/demo/target models/demo/draft-distilled")
  fi
else  # the dry run: the near-free target as its own draft, on this CPU
  name="a dry run on this CPU"
  dtype=float32
  pairs=("tiny runs/tiny-target runs/tiny-target")
fi
bench=(bench --gateway 127.0.0.1:50161 --configs fixed:4,cost --concurrency 1,8,32 --requests-per-level 32
  --max-new-tokens 32 --dtype "$dtype")

report() {  # what has been measured so far, to report.md and $OUT (a lent machine's only way back)
  {
    echo
    echo "### GPU check, $(date -u +%Y-%m-%d), $name"
    echo
    echo "\`scripts/gpu_check.sh\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $dtype."
    echo "Exactness (\`SPECD_TEST_DEVICE=$device SPECD_TEST_DTYPE=$dtype pytest tests/test_pipeline.py"
    echo "tests/test_batching.py tests/test_sampled_distribution.py tests/test_rejection.py\`):"
    echo
    echo '```'
    tail -3 "$out/exactness.txt" 2>/dev/null || echo "(not run)"
    echo '```'
    for pair in "${pairs[@]}"; do
      read -r label target draft <<<"$pair"
      echo
      echo "$label pair ($target, $draft): \`specd ${bench[*]} --target $target\`:"
      echo
      echo '```'
      grep -A 12 "N configuration" "$out/$label.txt" 2>/dev/null | grep -v "^report" || echo "(no table)"
      echo '```'
    done
  } >"$out/report.md"
  if [[ -n ${OUT:-} ]]; then
    cp "$out/report.md" "$OUT/"
    tar -czf "$OUT/gpu-logs.tgz" "$out" 2>/dev/null || true
  fi
}
pids=()
stop() { kill -TERM "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; pids=(); }
trap 'stop; report' EXIT

if [[ $device == cuda ]]; then
  timeout 90 $py scripts/make_sized_pair.py runs/sized-pair
else
  $py scripts/make_tiny_target.py runs/tiny-target
fi
echo "== exactness on $name ($dtype)"
SPECD_TEST_DEVICE=$device SPECD_TEST_DTYPE=$dtype timeout 240 $py -m pytest -q -p no:cacheprovider \
  tests/test_pipeline.py tests/test_batching.py tests/test_sampled_distribution.py tests/test_rejection.py \
  >"$out/exactness.txt" 2>&1 || echo "(the exactness tests failed or ran out of time)" >>"$out/exactness.txt"
tail -3 "$out/exactness.txt"
report

serve() {  # target draft port: the three services, the workers on the device; false if they did not start
  $py -m specd.cli verifier --target "$1" --device "$device" --dtype "$dtype" --port $(($3 + 1)) \
    >"$out/verifier.log" 2>&1 &
  pids+=($!)
  $py -m specd.cli draft --draft "$2" --device "$device" --dtype "$dtype" --port $(($3 + 2)) >"$out/draft.log" 2>&1 &
  pids+=($!)
  $py -m specd.cli gateway --port "$3" --verifier-address "127.0.0.1:$(($3 + 1))" \
    --draft-address "127.0.0.1:$(($3 + 2))" >"$out/gateway.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 60); do grep -q "listening" "$out/gateway.log" 2>/dev/null && return 0; sleep 1; done
  echo "the services did not start; see $out/*.log" >&2
  return 1
}
for pair in "${pairs[@]}"; do
  read -r label target draft <<<"$pair"
  echo "== $label pair"
  if serve "$target" "$draft" 50161; then
    timeout 120 $py -m specd.cli "${bench[@]}" --target "$target" --out "$out/$label" >"$out/$label.txt" 2>&1 ||
      echo "(the bench failed or ran out of time)" >>"$out/$label.txt"
    grep -A 12 "N configuration" "$out/$label.txt" || tail -5 "$out/$label.txt"
  fi
  stop
  report
done

if [[ $device == cuda ]]; then
  cat "$out/report.md" >>docs/performance.md
  echo "figures appended to docs/performance.md"
fi
