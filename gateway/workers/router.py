"""Which worker pod serves which session: pod-aware placement for one worker service.

A worker (draft or verifier) keeps a session's KV cache in its own process, so every
step of a session must reach the same pod; the gateway holds the committed tokens, so
a session whose pod went away is re-opened on another pod from those tokens
(docs/design.md §1). `Router` makes those decisions for one worker service:

    place(sid, prefix)  where to open (or re-open) the session's stream: the pod that
                      holds it while that pod is listed and ready; a new session goes
                      to the pod most likely to hold its prompt's prefix in its prefix
                      cache, unless that pod carries more than its share of the load
                      (a bound relative to the mean, and an absolute room), else to the
                      least-loaded ready pod
    fail_over(sid)    the session's pod failed it: move it to another ready pod
    has_alternative(sid)  whether another ready pod could take the session
    release(sid)      the session is over
    set_endpoints(…)  the service's pods and their readiness changed

Where the endpoint list comes from:
- `Router.static([...])`: a fixed address list, all ready (`specd serve`, tests, any
  deployment without Kubernetes);
- `gateway.workers.endpointslices.EndpointSliceWatcher`: the EndpointSlices of a Kubernetes
  Service, watched with the official `kubernetes` client in a background thread that
  calls `set_endpoints`.

Who owns what in the gateway: this module decides which replica serves a session;
`gateway.workers.backend` owns the connections to the replicas and what the workers said about
their models; `gateway.workers.links` holds one request's links (streams) to them.

What happens to sessions when the list changes (decided here, relied on by callers):
- an endpoint that turns *not ready* (readiness probe failing: the pod is draining after
  SIGTERM) gets no new sessions; its sessions stay where they are, because a draining
  pod still serves the streams it has open. The next `place` of such a session (the
  caller is re-opening a stream, which a draining pod refuses) moves it.
- an endpoint that *disappears* took its caches with it: the next `place`/`fail_over`
  of its sessions moves them.
Moving never loses anything: the caller re-opens the session from the committed tokens.

Concurrency: `Router` is thread-safe. Every method is synchronous, never blocks on I/O
and holds one `threading.Lock` for microseconds, so asyncio code (the gateway) calls it
directly from the event loop while the watcher thread calls `set_endpoints`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

# How long an endpoint that failed a session is avoided for new sessions, unless it is
# the only one left. Outside Kubernetes nothing else reports a dead static address.
DEFAULT_SUSPECT_S = 5.0
# Prefix-aware placement: the prompt's leading full blocks are keyed as the workers key
# their KV blocks (`specd.prefixkeys`: the same bytes and block size), each endpoint
# remembers the keys of the prompts it was given (at most this many, least recently
# placed first out), and a new session follows its longest match unless that endpoint
# would carry more than LOAD_SLACK × the mean load plus LOAD_ROOM sessions (a relative
# and an absolute threshold, as SGLang's cache-aware router has: with few sessions the
# cache wins, with many the load is bounded).
PREFIX_KEYS_PER_ENDPOINT = 1 << 16
LOAD_SLACK = 1.25
LOAD_ROOM = 4


class NoEndpoint(RuntimeError):
    """No ready endpoint can take a session (the gateway answers UNAVAILABLE)."""


@dataclass(frozen=True)
class EndpointState:
    """One endpoint as the router sees it (for metrics, logs and tests)."""

    address: str
    ready: bool
    sessions: int


def parse_addresses(text: str) -> list[str]:
    """`"a:1, b:2"` → `["a:1", "b:2"]`; `unix:/PATH` names a Unix domain socket. Raise
    ValueError naming a malformed entry."""
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    for address in addresses:
        if address.startswith("unix:/"):
            continue
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"worker address {address!r} is not HOST:PORT or unix:/PATH")
    return addresses


class Router:
    """Places the sessions of one worker service on its endpoints (see the module doc)."""

    def __init__(self, service: str, endpoints: dict[str, bool] | None = None, *,
                 suspect_s: float = DEFAULT_SUSPECT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._ready: dict[str, bool] = dict(endpoints or {})
        self._session_at: dict[str, str] = {}  # session id → address holding its cache
        self._load: dict[str, int] = {}  # address → sessions placed there (listed or not)
        self._suspect_until: dict[str, float] = {}  # address → clock time it is trusted again
        self._placed_at: dict[str, int] = {}  # address → placement counter, to rotate ties
        self._placements = 0
        self._prefixes: dict[str, OrderedDict[bytes, None]] = {}  # address → prompt block keys placed there
        self.prefix_placements = 0  # new sessions placed by their prefix (for tests and logs)
        self._suspect_s = suspect_s
        self._clock = clock

    @classmethod
    def static(cls, service: str, addresses: Iterable[str], **kwargs) -> Router:
        """A router over a fixed list of addresses, all ready (no Kubernetes)."""
        return cls(service, {address: True for address in addresses}, **kwargs)

    # -- sessions ----------------------------------------------------------------------

    def place(self, session_id: str, prefix: Sequence[bytes] = ()) -> str:
        """Where to open the session's stream now.

        Sticky: a placed session stays on its endpoint while that one is listed and ready.
        Otherwise (new, its pod left, or it is draining) it moves: to the ready endpoint
        that was given the longest run of its `prefix` keys (`specd.prefixkeys.prompt_keys`)
        while that one's load stays within LOAD_SLACK of the mean, else to the least-loaded
        ready endpoint. Raises NoEndpoint when no endpoint is ready.
        """
        with self._lock:
            current = self._session_at.get(session_id)
            if current is not None and self._ready.get(current, False):
                return current
            return self._move(session_id, avoid=None, prefix=prefix)

    def fail_over(self, session_id: str) -> str:
        """The session's endpoint failed it: move it to another ready endpoint.

        The failed endpoint is avoided for new sessions for a while (it may be dead
        before Kubernetes notices, and a static list never does), and for this session
        unless it is the only ready one (a restarted container keeps its pod's address).
        The caller re-opens the session from the committed tokens. Raises NoEndpoint.
        """
        with self._lock:
            failed = self._session_at.get(session_id)
            if failed is not None:
                self._suspect_until[failed] = self._clock() + self._suspect_s
            return self._move(session_id, avoid=failed)

    def has_alternative(self, session_id: str) -> bool:
        """Whether a ready endpoint other than the session's own is there to move it to."""
        with self._lock:
            current = self._session_at.get(session_id)
            return any(ok and address != current for address, ok in self._ready.items())

    def release(self, session_id: str) -> None:
        """The session is over; its endpoint's load drops. Unknown ids are ignored."""
        with self._lock:
            self._unassign(session_id)

    # -- endpoints ---------------------------------------------------------------------

    def set_endpoints(self, endpoints: dict[str, bool]) -> None:
        """Replace the endpoint list: address → ready. Sessions move lazily (module doc)."""
        with self._lock:
            added = endpoints.keys() - self._ready.keys()
            removed = self._ready.keys() - endpoints.keys()
            self._ready = dict(endpoints)
            for address in removed:
                self._suspect_until.pop(address, None)
                self._placed_at.pop(address, None)
                self._prefixes.pop(address, None)  # its caches went with it
        if added or removed:
            log.info("%s endpoints: +%s -%s (%d ready of %d)", self.service, sorted(added),
                     sorted(removed), sum(endpoints.values()), len(endpoints))

    def snapshot(self) -> list[EndpointState]:
        """Every listed endpoint with its readiness and session count, by address."""
        with self._lock:
            return [EndpointState(address, ready, self._load.get(address, 0))
                    for address, ready in sorted(self._ready.items())]

    # -- internals (called with the lock held) -----------------------------------------

    def _move(self, session_id: str, avoid: str | None, prefix: Sequence[bytes] = ()) -> str:
        target = self._holding(prefix, avoid) or self._least_loaded(avoid)
        self._unassign(session_id)
        if prefix:
            known = self._prefixes.setdefault(target, OrderedDict())
            for key in prefix:
                known[key] = None
                known.move_to_end(key)
            while len(known) > PREFIX_KEYS_PER_ENDPOINT:
                known.popitem(last=False)
        self._session_at[session_id] = target
        self._load[target] = self._load.get(target, 0) + 1
        self._placements += 1
        self._placed_at[target] = self._placements
        return target

    def _holding(self, prefix: Sequence[bytes], avoid: str | None) -> str | None:
        """The ready endpoint given the longest run of `prefix` (not `avoid`), if its load
        leaves room: at most LOAD_SLACK × the mean + LOAD_ROOM once this session is placed."""
        if not prefix:
            return None
        ready = [address for address, ok in self._ready.items() if ok and address != avoid]
        if len(ready) < 2:
            return None
        best, longest = None, 0
        for address in ready:
            known = self._prefixes.get(address)
            if not known:
                continue
            matched = next((i for i, key in enumerate(prefix) if key not in known), len(prefix))
            if matched > longest:
                best, longest = address, matched
        if best is None:
            return None
        mean = (sum(self._load.get(a, 0) for a in ready) + 1) / len(ready)
        if self._load.get(best, 0) + 1 > LOAD_SLACK * mean + LOAD_ROOM:
            return None
        self.prefix_placements += 1
        return best

    def _least_loaded(self, avoid: str | None) -> str:
        """The ready endpoint with fewest sessions, preferring trusted ones and not `avoid`.

        Ties go to the endpoint placed on longest ago, so short sessions that are
        released at once still spread over every pod.
        """
        ready = [address for address, ok in self._ready.items() if ok]
        if not ready:
            raise NoEndpoint(f"no ready {self.service} endpoint "
                             f"({len(self._ready)} listed, none ready)")
        now = self._clock()
        others = [address for address in ready if address != avoid] or ready
        trusted = [address for address in others if self._suspect_until.get(address, 0.0) <= now]
        return min(trusted or others,
                   key=lambda address: (self._load.get(address, 0), self._placed_at.get(address, 0)))

    def _unassign(self, session_id: str) -> None:
        address = self._session_at.pop(session_id, None)
        if address is None:
            return
        left = self._load[address] - 1
        if left:
            self._load[address] = left
        else:
            del self._load[address]
