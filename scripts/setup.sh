#!/usr/bin/env bash
# Create .venv and install specd with its test tools, torch pinned to 2.13.0.
# From the public index on Linux that pin is the CUDA build (several GB); set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU wheel (the Dockerfile's way).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
# The stack CI tests: pyproject.toml allows torch 2.11 to 2.13 (2.11 is the GPU image's),
# and this venv takes 2.13.0 before specd, so that the range leaves it as it is.
if [[ -n "${TORCH_INDEX:-}" ]]; then
  .venv/bin/pip install --quiet torch==2.13.0 --index-url "${TORCH_INDEX}"
else
  .venv/bin/pip install --quiet torch==2.13.0
fi
.venv/bin/pip install --quiet -e '.[dev]'
