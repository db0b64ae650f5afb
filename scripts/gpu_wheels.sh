#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that reaches no package registry.
#
#   scripts/gpu_wheels.sh        # here, where pip reaches one; writes .whl/ (ignored by git)
#
# Such a machine (the lent H200s: Python 3.12, with its own CUDA build of torch, numpy, scipy,
# pytest and most of what transformers needs) lacks specd's gRPC, protobuf, OpenTelemetry,
# TLS, HTTP and structured-output packages (llguidance, which the gateway and the draft
# import at load), and the GGUF reader, or has older ones. This fetches those, at the versions this
# checkout's .venv holds (the versions the tests pass with), as CPython 3.12 manylinux
# wheels (manylinux_2_31 for llguidance: the image is Ubuntu 24.04, glibc 2.39), without
# their dependencies: the machine's own packages provide the rest. About
# 30 MB, which travels with the working tree (docs/performance.md, "GPU check").
set -euo pipefail
cd "$(dirname "$0")/.."
names=(transformers tokenizers huggingface-hub grpcio grpcio-health-checking grpcio-reflection protobuf
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions opentelemetry-proto
  opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
  opentelemetry-instrumentation opentelemetry-instrumentation-grpc googleapis-common-protos
  cryptography cffi pycparser starlette uvicorn httpx2 httpcore2 truststore click llguidance gguf)
[[ -x .venv/bin/python ]] || ./scripts/setup.sh
pinned=$(.venv/bin/python - "${names[@]}" <<'EOF'
import sys
from importlib.metadata import version

for name in sys.argv[1:]:  # each one is needed there: one missing here is an error, not a skip
    print(f"{name}=={version(name)}")
EOF
)  # a command substitution, not a process one: a name missing here stops the script (set -e)
read -ra pins <<<"${pinned//$'\n'/ }"
rm -rf .whl
.venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${pins[@]}"
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1), in .whl/: ${pins[*]}"
