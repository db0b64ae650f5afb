"""The gateway's exceptions (the whole tree, with the status of each: `specd.errors`).

Light on purpose: the engine imports `WorkerError` without importing the links.
"""
from __future__ import annotations

import grpc

from specd.errors import InvalidArgument, SpecdError


class InvalidRequest(InvalidArgument):
    """The request cannot be served as asked; the message says what to change."""


class WorkerError(SpecdError):
    """A worker failed a step for good. `code` is the gRPC status to report upstream."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.status = code.name


class DraftSkipped(SpecdError):
    """The draft sits this step out: it is marked slow (`gateway.workers.budgets`), or this step ran
    past its budget. The step goes on without a proposal; the request is not affected."""


# gRPC's retry pushback (proposal A6): a client with a retry policy waits this long before
# retrying a RESOURCE_EXHAUSTED, instead of at once; the message says the same to people.
RETRY_PUSHBACK_MS = 250


class Busy(SpecdError):
    """The gateway is at --max-concurrent-requests (or a tenant at its share): come back
    later. Each transport refuses with its own retry advice (gRPC's pushback trailer,
    HTTP's Retry-After)."""

    status = "RESOURCE_EXHAUSTED"
    trailers = (("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),)


async def refuse_busy(context, message: str) -> None:
    """Abort a call as `Busy` would leave it, from an interceptor (which runs before the
    error mapping can see an exception)."""
    context.set_trailing_metadata(Busy.trailers)
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
