#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: the newcomer's and CI's one command.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check .  # lint and import order ([tool.ruff] in pyproject.toml)
.venv/bin/python -m pytest -q "$@"
