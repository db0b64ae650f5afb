"""TLS and mutual TLS for every specd connection, with grpc's own credentials API.

- servers: `server_credentials(ServerTLS)`; with a client CA the server requires client
  certificates signed by it (mTLS: how workers accept only their gateways);
- the gateway towards its workers: `aio_channel(address, ClientTLS)`;
- command-line clients (`specd generate`, `specd bench`, `specd doctor`):
  `client_channel(address, ClientTLS)`.

Files are read and parsed when the settings are checked (`check_server_tls`,
`check_client_tls`), so a wrong path or a key given as a certificate is a clear
start-up error naming the flag, not a failed handshake later.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from specd.config import ClientTLS, ServerTLS


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
    if tls.client_ca is not None and tls.cert is None:
        raise TLSConfigError(f"{ca_flag} asks for client certificates, which needs TLS: "
                             f"also give {cert_flag} and {key_flag}")
    if tls.cert is not None:
        read_certificates(tls.cert, cert_flag)
        read_private_key(tls.key, key_flag)
    if tls.client_ca is not None:
        read_certificates(tls.client_ca, ca_flag)


def check_client_tls(tls: ClientTLS, ca_flag: str, cert_flag: str, key_flag: str) -> None:
    """Raise TLSConfigError unless the client's TLS files are all there and parse."""
    if (tls.cert is None) != (tls.key is None):
        raise TLSConfigError(f"{cert_flag} and {key_flag} go together: give both to present a "
                             f"client certificate")
    if tls.ca is not None:
        read_certificates(tls.ca, ca_flag)
    if tls.cert is not None:
        read_certificates(tls.cert, cert_flag)
        read_private_key(tls.key, key_flag)


def server_credentials(tls: ServerTLS) -> grpc.ServerCredentials | None:
    """TLS credentials for a server (mutual when tls.client_ca is set); None: plaintext."""
    if not tls.enabled:
        return None
    pair = (read_private_key(tls.key, "--tls-key"), read_certificates(tls.cert, "--tls-cert"))
    client_ca = read_certificates(tls.client_ca, "--tls-client-ca") if tls.client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel (with a client certificate if given); None: plaintext."""
    if not tls.enabled:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=read_certificates(tls.ca, "CA file") if tls.ca else None,
        private_key=read_private_key(tls.key, "client key") if tls.key else None,
        certificate_chain=read_certificates(tls.cert, "client certificate") if tls.cert else None)


def channel_options(tls: ClientTLS, server_name: str = "") -> list[tuple[str, str]]:
    """The option that checks the server's certificate against a name, not the dialled host."""
    name = tls.server_name or server_name
    return [("grpc.ssl_target_name_override", name)] if tls.enabled and name else []


def client_channel(address: str, tls: ClientTLS = ClientTLS(),
                   options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A blocking channel to a specd service: TLS when tls is enabled, else plaintext."""
    credentials = channel_credentials(tls)
    options = [*options, *channel_options(tls)]
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def aio_channel(address: str, tls: ClientTLS = ClientTLS(), options: Sequence[tuple[str, object]] = (),
                server_name: str = "") -> grpc.aio.Channel:
    """An asyncio channel to a specd service (the gateway's to its workers)."""
    credentials = channel_credentials(tls)
    options = [*options, *channel_options(tls, server_name)]
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
