"""The client side of API keys (`specd generate/bench/doctor --api-key-env VAR`).

The key is read from an environment variable, never from a flag, so it does not show in
`ps` or shell history, and it rides on every call as `authorization: Bearer KEY`.
"""
from __future__ import annotations

import collections
import os

import grpc


class MissingApiKey(RuntimeError):
    """--api-key-env names a variable that is unset or empty."""


def api_key_from_env(variable: str) -> str:
    """The key in `variable`; MissingApiKey (naming the variable, not a value) when there is none."""
    key = os.environ.get(variable, "").strip()
    if not key:
        raise MissingApiKey(f"--api-key-env {variable}: the environment variable {variable} is unset or empty")
    return key


def bearer(key: str) -> tuple[str, str]:
    """The metadata entry that carries `key`."""
    return ("authorization", f"Bearer {key}")


def api_key_metadata(variable: str) -> tuple[tuple[str, str], ...]:
    """The metadata that sends the key in `variable` with a call (for a grpc.aio stub); none
    when `variable` is empty."""
    return (bearer(api_key_from_env(variable)),) if variable else ()


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call of a channel."""

    def __init__(self, key: str) -> None:
        self._entry = bearer(key)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._entry]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def with_api_key(channel: grpc.Channel, variable: str) -> grpc.Channel:
    """`channel` sending the key in `variable` on every call; unchanged when `variable` is empty."""
    if not variable:
        return channel
    return grpc.intercept_channel(channel, BearerKey(api_key_from_env(variable)))


def add_api_key_argument(parser) -> None:
    """--api-key-env VAR, the same on every client command."""
    parser.add_argument("--api-key-env", metavar="VAR", default="",
                        help="send the API key held in this environment variable (authorization: Bearer)")
