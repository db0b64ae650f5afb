"""`specd certs DIR`: a development CA, and a server and a client certificate it signs.

    ca.pem                 the CA: trusted by clients (--ca, --worker-ca) and by
                           servers that require client certificates (--tls-client-ca)
    server.pem, server-key.pem   every specd server (--tls-cert, --tls-key)
    client.pem, client-key.pem   the gateway towards its workers (--worker-cert, --worker-key)

The server certificate names `localhost`, `127.0.0.1`, `::1` and every specd Service of
`k8s/` in each form Kubernetes resolves (NAME, NAME.NS, NAME.NS.svc,
NAME.NS.svc.cluster.local), so one directory serves `specd serve --tls DIR` and a
cluster (docs/tls.md). For production, use certificates from your own CA or the
cert-manager component (k8s/components/cert-manager).
"""
from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The Services of k8s/base and their namespace (tests/test_tls.py checks these against
# the rendered manifests, so the two cannot drift apart).
K8S_NAMESPACE = "specd"
K8S_SERVICES = ("specd-gateway", "specd-draft", "specd-verifier")
FILES = ("ca.pem", "server.pem", "server-key.pem", "client.pem", "client-key.pem")


def service_dns_names(services: tuple[str, ...] = K8S_SERVICES, namespace: str = K8S_NAMESPACE) -> list[str]:
    """Every name a pod may use for these Services, shortest first."""
    return [name for service in services for name in (
        service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local")]


def server_names(extra: Sequence[str] = (), namespace: str = K8S_NAMESPACE) -> list[str]:
    """The subject alternative names of the server certificate."""
    names = ["localhost", "127.0.0.1", "::1", *service_dns_names(namespace=namespace), *extra]
    return list(dict.fromkeys(names))  # in order, once each


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
                 issuer_key: ec.EllipticCurvePrivateKey, days: int, *, ca: bool = False,
                 usage: x509.ObjectIdentifier | None = None, names: Sequence[str] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               # An hour back: clocks of the machines involved need not agree to the second.
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False,
            encipher_only=False, decipher_only=False), critical=True)
    else:
        assert usage is not None  # a leaf certificate serves a server or a client
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            issuer_key.public_key()), critical=False)
    if names:
        builder = builder.add_extension(_san(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_dev_certs(directory: Path, extra_names: Sequence[str] = (), namespace: str = K8S_NAMESPACE,
                    days: int = 365, overwrite: bool = False) -> dict[str, Path]:
    """Write the five files of the module doc into directory; return {file name: path}.

    Raises FileExistsError naming the files already there unless overwrite.
    """
    directory = Path(directory)
    paths = {name: directory / name for name in FILES}
    present = [str(p) for p in paths.values() if p.exists()]
    if present and not overwrite:
        raise FileExistsError(f"{', '.join(present)} already exist; pass --force to replace them")
    directory.mkdir(parents=True, exist_ok=True)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specd development CA")])
    ca = _certificate("specd development CA", ca_key, ca_name, ca_key, days, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = _certificate("specd server", server_key, ca_name, ca_key, days,
                          usage=ExtendedKeyUsageOID.SERVER_AUTH, names=server_names(list(extra_names), namespace))
    client = _certificate("specd-gateway", client_key, ca_name, ca_key, days,
                          usage=ExtendedKeyUsageOID.CLIENT_AUTH, names=["specd-gateway"])

    pem = serialization.Encoding.PEM
    _write(paths["ca.pem"], ca.public_bytes(pem))
    _write(paths["server.pem"], server.public_bytes(pem))
    _write(paths["client.pem"], client.public_bytes(pem))
    for name, key in (("server-key.pem", server_key), ("client-key.pem", client_key)):
        _write(paths[name], key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()), private=True)
    # The CA's key is not written: nothing else is ever signed with it, so a leaked
    # directory cannot be used to mint more certificates.
    return paths


def specd_command() -> str:
    """How to run `specd` from the user's shell, for the hints `specd certs` and `specd
    serve` print: bare when the PATH finds this one, else its path (a .venv not activated),
    so that a printed hint runs as it is. It lives here because serve imports this module
    (for FILES), never the other way."""
    here = Path(sys.executable).with_name("specd")
    found = shutil.which("specd")
    if not here.exists() or found is not None and Path(found).resolve() == here.resolve():
        return "specd"
    return str(here)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where to write ca.pem, server.pem, server-key.pem, client.pem, "
                                          "client-key.pem")
    parser.add_argument("--name", action="append", default=[], metavar="DNS_OR_IP",
                        help="another name for the server certificate (a public host name of the "
                             "gateway, say); repeatable")
    parser.add_argument("--namespace", default=K8S_NAMESPACE,
                        help=f"namespace of the specd Services in the certificate (default {K8S_NAMESPACE})")
    parser.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    parser.add_argument("--force", action="store_true", help="replace files already there")


def run(args: argparse.Namespace) -> int:
    """`specd certs`: write the files, say where and what to do with them."""
    try:
        paths = write_dev_certs(Path(args.directory), args.name, args.namespace, args.days, args.force)
    except FileExistsError as exc:
        print(f"specd certs: {exc}", file=sys.stderr)
        return 2
    specd = specd_command()
    print(f"specd certs: wrote {', '.join(str(p) for p in paths.values())}\n"
          f"server names: {', '.join(server_names(args.name, args.namespace))}\n"
          f"try: {specd} serve --tls {args.directory}   and   "
          f"{specd} generate --ca {paths['ca.pem']} \"def fibonacci(n):\"")
    return 0
