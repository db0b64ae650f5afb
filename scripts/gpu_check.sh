#!/usr/bin/env bash
# What a lent GPU can tell in one short loan, from a clean checkout: the figures the GPU path's
# bars need, within about 8 minutes. Each stage has a time limit, and the limits add up to
# 500 s (545 s with the wheels' install); what each stage took is in the report. The stages,
# their limits, and what each measures:
#
#   env            15 s  torch, CUDA and transformers versions, the device, the SDPA backends
#                        enabled, and whether the serving stack imports
#   pair           50 s  a random Llama pair built on the device (scripts/gpu_check.py make-pair):
#                        a target with an 8B's layers (12 of them) and a draft with a 1B's (2),
#                        so the draft reads about 1/8 of the target's weights a forward (a 1B
#                        reads 1/6 of an 8B's); their greedy tokens agree at about 0.7 of positions
#   forwards       80 s  each model as a worker loads it: kernels, copies and host syncs of a step
#                        at 1 and 32 sessions, the SDPA backend that ran, CUDA-event times, peak
#                        memory and the KV pool of --gpu-memory-fraction 0.85; the same steps
#                        replayed as CUDA graphs, then through the paged kernel (--attention-kernel
#                        triton), and each one's logits' distance from the eager ones
#   ceiling        55 s  the models alone (scripts/bench_ceiling.py's loops), eager then as CUDA
#                        graphs: target-only and fixed γ=4 tokens/s over the demo prompts, tokens
#                        per step, each model's ms per forward, c and v
#   reference      30 s  transformers' greedy generate of the target in bf16 on the device, 8
#                        demo prompts × 32 tokens
#   served         90 s  specd serve (--gpu-memory-fraction 0.85, no model-free proposers): the
#                        reference's prompts served greedily by target-only and fixed γ=4,
#                        compared token for token; then specd bench --configs fixed:4,cost
#                        --concurrency 1,32 (AUTO is cost), once to warm up and once measured,
#                        over the same prompts and token counts as the ceiling at 1 in flight
#   served-graphs 100 s  the same with --cuda-graphs
#   exactness      80 s  the batching, memory, post-processing, pipeline, rejection, graph and
#                        paged-kernel tests' CUDA cases, float32
#
# Then scripts/gpu_figures.py puts the figures at the top of the report: served ÷ the models
# alone, fixed γ=4 and AUTO ÷ target-only at 1 and 32 in flight, eager and with graphs, the
# greedy agreement, acceptance, c, v, the speed-up they predict beside the one measured, an
# 8B/1B projection, and each stage's wall time.
#
#   scripts/gpu_check.sh                          # every stage, on a CUDA machine
#   scripts/gpu_check.sh --stages served-graphs   # those stages again, on the still-warm machine
#   scripts/gpu_check.sh --dry-run                # every stage on this CPU: tiny shapes, float32,
#                                                 # 16 tokens a request, --cuda-graphs left out
#
# A full run starts from an empty bench-out/gpu (bench-out/gpu-dry for the dry run). --stages
# keeps what is there and reruns the stages named (comma-separated); a stage that needs the pair
# or the reference makes it first where it is missing, and a new pair drops every figure
# measured on the old one. After every stage it writes report.md there and, when $OUT is set
# (a lent machine's only way back), copies it there with the logs (gpu-logs.tgz, the pair's
# weights left out): a stage that hangs or a loan cut short still sends back what came before.
# Stages env, pair and forwards need only torch and transformers; the others need the serving
# stack too (gRPC, OpenTelemetry, llguidance, ...), which a lent machine lacks and cannot
# fetch: `scripts/gpu_wheels.sh` here writes their wheels to .whl/ (git ignores it; carry it),
# and this script installs them into /tmp/specd-site. On the machine it runs with
# .venv/bin/python where there is one, else $PYTHON (default python3) and its own torch.
# Never needed for the test suite.
set -uo pipefail
cd "$(dirname "$0")/.."
all=(env pair forwards ceiling reference served served-graphs exactness)
dry=0 stages=
[[ ${GPU_CHECK_DEVICE:-} == cpu ]] && dry=1
while (($#)); do
  case $1 in
    --dry-run) dry=1 ;;
    --stages) stages=${2:-} && shift ;;
    --stages=*) stages=${1#*=} ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- && exit 0 ;;
    *) echo "unknown argument: $1 (--dry-run, --stages ${all[*]// /,})" >&2 && exit 2 ;;
  esac
  shift
