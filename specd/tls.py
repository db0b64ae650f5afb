"""TLS and mutual TLS for every specd connection, with grpc's own credentials API.

- servers: `server_credentials(ServerTLS)`; with a client CA the server requires client
  certificates signed by it (mTLS: how workers accept only their gateways);
- the gateway towards its workers: `aio_channel(address, ClientTLS)`;
- command-line clients (`specd generate`, `specd bench`, `specd doctor`):
  `client_channel(address, ClientTLS)`.

Files are read and parsed when the settings are checked (`check_server_tls`,
`check_client_tls`), so a wrong path or a key given as a certificate is a clear
start-up error naming the flag, not a failed handshake later. A server re-reads its
files when they change on disk (cert-manager renewing a mounted Secret), from the next
handshake on; clients read theirs when a channel is made.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from specd.config import ClientTLS, ServerTLS

log = logging.getLogger(__name__)


class TLSConfigError(ValueError):
    """A TLS option names a missing or unreadable file, or lacks its pair."""


def read_certificates(path: Path, flag: str) -> bytes:
    """The PEM bytes of a certificate (chain) file; TLSConfigError naming the flag if not one."""
    data = _read(path, flag)
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise TLSConfigError(f"{flag} {path}: not a PEM certificate ({exc})") from exc
    return data


def read_private_key(path: Path, flag: str) -> bytes:
    """The PEM bytes of an unencrypted private key; TLSConfigError naming the flag if not one."""
    data = _read(path, flag)
    try:
        serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSConfigError(f"{flag} {path}: not an unencrypted PEM private key ({exc})") from exc
    return data


def read_key_pair(cert: Path, key: Path, cert_flag: str, key_flag: str) -> tuple[bytes, bytes]:
    """(key, certificate chain) PEM bytes; TLSConfigError unless the key is the certificate's."""
    key_pem, cert_pem = read_private_key(key, key_flag), read_certificates(cert, cert_flag)
    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    private = serialization.load_pem_private_key(key_pem, password=None)
    leaf = x509.load_pem_x509_certificates(cert_pem)[0]
    if private.public_key().public_bytes(*der) != leaf.public_key().public_bytes(*der):
        raise TLSConfigError(f"{key_flag} {key} is not the private key of {cert_flag} {cert}")
    return key_pem, cert_pem


