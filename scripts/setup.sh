#!/usr/bin/env bash
# Create .venv and install specd with its test tools (torch pinned to the CPU 2.13.0 wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
.venv/bin/pip install --quiet --upgrade pip
.venv/bin/pip install --quiet -e '.[dev]'