done
for name in ${stages//,/ }; do
  [[ " ${all[*]} " == *" $name "* ]] || { echo "no stage $name: the stages are ${all[*]}" >&2 && exit 2; }
done
out=bench-out/gpu$( ((dry)) && echo -dry)
[[ -z $stages ]] && rm -rf "$out"
mkdir -p "$out"
began=$SECONDS
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [[ -x .venv/bin/python && -z ${PYTHON:-} ]]; then
  py=.venv/bin/python
else
  py=${PYTHON:-python3}
fi
if [[ -d .whl ]] && ! [[ $py == .venv/bin/python ]]; then
  # Once per set of wheels: a rerun of one stage on the warm machine does not pay for it again.
  wheels=$(ls .whl | md5sum)
  if [[ $(cat /tmp/specd-site/.wheels 2>/dev/null) != "$wheels" ]]; then
    timeout 45 $py -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/specd-site .whl/*.whl >"$out/wheels.txt" 2>&1 && echo "$wheels" >/tmp/specd-site/.wheels ||
      echo "(the wheels did not install)" >>"$out/wheels.txt"
  fi
  export PYTHONPATH=/tmp/specd-site:$PYTHONPATH
fi
if ((dry)); then
  device=cpu dtype=float32 shape=tiny fraction=0 forwards=(--small) tokens=16
  exactness=(tests/test_memory.py tests/test_batching.py tests/test_graphs.py tests/test_pagedkernel.py
    -k "memory or batched_forward or fork or lone_session or eager_forwards_logits or through_the_kernel")
  export TRITON_INTERPRET=1  # the paged kernel (--attention-kernel triton) in Triton's CPU interpreter
else
  device=cuda dtype=bfloat16 shape=8b fraction=0.85 forwards=() tokens=32
  exactness=(tests/test_memory.py tests/test_batching.py tests/test_post_process.py tests/test_pipeline.py
    tests/test_rejection.py tests/test_graphs.py tests/test_pagedkernel.py
    -k "not cpu and not written_out and not without_a_gpu")
fi
# The ceiling's rounds over the 16 demo prompts and the served stages' requests at each level
# decode the same prompts and token counts, so that served ÷ the models alone is a ratio of
# equals; 32 requests also keep 32 in flight for a whole level.
rounds=2 requests=32 concurrency=1,32
pair=$out/pair

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
  local served="specd serve --gpu-memory-fraction $fraction, specd bench --configs fixed:4,cost --concurrency"
  {
    echo "### GPU check, $(date -u +%Y-%m-%d), $( ((dry)) && echo 'a dry run on this CPU' || echo "$device $dtype")"
    echo
    echo "\`scripts/gpu_check.sh$( ((dry)) && echo ' --dry-run')${stages:+ --stages $stages}\` at commit" \
      "$(git rev-parse --short HEAD 2>/dev/null || echo '?'), $((SECONDS - began)) s so far; pair:" \
      "\`scripts/gpu_check.py make-pair --shape $shape\`; $tokens new tokens a request."
    echo
    echo "The figures (\`scripts/gpu_figures.py\`):"
    echo
    echo '```'
    $py scripts/gpu_figures.py "$out" 2>&1
    echo '```'
    section "The machine" env.txt 12
    section "The pair" pair.txt 6
    section "One forward of each model (\`scripts/gpu_check.py forwards\`)" forwards.txt 50
    section "The models alone (\`scripts/gpu_check.py ceiling\`: scripts/bench_ceiling.py's loops)" ceiling.txt 7
    section "transformers' generate (\`scripts/gpu_check.py reference\`)" reference.txt 10
    section "Served ($served $concurrency)" served.txt 22
    section "Served with --cuda-graphs" served-graphs.txt 22
    echo
    echo "What the workers kept and took for --cuda-graphs at load (served-graphs.log):"
    echo
    echo '```'
    grep -h "CUDA graphs\|KV pool of" "$out/served-graphs.log" 2>/dev/null | tail -8 || echo "(not run)"
    echo '```'
    section "Exactness on $device (\`pytest ${exactness[*]}\`)" exactness.txt 6
  } >"$out/report.md"
  if [[ -n ${OUT:-} ]]; then
    cp "$out/report.md" "$OUT/"
    tar -czf "$OUT/gpu-logs.tgz" --exclude="$pair" "$out" 2>/dev/null || true
  fi
}

wanted() {  # name: whether this run runs the stage
  [[ -z $stages || ,$stages, == *,$1,* ]]
}

needs_pair() {  # whether a stage this run runs needs the pair
  local name
  for name in forwards ceiling reference served served-graphs; do wanted $name && return 0; done
  return 1
}

trap report EXIT

if wanted env || ! [[ -s $out/env.txt ]]; then
  TAIL=12 stage env 15 $py scripts/gpu_check.py env
fi
if ((!dry)) && ! grep -q "^device: .*GiB" "$out/env.txt"; then
  echo "no CUDA device: this check needs a GPU (scripts/gpu_check.sh --dry-run runs it on a CPU)" >&2
  exit 1
fi
if wanted pair || { needs_pair && ! [[ -s $pair/pair.json ]]; }; then
  # Whatever was measured on another pair is no longer this pair's.
  rm -rf "$pair" "$out"/{forwards,ceiling,reference,served,served-graphs}.{txt,json}
  stage pair 50 $py scripts/gpu_check.py make-pair "$pair" --shape "$shape" --device "$device"
fi
if wanted forwards; then
  TAIL=60 stage forwards 80 $py scripts/gpu_check.py forwards "$pair" --device "$device" --dtype "$dtype" \
    --fraction 0.85 "${forwards[@]}" --out "$out/forwards.json"
fi
if ! grep -q "^serving: ok" "$out/env.txt"; then
  echo "the serving stack does not import here ($(grep '^serving:' "$out/env.txt")): the stages after forwards" \
    "need it; run scripts/gpu_wheels.sh where pip reaches a registry and carry .whl" | tee -a "$out/env.txt"
fi
if wanted ceiling; then
  stage ceiling 55 $py scripts/gpu_check.py ceiling "$pair" --device "$device" --dtype "$dtype" --gamma 4 \
    --max-new-tokens "$tokens" --rounds "$rounds" --out "$out/ceiling.json"
fi
if wanted reference || { { wanted served || wanted served-graphs; } && ! [[ -s $out/reference.json ]]; }; then
  stage reference 30 $py scripts/gpu_check.py reference "$pair" --device "$device" --dtype "$dtype" \
    --max-new-tokens "$tokens" --out "$out/reference.json"
fi
served() {  # name seconds port flags...: one served stage
  local name=$1 limit=$2 port=$3
  shift 3
  TAIL=24 stage "$name" "$limit" $py scripts/gpu_check.py served "$pair" --device "$device" --dtype "$dtype" \
    --fraction "$fraction" --port "$port" --startup-timeout 60 --gamma 4 --concurrency "$concurrency" \
    --requests "$requests" --max-new-tokens "$tokens" --reference "$out/reference.json" \
    --log "$out/$name.log" --bench-out "$out/$name-bench" --out "$out/$name.json" "$@"
}
wanted served && served served 90 50161
# Another port: the first server's sockets may linger a moment after it stops.
wanted served-graphs && served served-graphs 100 50171 --cuda-graphs
if wanted exactness; then
  stage exactness 80 env SPECD_TEST_DEVICE=$device SPECD_TEST_DTYPE=float32 $py -m pytest -q -p no:cacheprovider \
    "${exactness[@]}"
fi
echo "done in $((SECONDS - began)) s: $out/report.md"
echo
$py scripts/gpu_figures.py "$out"
