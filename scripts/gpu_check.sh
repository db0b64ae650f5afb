#!/usr/bin/env bash
# What a lent GPU can tell in one short loan, from a clean checkout, in under 8 minutes (each
# stage has its own time limit; with the wheels' install they add up to 470 s):
#
#   1. env        torch, CUDA and transformers versions, the device, the SDPA backends enabled,
#                 and whether the serving stack imports                                    15 s
#   2. pair       a random Llama pair in 8B shapes built on the device (hidden 4,096, 32/8
#                 heads, a 128,256-token vocabulary; a 6-layer target and a draft that is its
#                 first layer, so acceptance is real: scripts/gpu_check.py)             50 s
#   3. forwards   each model as a worker loads it: kernels, copies and host syncs of a step,
#                 the SDPA backend that ran, CUDA-event forward times beside the host's, peak
#                 memory, and the KV pool its share of --gpu-memory-fraction 0.85 gives; the
#                 same steps replayed as CUDA graphs (--cuda-graphs), and their logits'
#                 distance from the eager forward's                                      110 s
#   4. ceiling    scripts/bench_ceiling.py on the device: fixed γ=4 ÷ target-only with the
#                 models alone, no serving path                                          40 s
#   5. served     specd serve on the device (--gpu-memory-fraction 0.85: the workers split it,
#                 the draft starts once the verifier serves), then specd bench --configs
#                 fixed:4 --concurrency 1,32: target-only and fixed γ=4 ÷ target-only   120 s
#   6. exactness  the batching, memory, post-processing, pipeline and rejection tests, float32
#                 (their CUDA cases, a captured graph's among them; SPECD_TEST_DEVICE=cuda
#                 for the stack tests)                                                   90 s
#
#   scripts/gpu_check.sh             # on a CUDA machine
#   scripts/gpu_check.sh --dry-run   # every stage on this CPU with tiny shapes, about 2 minutes
#
# After every stage it writes what it has to bench-out/gpu/report.md and, when $OUT is set (a
# lent machine's only way back), copies it there with the logs (gpu-logs.tgz): a stage that
# hangs or a loan cut short still sends back what came before. Stages 1-3 need only torch and
# transformers. Stages 4-6 need the serving stack too (gRPC, OpenTelemetry, llguidance, ...),
# which a lent machine lacks and cannot fetch: `scripts/gpu_wheels.sh` here writes their wheels
# to .whl/ (git ignores it; carry it), and this script installs them into /tmp/specd-site. On
# the machine it runs with .venv/bin/python where there is one, else $PYTHON (default python3)
# and its own torch. Never needed for the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
[[ ${1:-} == --dry-run || ${GPU_CHECK_DEVICE:-} == cpu ]] && dry=1
out=bench-out/gpu
rm -rf "$out" && mkdir -p "$out"
began=$SECONDS
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [[ -x .venv/bin/python && -z ${PYTHON:-} ]]; then
  py=.venv/bin/python
else
  py=${PYTHON:-python3}
