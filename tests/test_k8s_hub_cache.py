"""The optional `k8s/components/hub-cache` component: a Hugging Face cache volume and token."""
from __future__ import annotations

import pytest

from test_k8s import OVERLAYS, pytestmark, with_component  # noqa: F401 - pytestmark skips without kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hub_cache_component_gives_the_workers_a_cache_and_an_optional_token(overlay, tmp_path):
    deployments = {d["metadata"]["name"]: d for d in with_component(overlay, "hub-cache", tmp_path)
                   if d["kind"] == "Deployment"}
    for name in ("specd-verifier", "specd-draft"):
        pod = deployments[name]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        mount = next(m for m in container["volumeMounts"] if m["name"] == "hub-cache")
        assert env["HF_HOME"]["value"] == mount["mountPath"]
        # The token as a file from an optional Secret, never in the environment.
        assert "HF_TOKEN" not in env
        token = next(m for m in container["volumeMounts"] if m["name"] == "hub-token")
        assert env["HF_TOKEN_PATH"]["value"].startswith(token["mountPath"] + "/") and token["readOnly"]
        assert any(v["name"] == "hub-token" and v["secret"]["optional"] for v in pod["volumes"])
        assert any(v["name"] == "hub-cache" and "ephemeral" in v for v in pod["volumes"])
    gateway = deployments["specd-gateway"]["spec"]["template"]["spec"]["containers"][0]
    assert not {"HF_TOKEN", "HF_TOKEN_PATH"} & {e["name"] for e in gateway.get("env", [])}  # it loads no model
