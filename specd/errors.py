"""specd's exceptions, in one tree, and the gRPC status each one leaves a server with.

The core raises these without importing grpc; `specd.interceptors.ErrorMappingInterceptor`
turns each one that names a `status` into that status (the only place that does), so
the servicers raise and never catch to abort. Anything else that escapes a handler is
INTERNAL, logged under a reference. Start-up errors name no status: the command that
hit them prints the message and exits.

    Exception
    └── SpecdError                           specd/errors.py             (status: none)
        ├── InvalidArgument (ValueError)     specd/errors.py             INVALID_ARGUMENT: the caller's values
        │   │                                                            cannot be served; the message says
        │   │                                                            what to change
        │   └── InvalidRequest               gateway/errors.py           INVALID_ARGUMENT: a public request,
        │                                                                every problem named
        ├── SessionNotFound (KeyError)       specd/errors.py             NOT_FOUND "<service> session lost: …":
        │                                                                the gateway re-opens the session
        ├── Overloaded (RuntimeError)        specd/errors.py             RESOURCE_EXHAUSTED "<service>: … retry
        │                                                                in about N ms"
        ├── StepCancelled                    specd/errors.py             CANCELLED: a step's session ended while
        │                                                                it ran (the gateway named it ended)
        ├── WrongModel                       specd/errors.py             FAILED_PRECONDITION: a step opens a
        │                                                                session for a model this worker does
        │                                                                not hold; the gateway moves it
        ├── Busy                             gateway/errors.py           RESOURCE_EXHAUSTED with a retry pushback:
        │                                                                the gateway (or a tenant) is at its limit
        ├── WorkerError                      gateway/errors.py           the code it carries: a worker failed a
        │                                                                step for good (the gateway passes it on)
        ├── DraftSkipped                     gateway/errors.py           none: the draft was too slow for a step,
        │                                                                which goes on without a proposal
        ├── NoEndpoint (RuntimeError)        gateway/workers/router.py   none: the links report it as
        │                                                                UNAVAILABLE and re-open or give up
        ├── UnsupportedModel (ValueError)    specd/errors.py             start-up: the KV store cannot serve a model
        ├── IncompatibleDraft (RuntimeError) gateway/workers/backend.py  start-up: a draft's tokenizer differs
        ├── KeyFileError (ValueError)        gateway/edge/auth.py        start-up: a malformed API key file
        ├── TLSConfigError (ValueError)      specd/tls.py                start-up: a TLS flag names a bad file
        ├── PortInUse (OSError)              specd/grpcserver.py         start-up: the port is taken
        └── MissingApiKey (RuntimeError)     specd_cli/clientauth.py     a client's key variable is unset

Messages may repeat a caller's value only through `clip`.
"""
from __future__ import annotations

ECHO_LIMIT = 64  # characters of a caller's value an error message may repeat


def clip(value: object, limit: int = ECHO_LIMIT) -> str:
    """`repr(value)` cut to about `limit` characters, so an echoed value cannot swell a status.

    A status message travels in HTTP/2 trailers, which clients cap (8 KiB by default):
    a 10 KB value echoed whole turns the real error into RESOURCE_EXHAUSTED.
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(str(value))} characters)"


class SpecdError(Exception):
    """The base of every specd exception. `status`: the name of the gRPC status code it
    leaves a server with (None: it never reaches a client as such); `trailers`: metadata
    that status carries (a retry pushback)."""

    status: str | None = None
    trailers: tuple[tuple[str, str], ...] = ()

    def status_message(self, service: str) -> str:
        """The status message, for a failure in `service` ("draft", "verifier", "gateway")."""
        return str(self)


class InvalidArgument(SpecdError, ValueError):
    """The caller's values cannot be served; the message says what to change."""

    status = "INVALID_ARGUMENT"


class SessionNotFound(SpecdError, KeyError):
    """The worker does not hold this session (evicted, restarted, or out of sync)."""

    status = "NOT_FOUND"

    def status_message(self, service: str) -> str:
        # The id is clipped: it is the caller's value.
        return f"{service} session lost: {clip(str(self), 200)}"


class Overloaded(SpecdError, RuntimeError):
    """The queue is full; `retry_after_ms` is the scheduler's estimate of when it will not be."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, retry_after_ms: float) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms

    def status_message(self, service: str) -> str:
        return f"{service}: {self}"


class StepCancelled(SpecdError):
    """A step's session ended while the step ran (the gateway named it ended, or its
    request's deadline passed); the step is answered with this, and nobody waits for more."""

    status = "CANCELLED"


class AheadStopped(SpecdError):
    """A run of plain steps scored ahead stopped before a step the gateway reserved for it
    (no room in the pool, a failed forward, the context's end): the gateway asks that step
    itself (`verifier_service.runahead`)."""

    status = "ABORTED"


class WrongModel(SpecdError):
    """A step opens a session for a model this worker does not hold (another worker is
    behind the address the gateway checked); the message names both identities."""

    status = "FAILED_PRECONDITION"


class UnsupportedModel(SpecdError, ValueError):
    """Start-up: the model loads, but the batched KV store cannot serve it exactly; the
    message names the model's family and why (`specd.worker.trials`)."""
