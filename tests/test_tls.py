"""TLS and mutual TLS: the workers accept only a gateway whose client certificate their
CA signed; the gateway serves TLS to clients that trust its CA; `specd certs` writes
certificates that load and name every host specd is reached by."""
from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import LoopThread, request
from draft_service.server import create_server as create_draft
from gateway.app import create_server as create_gateway
from gateway.settings import GatewaySettings
from specd.config import ClientTLS, ServerSettings, ServerTLS
from specd.grpcserver import start_server
from specd.tls import TLSConfigError, check_server_tls, client_channel
from specd.v1 import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from specd.worker.settings import DraftSettings, VerifierSettings
from specd_cli import main as specd_main
from specd_cli.certs import service_dns_names, write_dev_certs
from test_pipeline import reference_greedy
from verifier_service.server import create_server as create_verifier


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """Two unrelated development CAs: `ours` signs the deployment's certificates."""
    root = tmp_path_factory.mktemp("pki")
    ours = write_dev_certs(root / "ours")
    other = write_dev_certs(root / "other")
    return {**ours, **{f"other-{name}": path for name, path in other.items()}}


def mutual(pki) -> ServerTLS:
    """A worker's TLS: our server certificate, client certificates from our CA required."""
    return ServerTLS(pki["server.pem"], pki["server-key.pem"], client_ca=pki["ca.pem"])