fi
if [[ -d .whl ]] && ! [[ $py == .venv/bin/python ]]; then
  timeout 45 $py -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/specd-site .whl/*.whl >"$out/wheels.txt" 2>&1 || echo "(the wheels did not install)" >>"$out/wheels.txt"
  export PYTHONPATH=/tmp/specd-site:$PYTHONPATH
fi
if ((dry)); then
  device=cpu dtype=float32 shape=tiny fraction=0 forwards=(--small)
  bench=(--concurrency 1,8 --requests 8 --max-new-tokens 16)
  ceiling=(--max-new-tokens 16 --rounds 1)
  exactness=(tests/test_memory.py tests/test_batching.py tests/test_graphs.py
    -k "memory or batched_forward or fork or lone_session or eager_forwards_logits")
else
  device=cuda dtype=bfloat16 shape=8b fraction=0.85 forwards=()
  bench=(--concurrency 1,32 --requests 32 --max-new-tokens 32)
  ceiling=(--max-new-tokens 48 --rounds 3)
  exactness=(tests/test_memory.py tests/test_batching.py tests/test_post_process.py tests/test_pipeline.py
    tests/test_rejection.py tests/test_graphs.py -k "not cpu")
fi
pair=runs/gpu-pair-$shape
port=50161

stage() {  # name seconds command...: run a stage under its time limit, its output to $out/name.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most $limit s)"
  local start=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.txt" 2>&1
  local rc=$?
  echo "[$name: exit $rc after $((SECONDS - start)) s$( ((rc == 124)) && echo ', out of time')]" >>"$out/$name.txt"
  grep -v "^USDT\|it/s\]$\|Writing model shards\|Loading weights" "$out/$name.txt" | tail -"${TAIL:-30}"
  report
}

section() {  # title file lines: a fenced excerpt of a stage's output
  echo
  echo "$1:"
  echo
  echo '```'
  if [[ -s $out/$2 ]]; then grep -v "^USDT\|it/s\]$\|Writing model shards\|Loading weights" "$out/$2" | tail -"$3"; else echo "(not run)"; fi
  echo '```'
}

report() {  # what has been measured so far, to report.md and $OUT
  {
    echo "### GPU check, $(date -u +%Y-%m-%d), $( ((dry)) && echo 'a dry run on this CPU' || echo "$device $dtype")"
    echo
    echo "\`scripts/gpu_check.sh$( ((dry)) && echo ' --dry-run')\` at commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'),"
    echo "$((SECONDS - began)) s so far; pair: \`scripts/gpu_check.py make-pair --shape $shape\`."
    section "The machine" env.txt 12
    section "The pair" pair.txt 6
    section "One forward of each model (\`scripts/gpu_check.py forwards\`)" forwards.txt 34
    section "The models alone (\`scripts/bench_ceiling.py --gamma 4 ${ceiling[*]}\`)" ceiling.txt 6
    section "Served (\`scripts/gpu_check.py served --fraction $fraction ${bench[*]}\`: specd serve, then specd bench --configs fixed:4)" served.txt 16
    section "Exactness on $device (\`pytest ${exactness[*]}\`)" exactness.txt 6
  } >"$out/report.md"
  if [[ -n ${OUT:-} ]]; then
    cp "$out/report.md" "$OUT/"
    tar -czf "$OUT/gpu-logs.tgz" "$out" 2>/dev/null || true
  fi
}

trap report EXIT

TAIL=12 stage env 15 $py scripts/gpu_check.py env
if ((!dry)) && ! grep -q "^device: .*GiB" "$out/env.txt"; then
  echo "no CUDA device: this check needs a GPU (scripts/gpu_check.sh --dry-run runs it on a CPU)" >&2
  exit 1
fi
stage pair 50 $py scripts/gpu_check.py make-pair "$pair" --shape "$shape" --device "$device"
TAIL=50 stage forwards 110 $py scripts/gpu_check.py forwards "$pair" --device "$device" --dtype "$dtype" \
  --fraction 0.85 "${forwards[@]}" --out "$out/forwards.json"
if ! grep -q "^serving: ok" "$out/env.txt"; then
  echo "the serving stack does not import here ($(grep '^serving:' "$out/env.txt")): the ceiling, served and" \
    "exactness stages need it; run scripts/gpu_wheels.sh where pip reaches a registry and carry .whl" | tee -a "$out/env.txt"
fi
stage ceiling 40 $py scripts/bench_ceiling.py --target "$pair/target" --draft "$pair/draft" --gamma 4 \
  --device "$device" --dtype "$dtype" "${ceiling[@]}"
TAIL=24 stage served 120 $py scripts/gpu_check.py served "$pair" --device "$device" --dtype "$dtype" \
  --fraction "$fraction" --port "$port" --startup-timeout 75 "${bench[@]}" --log "$out/serve.log" \
  --bench-out "$out/bench"
stage exactness 90 env SPECD_TEST_DEVICE=$device SPECD_TEST_DTYPE=float32 $py -m pytest -q -p no:cacheprovider \
  "${exactness[@]}"
echo "done in $((SECONDS - began)) s: $out/report.md"
