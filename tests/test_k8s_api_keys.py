"""The optional `k8s/components/api-keys` component: a Secret mounted for `--api-keys`."""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from specd.cli import build_parser
from test_k8s import K8S, KUBECTL, OVERLAYS, pytestmark, validate  # noqa: F401 - pytestmark skips without kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_component_mounts_the_secret_the_gateway_reads(overlay, tmp_path):
    base = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}/overlays/{overlay}]\ncomponents: [{base}/components/api-keys]\n")
    result = subprocess.run([KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert validate(result.stdout).returncode == 0
    (gateway,) = [d for d in yaml.safe_load_all(result.stdout)
                  if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "specd-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "specd-api-keys" and mount["readOnly"] is True
    keys_arg = next(a for a in container["args"] if a.startswith("--api-keys="))
    assert keys_arg.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    assert build_parser().parse_args(["gateway", keys_arg]).api_keys == keys_arg.split("=", 1)[1]
