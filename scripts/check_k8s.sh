#!/usr/bin/env bash
# Render every Kubernetes overlay and validate it strictly against the official schemas,
# offline (no cluster needed). Tools from the dev extra: pip install -e '.[dev]'.
#   scripts/check_k8s.sh            # all overlays
#   scripts/check_k8s.sh gpu        # one
#   K8S_VERSION=1.34.0 scripts/check_k8s.sh
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
kubectl=$(command -v "$bin/kubectl" || command -v kubectl || true)
validate=$(command -v "$bin/kubernetes-validate" || command -v kubernetes-validate || true)
if [[ -z "$kubectl" || -z "$validate" ]]; then
  echo "check_k8s: kubectl and kubernetes-validate are needed: pip install -e '.[dev]'" >&2
  exit 2
fi
version=${K8S_VERSION:-1.33.0}
overlays=("$@")
if [[ ${#overlays[@]} -eq 0 ]]; then
  overlays=()
  for dir in k8s/overlays/*/; do overlays+=("$(basename "$dir")"); done
fi
for overlay in "${overlays[@]}"; do
  echo "== k8s/overlays/$overlay (Kubernetes $version, strict)"
  "$kubectl" kustomize "k8s/overlays/$overlay" | "$validate" --strict -k "$version" --quiet -
  echo "ok"
done
