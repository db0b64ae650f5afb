"""API keys at the gateway: who may call, and which user segment their traffic counts under.

The key file (`specd gateway --api-keys FILE`) has one key a line, `SEGMENT KEY` or
`SEGMENT sha256:HEX` (the hex sha256 of the key, so the file need not hold it in
clear); blank lines and `#` comments are skipped. Callers send the metadata
`authorization: Bearer KEY`. `ApiKeyInterceptor` refuses a missing or unknown key with
UNAUTHENTICATED before any handler runs, sets the request's `user_segment` to the key's
segment (a tenant cannot label its traffic as another's), and caps what each tenant's
(segment's) requests in flight weigh (RESOURCE_EXHAUSTED; `request_weight`), so that no
tenant holds all of the gateway's capacity while another waits. Keys are compared as
sha256 digests with `hmac.compare_digest` and are never logged or echoed.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from gateway.errors import refuse_busy
from specd.interceptors import replace_behavior
from specd.v1 import gateway_pb2

# A slot of a tenant's share is one generation of up to SLOT_TOKENS tokens; a longer one
# weighs a slot for each SLOT_TOKENS it may reach, as the KV cache it holds on the workers
# grows with every token (two requests with n: 16 and max_tokens: 1000 took the demo
# verifier from 623 MB to 1,693 MB).
SLOT_TOKENS = 1024
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_HASHED = re.compile(r"sha256:([0-9a-fA-F]{64})")
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")


class KeyFileError(ValueError):
    """The API key file cannot be used; the message names the file and line (never a key)."""


@dataclass(frozen=True)
class ApiKey:
    """A caller: the segment its traffic counts under and the sha256 of its key."""

    segment: str
    digest: bytes
    line: int  # where the key file lists it (for messages; the key itself is never shown)


def digest(key: str) -> bytes:
    """sha256 of a key as sent by a client."""
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The keys a gateway accepts."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)

    @classmethod
    def parse(cls, text: str, source: str = "API key file") -> KeyRing:
        """Keys from the file's text; KeyFileError names the first bad line."""
        keys: dict[bytes, ApiKey] = {}
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split()
            where = f"{source}, line {number}"
            if len(fields) != 2:
                raise KeyFileError(f"{where}: expected 'SEGMENT KEY' or 'SEGMENT sha256:HEX' "
                                   f"(two fields), found {len(fields)}")
            segment, secret = fields
            if not _SEGMENT.fullmatch(segment):
                raise KeyFileError(f"{where}: segment must be 1-64 letters, digits or _ . : - "
                                   f"(starting with a letter or digit)")
            if secret.lower().startswith("sha256:"):
                hashed = _HASHED.fullmatch(secret)
                if hashed is None:
                    raise KeyFileError(f"{where}: a hashed key is 'sha256:' and 64 hex digits "
                                       f"(printf %s KEY | sha256sum)")
                key_digest = bytes.fromhex(hashed.group(1))
            else:
                key_digest = digest(secret)
            if key_digest in keys:
                raise KeyFileError(f"{where}: the same key is already listed on line {keys[key_digest].line}")
            keys[key_digest] = ApiKey(segment, key_digest, number)
        if not keys:
            raise KeyFileError(f"{source}: no keys in it; every request would be refused")
        return cls(keys.values())

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """Read a key file; KeyFileError when it is missing or malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyFileError(f"cannot read the API key file {path}: {exc}") from exc
        return cls.parse(text, str(path))

    @property
    def segments(self) -> set[str]:
        """The tenants: every segment a key maps to."""
        return {key.segment for key in self.keys}

    def find(self, key: str) -> ApiKey | None:
        """The entry of `key`, or None. Compares against every entry, in constant time each."""
        wanted = digest(key)
        found = None
        for entry in self.keys:
            if hmac.compare_digest(wanted, entry.digest):
                found = entry
        return found


def request_weight(n: int, max_tokens: int | None, logprobs: bool) -> int:
    """The slots of its tenant's share a request holds while in flight: one per choice for
    each SLOT_TOKENS of max_tokens, begun (None, the gateway's default length: one), twice
    that when it asks for log-probabilities. Those cost a log-softmax over the vocabulary at
    every verified position on the verifier, and a rendering of every token and alternative
    on the gateway's event loop."""
    return n * max(1, math.ceil((max_tokens or 0) / SLOT_TOKENS)) * (2 if logprobs else 1)


class TenantQuota:
    """Slots in flight per tenant (segment), over every transport: a request holds its
    weight (`request_weight`), and one that does not fit in what its tenant's requests in
    flight leave of the share is refused until some end. 0: no cap."""

    def __init__(self, max_in_flight: int = 0) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight: collections.Counter[str] = collections.Counter()

    def too_heavy(self, weight: int) -> str | None:
        """Why a request of `weight` slots can never be admitted (it outweighs a whole share),
        for a 400; None when it can."""
        if self.max_in_flight and weight > self.max_in_flight:
            return (f"this request weighs {weight} slots, more than a tenant's whole share of "
                    f"{self.max_in_flight}: it holds one slot per choice (n) for each {SLOT_TOKENS} tokens of "
                    f"max_tokens, twice that with log-probabilities; ask for fewer choices or tokens, or no "
                    f"log-probabilities")
        return None

    def admit(self, segment: str, weight: int = 1) -> str | None:
        """Count a request of `weight` slots in; the refusal message when the segment's
        requests in flight leave no room for it in its share."""
        held = self.in_flight[segment]
        if self.max_in_flight and held + weight > self.max_in_flight:
            return (f"segment {segment!r} holds {held} of the {self.max_in_flight} slots of its share of this "
                    f"gateway, and this request weighs {weight}; wait for one of its requests to finish or "
                    f"retry with backoff")
        self.in_flight[segment] += weight
        return None

    def leave(self, segment: str, weight: int = 1) -> None:
        self.in_flight[segment] -= weight
        if not self.in_flight[segment]:
            del self.in_flight[segment]


class AmbiguousCredentials(ValueError):
    """A call carries more than one `authorization` entry: which one decides is not the
    client's to leave to the server."""


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The KEY of the `authorization: Bearer KEY` metadata entry, if any;
    AmbiguousCredentials when there are several `authorization` entries."""
    values = [value for name, value in metadata or () if name.lower() == "authorization"]
    if len(values) > 1:
        raise AmbiguousCredentials(f"{len(values)} 'authorization' metadata entries; send exactly one")
    if not values or not isinstance(values[0], str):
        return None
    scheme, _, token = values[0].strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _same_kind(handler: grpc.RpcMethodHandler, behavior) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that runs `behavior` on the raw request (no decoding)."""
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behavior)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behavior)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behavior)
    return grpc.unary_unary_rpc_method_handler(behavior)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without a known key; the key's segment on every request it sends.

    Health checks are always open (probes carry no key); reflection is open unless
    `protect_reflection`. `quota` caps what each segment's concurrent requests weigh (all
    its keys together, over gRPC and HTTP).
    """

    def __init__(self, keys: KeyRing, protect_reflection: bool = False, quota: TenantQuota | None = None) -> None:
        self.keys = keys
        self.open_prefixes = (HEALTH_PREFIX,) if protect_reflection else (HEALTH_PREFIX, *REFLECTION_PREFIXES)
        self.quota = quota or TenantQuota()  # shared with the HTTP front end

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(self.open_prefixes):
            return handler
        try:
            token = bearer_token(handler_call_details.invocation_metadata)
        except AmbiguousCredentials as exc:
            return _same_kind(handler, _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, str(exc)))
        key = self.keys.find(token) if token is not None else None
        if key is None:
            message = ("an API key is required: send metadata 'authorization: Bearer KEY'" if token is None
                       else "the API key is not valid for this gateway")
            return _same_kind(handler, _refuse(handler, grpc.StatusCode.UNAUTHENTICATED, message))
        return self._bind(handler, key)

    async def _admit(self, key: ApiKey, weight: int, context: grpc.aio.ServicerContext) -> None:
        """Hold `weight` slots of the key's segment, or abort the call: INVALID_ARGUMENT
        when no share could ever hold it, RESOURCE_EXHAUSTED when the segment's requests in
        flight leave no room."""
        if (heavy := self.quota.too_heavy(weight)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, heavy)
        if (refusal := self.quota.admit(key.segment, weight)) is not None:
            await refuse_busy(context, refusal)

    def _bind(self, handler: grpc.RpcMethodHandler, key: ApiKey) -> grpc.RpcMethodHandler:
        """The handler with the key's segment stamped on each request and its quota held."""
        if handler.request_streaming:  # the public API has no client streams; stamp nothing
            return handler

        def stamp(request) -> None:
            fields = getattr(request, "DESCRIPTOR", None)
            if fields is not None and "user_segment" in fields.fields_by_name:
                request.user_segment = key.segment
            if fields is not None and "filter" in fields.fields_by_name:
                # Acceptance statistics: a tenant reads its own segment's rows only.
                request.filter["user_segment"] = key.segment

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def unary_stream(request, context):
                stamp(request)
                weight = _weight(request)
                await self._admit(key, weight, context)
                try:
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response
                finally:
                    self.quota.leave(key.segment, weight)

            return replace_behavior(handler, unary_stream=unary_stream)
        behavior = handler.unary_unary

        async def unary_unary(request, context):
            stamp(request)
            weight = _weight(request)
            await self._admit(key, weight, context)
            try:
                return await behavior(request, context)
            finally:
                self.quota.leave(key.segment, weight)

        return replace_behavior(handler, unary_unary=unary_unary)


def _weight(request) -> int:
    """A gRPC call's `request_weight`: a GenerateRequest's, by its n and sampling fields;
    one slot for the calls that generate nothing."""
    if not isinstance(request, gateway_pb2.GenerateRequest):
        return 1
    sampling = request.sampling
    max_tokens = sampling.max_new_tokens if sampling.HasField("max_new_tokens") else None
    return request_weight(request.n or 1, max_tokens, sampling.HasField("logprobs"))


def _refuse(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A behavior of `handler`'s shape that aborts at once with `code`."""
    if handler.response_streaming:
        async def refuse_stream(request, context):
            await context.abort(code, message)
            yield  # never reached; makes this an async generator like the handler it replaces

        return refuse_stream

    async def refuse(request, context):
        await context.abort(code, message)

    return refuse