@pytest.fixture(scope="module")
def secure(model_dirs, pki):
    """Workers requiring mTLS, a gateway reaching them with our client certificate and
    serving TLS (no client certificates) at its edge."""
    loop = LoopThread()
    server = ServerSettings("127.0.0.1", 0, grace_s=1.0, tls=mutual(pki), health_port=0)
    draft = loop.run(create_draft(DraftSettings(server, {"close": model_dirs["close"]})))
    verifier = loop.run(create_verifier(VerifierSettings(server, model_dirs["target"])))
    edge = ServerSettings("127.0.0.1", 0, grace_s=1.0, tls=ServerTLS(pki["server.pem"], pki["server-key.pem"]))
    gateway = loop.run(create_gateway(GatewaySettings(
        edge, verifier_address=f"127.0.0.1:{verifier.port}", draft_address=f"127.0.0.1:{draft.port}",
        worker_tls=ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"]), worker_timeout_s=10.0)))
    yield {"draft": draft.port, "verifier": verifier.port, "gateway": gateway.port}
    for running in (gateway, draft, verifier):
        loop.run(running.stop(0))
    loop.close()


def generate(port: int, tls: ClientTLS, prompt: str = "def fibonacci(n):", mode: str = "FIXED"):
    with client_channel(f"127.0.0.1:{port}", tls) as channel:
        return gateway_pb2_grpc.GatewayStub(channel).Generate(request(prompt, max_new_tokens=16, mode=mode),
                                                              timeout=60)


def test_tls_gateway_with_the_right_ca_serves_exact_output(secure, pki, target_model, tokenizer):
    response = generate(secure["gateway"], ClientTLS(ca=pki["ca.pem"]))
    assert list(response.token_ids) == reference_greedy(target_model, tokenizer, "def fibonacci(n):", 16)
    assert response.stats.draft_model == "close" and response.stats.proposed_tokens > 0  # the draft took part


@pytest.mark.parametrize("client", ["another CA", "plaintext"])
def test_tls_gateway_refuses_a_client_that_does_not_trust_it(secure, pki, client):
    tls = ClientTLS(ca=pki["other-ca.pem"]) if client == "another CA" else ClientTLS()
    with pytest.raises(grpc.RpcError) as err:
        generate(secure["gateway"], tls)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("worker", ["draft", "verifier"])
@pytest.mark.parametrize("client", ["no client certificate", "certificate of another CA", "our certificate"])
def test_worker_requiring_mtls_accepts_only_our_client_certificate(secure, pki, worker, client):
    tls = {"no client certificate": ClientTLS(ca=pki["ca.pem"]),
           "certificate of another CA": ClientTLS(pki["ca.pem"], pki["other-client.pem"],
                                                  pki["other-client-key.pem"]),
           "our certificate": ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"])}[client]
    stub_class = {"draft": worker_pb2_grpc.DraftStub, "verifier": worker_pb2_grpc.VerifierStub}[worker]
    with client_channel(f"127.0.0.1:{secure[worker]}", tls) as channel:
        call = lambda: stub_class(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=10)  # noqa: E731
        if client == "our certificate":
            assert call().models
        else:
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_gateway_without_the_client_certificate_cannot_start(secure, pki):
    loop = LoopThread()
    try:
        for worker_tls in (ClientTLS(ca=pki["ca.pem"]),
                           ClientTLS(pki["ca.pem"], pki["other-client.pem"], pki["other-client-key.pem"])):
            settings = GatewaySettings(ServerSettings("127.0.0.1", 0),
                                       verifier_address=f"127.0.0.1:{secure['verifier']}", draft_address="",
                                       worker_tls=worker_tls, worker_timeout_s=2.0)
            with pytest.raises(ConnectionError, match="TLS"):
                loop.run(create_gateway(settings))
    finally:
        loop.close()


def test_health_port_answers_plaintext_probes_beside_a_tls_port(model_dirs, pki):
    loop = LoopThread()
    health_port = _free_port()
    server = ServerSettings("127.0.0.1", 0, grace_s=0.0, tls=mutual(pki), health_port=health_port)
    running = loop.run(create_verifier(VerifierSettings(server, model_dirs["target"])))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:  # the health port serves health only
                worker_pb2_grpc.VerifierStub(channel).GetModelInfo(worker_pb2.ModelInfoRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        loop.run(running.stop(0))
        loop.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_specd_certs_writes_certificates_that_load_and_name_every_host(tmp_path):
    assert specd_main(["certs", str(tmp_path), "--name", "specd.example.com"]) == 0
    load = lambda name: x509.load_pem_x509_certificate((tmp_path / name).read_bytes())  # noqa: E731
    ca, server, client = load("ca.pem"), load("server.pem"), load("client.pem")
    for cert in (server, client):
        cert.verify_directly_issued_by(ca)  # raises if our CA did not sign it
    for cert, key in ((server, "server-key.pem"), (client, "client-key.pem")):
        private = serialization.load_pem_private_key((tmp_path / key).read_bytes(), password=None)
        assert private.public_key().public_numbers() == cert.public_key().public_numbers()
        assert (tmp_path / key).stat().st_mode & 0o077 == 0  # keys are the owner's alone
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName)) | {str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    assert {"localhost", "127.0.0.1", "specd.example.com", "specd-verifier.specd.svc.cluster.local"} <= names
    assert set(service_dns_names()) <= names
    usage = lambda cert: cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value  # noqa: E731
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage(server) and ExtendedKeyUsageOID.CLIENT_AUTH in usage(client)
    assert isinstance(ca.public_key(), ec.EllipticCurvePublicKey)
    assert specd_main(["certs", str(tmp_path)]) == 2  # never overwrites without --force


def test_tls_settings_name_the_flag_that_is_wrong(pki, tmp_path):
    with pytest.raises(TLSConfigError, match="--tls-cert and --tls-key go together"):
        check_server_tls(ServerTLS(cert=pki["server.pem"]))
    with pytest.raises(TLSConfigError, match=f"--tls-cert {tmp_path / 'nope.pem'}"):
        check_server_tls(ServerTLS(tmp_path / "nope.pem", pki["server-key.pem"]))
    with pytest.raises(TLSConfigError, match="--tls-key .*not an unencrypted PEM private key"):
        check_server_tls(ServerTLS(pki["server.pem"], pki["server.pem"]))
    with pytest.raises(TLSConfigError, match="--tls-client-ca asks for client certificates"):
        check_server_tls(ServerTLS(client_ca=pki["ca.pem"]))
    with pytest.raises(TLSConfigError, match="--tls-key .* is not the private key of --tls-cert"):
        check_server_tls(ServerTLS(pki["server.pem"], pki["client-key.pem"]))


def test_a_server_takes_renewed_certificate_files_without_a_restart(pki, tmp_path):
    """cert-manager renews a mounted Secret: the next connection gets the new certificate."""
    for name in ("server.pem", "server-key.pem"):
        shutil.copy(pki[name], tmp_path / name)
    loop = LoopThread()
    running = loop.run(start_server(ServerSettings("127.0.0.1", 0, tls=ServerTLS(
        tmp_path / "server.pem", tmp_path / "server-key.pem")), lambda server: None, []))

    def healthy(ca: Path) -> bool:
        # A channel of its own (no shared connection), so each check is a new handshake.
        tls = ClientTLS(ca=ca)
        with client_channel(f"127.0.0.1:{running.port}", tls, [("grpc.use_local_subchannel_pool", 1)]) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE
                return False
            return True

    try:
        assert healthy(pki["ca.pem"]) and not healthy(pki["other-ca.pem"])
        # Renewed by another CA: written as the kubelet does, the new files swapped in whole.
        for name in ("server.pem", "server-key.pem"):
            shutil.copy(pki[f"other-{name}"], tmp_path / f"{name}.new")
            (tmp_path / f"{name}.new").replace(tmp_path / name)
        assert healthy(pki["other-ca.pem"]) and not healthy(pki["ca.pem"])
    finally:
        loop.run(running.stop(0))
        loop.close()


@pytest.mark.parametrize("argv, message", [
    (["draft", "--tls-key", "k.pem"], "specd draft: --tls-cert and --tls-key go together"),
    (["verifier", "--tls-client-ca", "ca.pem"], "specd verifier: --tls-client-ca asks for client certificates"),
    (["gateway", "--worker-cert", "c.pem"], "specd gateway: --worker-cert and --worker-key go together"),
    (["generate", "x", "--ca", "nowhere.pem"], "specd generate: --ca nowhere.pem: No such file"),
])
def test_the_cli_refuses_bad_tls_flags_before_loading_anything(argv, message, capsys):
    assert specd_main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("server_name, ok", [("", True), ("specd-verifier", True),
                                             ("specd-verifier.specd.svc.cluster.local", True),
                                             ("verifier.elsewhere.example", False)])
def test_pods_dialled_by_ip_are_checked_against_their_service_name(secure, pki, server_name, ok):
    """How the gateway reaches pods found through EndpointSlices: by IP, checking the
    certificate for the Service's name (`_pool` passes it as server_name)."""
    from gateway.workers.backend import WorkerPool
    from gateway.workers.budgets import BudgetSettings
    from gateway.workers.router import Router

    async def infos():
        pool = WorkerPool("verifier", Router.static("verifier", [f"127.0.0.1:{secure['verifier']}"]),
                          worker_pb2_grpc.VerifierStub, BudgetSettings(floor_s=5.0),
                          tls=ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"]),
                          server_name=server_name)
        try:
            return await pool.model_infos(2.0)
        finally:
            await pool.close()

    loop = LoopThread()
    try:
        if ok:
            assert loop.run(infos())[0].name == "target"
        else:
            with pytest.raises(ConnectionError, match="verifier.elsewhere.example"):
                loop.run(infos())
    finally:
        loop.close()


def test_the_http_front_end_requires_the_client_certificate_grpc_requires(secure, pki):
    """An edge with --tls-client-ca asks HTTP callers for a certificate too."""
    import ssl
    import urllib.error
    import urllib.request

    loop = LoopThread()
    edge = ServerSettings("127.0.0.1", 0, grace_s=0.5, tls=mutual(pki))
    gateway = loop.run(create_gateway(GatewaySettings(
        edge, verifier_address=f"127.0.0.1:{secure['verifier']}", draft_address="",
        worker_tls=ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"]), worker_timeout_s=10.0,
        http_port=0)))
    try:
        url = f"https://127.0.0.1:{gateway.servicer.http.port}/health"
        anonymous = ssl.create_default_context(cafile=str(pki["ca.pem"]))
        anonymous.check_hostname = False
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, context=anonymous, timeout=10).read()
        ours = ssl.create_default_context(cafile=str(pki["ca.pem"]))
        ours.check_hostname = False
        ours.load_cert_chain(str(pki["client.pem"]), str(pki["client-key.pem"]))
        with urllib.request.urlopen(url, context=ours, timeout=10) as response:
            assert response.status == 200
    finally:
        loop.run(gateway.stop(0))
        loop.close()


def swap_in(files: dict[str, Path], directory: Path) -> None:
    """Replace certificate files as the kubelet renews a mounted Secret: each new file whole."""
    for name, source in files.items():
        shutil.copy(source, directory / f"{name}.new")
        (directory / f"{name}.new").replace(directory / name)


def test_https_takes_renewed_certificate_files_without_a_restart(secure, pki, tmp_path):
    """The HTTP front end's certificate, renewed by another CA: within the check interval,
    new handshakes get the new certificate; nothing restarts."""
    import ssl
    import time
    import urllib.request

    from gateway.edge import httpserver as http_module

    swap_in({"server.pem": pki["server.pem"], "server-key.pem": pki["server-key.pem"]}, tmp_path)
    loop = LoopThread()
    edge = ServerSettings("127.0.0.1", 0, grace_s=0.5, tls=ServerTLS(tmp_path / "server.pem",
                                                                     tmp_path / "server-key.pem"))
    gateway = loop.run(create_gateway(GatewaySettings(
        edge, verifier_address=f"127.0.0.1:{secure['verifier']}", draft_address="",
        worker_tls=ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"]), worker_timeout_s=10.0,
        http_port=0)))

    def trusted_by(ca: Path) -> bool:
        context = ssl.create_default_context(cafile=str(ca))
        context.check_hostname = False
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{gateway.servicer.http.port}/health", context=context,
                                        timeout=10) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        assert trusted_by(pki["ca.pem"]) and not trusted_by(pki["other-ca.pem"])
        swap_in({"server.pem": pki["other-server.pem"], "server-key.pem": pki["other-server-key.pem"]}, tmp_path)
        deadline = time.monotonic() + http_module.CERTIFICATE_CHECK_INTERVAL_S + 10
        while not trusted_by(pki["other-ca.pem"]):
            assert time.monotonic() < deadline, "the HTTPS port kept its old certificate"
            time.sleep(0.5)
        assert not trusted_by(pki["ca.pem"])
    finally:
        loop.run(gateway.stop(0))
        loop.close()


def test_the_gateway_presents_its_renewed_client_certificate_to_a_restarted_worker(model_dirs, pki, tmp_path):
    """The gateway's client certificate is renewed (here by another CA, which the worker
    now requires) and the verifier restarts: the gateway's next connection presents the new
    certificate and its requests are served, with no restart of the gateway."""
    client_dir, worker_dir = tmp_path / "client", tmp_path / "worker"
    client_dir.mkdir()
    worker_dir.mkdir()
    swap_in({"tls.crt": pki["client.pem"], "tls.key": pki["client-key.pem"]}, client_dir)
    swap_in({"ca.crt": pki["ca.pem"]}, worker_dir)
    loop = LoopThread()
    port = _free_port()
    worker_tls = ServerTLS(pki["server.pem"], pki["server-key.pem"], client_ca=worker_dir / "ca.crt")
    verifier_settings = VerifierSettings(ServerSettings("127.0.0.1", port, grace_s=0.5, tls=worker_tls),
                                         model_dirs["target"])
    verifier = loop.run(create_verifier(verifier_settings))
    edge = ServerSettings("127.0.0.1", 0, grace_s=0.5)
    gateway = loop.run(create_gateway(GatewaySettings(
        edge, verifier_address=f"127.0.0.1:{port}", draft_address="", worker_timeout_s=10.0,
        worker_tls=ClientTLS(pki["ca.pem"], client_dir / "tls.crt", client_dir / "tls.key"))))
    try:
        assert len(generate(gateway.port, ClientTLS(), mode="OFF").token_ids) == 16
        swap_in({"tls.crt": pki["other-client.pem"], "tls.key": pki["other-client-key.pem"]}, client_dir)
        swap_in({"ca.crt": pki["other-ca.pem"]}, worker_dir)
        loop.run(verifier.stop(0))
        verifier = loop.run(create_verifier(verifier_settings))
        replies = []
        for _ in range(3):  # the first may meet the old connection's end and be retried by the client
            try:
                replies.append(generate(gateway.port, ClientTLS(), mode="OFF"))
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert replies and len(replies[0].token_ids) == 16
    finally:
        loop.run(gateway.stop(0))
        loop.run(verifier.stop(0))
        loop.close()


@pytest.mark.parametrize("names, served", [(("specd-gateway",), True), (("someone-else",), False)])
def test_a_worker_serves_only_the_client_names_it_is_told(model_dirs, pki, names, served):
    """--tls-client-names: a certificate our CA signed is not enough; it must name the
    gateway (`specd certs` writes it as DNS name and common name)."""
    loop = LoopThread()
    tls = ServerTLS(pki["server.pem"], pki["server-key.pem"], client_ca=pki["ca.pem"], client_names=names)
    verifier = loop.run(create_verifier(VerifierSettings(ServerSettings("127.0.0.1", 0, tls=tls),
                                                         model_dirs["target"])))
    try:
        ours = ClientTLS(pki["ca.pem"], pki["client.pem"], pki["client-key.pem"])
        with client_channel(f"127.0.0.1:{verifier.port}", ours) as channel:
            call = lambda: worker_pb2_grpc.VerifierStub(channel).GetModelInfo(  # noqa: E731
                worker_pb2.ModelInfoRequest(), timeout=10)
            if served:
                assert call().models
            else:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "specd-gateway" in err.value.details() and "someone-else" in err.value.details()
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
    finally:
        loop.run(verifier.stop(0))
        loop.close()
