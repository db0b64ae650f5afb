"""The optional `k8s/components/api-keys` component: a Secret mounted for `--api-keys`."""
from __future__ import annotations

import pytest

from specd_cli import build_parser
from test_k8s import OVERLAYS, pytestmark, with_component  # noqa: F401 - pytestmark skips without kubectl


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_api_keys_component_mounts_the_secret_the_gateway_reads(overlay, tmp_path):
    (gateway,) = [d for d in with_component(overlay, "api-keys", tmp_path)
                  if d["kind"] == "Deployment" and d["metadata"]["name"] == "specd-gateway"]
    pod = gateway["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "specd-api-keys" and mount["readOnly"] is True
    keys_arg = next(a for a in container["args"] if a.startswith("--api-keys="))
    assert keys_arg.split("=", 1)[1].startswith(mount["mountPath"] + "/")
    assert str(build_parser().parse_args(["gateway", keys_arg]).api_keys) == keys_arg.split("=", 1)[1]
