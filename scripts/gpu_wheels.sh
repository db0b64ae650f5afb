#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh installs on a GPU machine that reaches no package registry.
#
#   scripts/gpu_wheels.sh          # here, where pip reaches one; writes .whl/ (ignored by git)
#   scripts/gpu_wheels.sh --list   # only print the set, each pin with a requirement that carries it
#
# scripts/gpu_wheels.py derives the set (specd's requirements, less what the machine's image holds:
# scripts/gpu_image_packages.txt) and fetches CPython 3.12 manylinux wheels of it, at the versions
# this checkout's .venv holds, without their dependencies: the image's own packages provide the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || ./scripts/setup.sh
exec .venv/bin/python scripts/gpu_wheels.py "$@"