def _read(path: Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{flag} {path}: {exc.strerror or exc}") from exc


def check_server_tls(tls: ServerTLS, cert_flag: str = "--tls-cert", key_flag: str = "--tls-key",
                     ca_flag: str = "--tls-client-ca") -> None:
    """Raise TLSConfigError unless the server's TLS files are all there and parse."""
    if (tls.cert is None) != (tls.key is None):
        raise TLSConfigError(f"{cert_flag} and {key_flag} go together: give both to serve TLS")
    if tls.client_names and tls.client_ca is None:
        raise TLSConfigError(f"--tls-client-names checks client certificates, which needs {ca_flag}")
    if tls.client_ca is not None and tls.cert is None:
        raise TLSConfigError(f"{ca_flag} asks for client certificates, which needs TLS: "
                             f"also give {cert_flag} and {key_flag}")
    if tls.cert is not None and tls.key is not None:  # both or neither (above)
        read_key_pair(tls.cert, tls.key, cert_flag, key_flag)
    if tls.client_ca is not None:
        read_certificates(tls.client_ca, ca_flag)


def check_client_tls(tls: ClientTLS, ca_flag: str, cert_flag: str, key_flag: str) -> None:
    """Raise TLSConfigError unless the client's TLS files are all there and parse."""
    if (tls.cert is None) != (tls.key is None):
        raise TLSConfigError(f"{cert_flag} and {key_flag} go together: give both to present a "
                             f"client certificate")
    if tls.ca is not None:
        read_certificates(tls.ca, ca_flag)
    if tls.cert is not None and tls.key is not None:  # both or neither (above)
        read_key_pair(tls.cert, tls.key, cert_flag, key_flag)


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (mutual when tls.client_ca is set); None: plaintext.

    The files are re-read when they change, for the handshakes after that.
    """
    if not tls.enabled:
        return None
    reloader = _ReloadingConfiguration(tls)
    # The fetcher may return None (keep the current configuration): grpc's stubs omit it.
    return grpc.dynamic_ssl_server_credentials(reloader.load(), reloader,  # type: ignore[arg-type]
                                               require_client_authentication=tls.client_ca is not None)


def files_stamp(paths: Sequence[Path]) -> tuple:
    """What changes when any of these files is replaced: a renewed Secret reaches a pod as
    new files (the kubelet swaps a symlink, which os.stat follows). OSError when one is gone."""
    stats = [os.stat(p) for p in paths]
    return tuple((s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)


class _ReloadingConfiguration:
    """gRPC calls this before every handshake: a new configuration when the files changed.

    A renewed Secret reaches a pod as new files (the kubelet swaps a symlink); between a
    certificate and its key being written, the pair may not match for a moment, so a
    configuration is taken only when it loads whole, else the old one stays.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self._tls = tls
        self._paths = [p for p in (tls.cert, tls.key, tls.client_ca) if p is not None]
        self._lock = threading.Lock()  # called from gRPC's threads
        self._seen = self._stamp()

    def _stamp(self) -> tuple:
        return files_stamp(self._paths)

    def load(self) -> grpc.ServerCertificateConfiguration:
        assert self._tls.cert is not None and self._tls.key is not None  # enabled; check_server_tls
        key, cert = read_key_pair(self._tls.cert, self._tls.key, "--tls-cert", "--tls-key")
        client_ca = read_certificates(self._tls.client_ca, "--tls-client-ca") if self._tls.client_ca else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        with self._lock:
            try:
                stamp = self._stamp()
                if stamp == self._seen:
                    return None
                configuration = self.load()
            except (OSError, TLSConfigError) as exc:
                log.warning("keeping the current TLS certificate: its files changed but do not load (%s)", exc)
                return None
            self._seen = stamp
            log.info("TLS certificate files changed: new connections get the new certificate")
            return configuration


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel (with a client certificate if given); None: plaintext."""
    if not tls.enabled:
        return None
    key: bytes | None = None
    cert: bytes | None = None
    if tls.cert:
        assert tls.key is not None, "a client certificate needs its key (check_client_tls)"
        key, cert = read_key_pair(tls.cert, tls.key, "client certificate", "client key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_certificates(tls.ca, "CA file") if tls.ca else None,
        private_key=key, certificate_chain=cert)


def channel_options(tls: ClientTLS, server_name: str = "", address: str = "") -> list[tuple[str, str]]:
    """The option that checks the server's certificate against a name, not the dialled host.
    A Unix domain socket has no host name: its server is checked as `localhost` unless told."""
    name = tls.server_name or server_name or ("localhost" if address.startswith("unix:") else "")
    return [("grpc.ssl_target_name_override", name)] if tls.enabled and name else []


def client_channel(address: str, tls: ClientTLS = ClientTLS(),
                   options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to a specd service: TLS when tls is enabled, else plaintext."""
    credentials = channel_credentials(tls)
    options = [*options, *channel_options(tls, address=address)]
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def aio_channel(address: str, tls: ClientTLS = ClientTLS(), options: Sequence[tuple[str, object]] = (),
                server_name: str = "") -> grpc.aio.Channel:
    """An asyncio channel to a specd service (the gateway's to its workers)."""
    credentials = channel_credentials(tls)
    options = [*options, *channel_options(tls, server_name, address)]
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """--ca, --cert, --key, --server-name: how a command-line client reaches a TLS gateway."""
    parser.add_argument("--ca", type=Path, metavar="FILE",
                        help="connect with TLS, trusting servers signed by this CA (PEM; e.g. ca.pem of "
                             "`specd certs`)")
    parser.add_argument("--cert", type=Path, metavar="FILE",
                        help="client certificate (PEM), for a gateway that requires one (--tls-client-ca)")
    parser.add_argument("--key", type=Path, metavar="FILE", help="the client certificate's private key (PEM)")
    parser.add_argument("--server-name", default="",
                        help="check the server's certificate for this name instead of the dialled host")


def client_tls_from_args(args: argparse.Namespace) -> ClientTLS:
    """The ClientTLS of add_client_arguments' flags, checked (TLSConfigError naming a bad flag)."""
    tls = ClientTLS(args.ca, args.cert, args.key, args.server_name)
    check_client_tls(tls, "--ca", "--cert", "--key")
    return tls
