"""The optional `k8s/components/hub-cache` component: a Hugging Face cache volume and token."""
from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from test_k8s import K8S, KUBECTL, OVERLAYS, pytestmark, validate  # noqa: F401 - pytestmark skips without kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hub_cache_component_gives_the_workers_a_cache_and_an_optional_token(overlay, tmp_path):
    base = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{base}/overlays/{overlay}]\ncomponents: [{base}/components/hub-cache]\n")
    result = subprocess.run([KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert validate(result.stdout).returncode == 0
    deployments = {d["metadata"]["name"]: d for d in yaml.safe_load_all(result.stdout)
                   if d and d["kind"] == "Deployment"}
    for name in ("specd-verifier", "specd-draft"):
        pod = deployments[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "hub-cache")
        assert env["HF_HOME"]["value"] == mount["mountPath"]
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
        assert any(v["name"] == "hub-cache" and "ephemeral" in v for v in pod["volumes"])
    gateway = deployments["specd-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert "HF_TOKEN" not in {e["name"] for e in gateway.get("env", [])}  # the gateway loads no model
