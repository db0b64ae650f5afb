"""Which worker pod serves which session: pod-aware placement for one worker service.

A worker (draft or verifier) keeps a session's KV cache in its own process, so every
step of a session must reach the same pod; the gateway holds the committed tokens, so
a session whose pod went away is re-opened on another pod from those tokens
(DESIGN.md §1). `Router` makes those decisions for one worker service:

    place(sid)        where to open (or re-open) the session's stream: the pod that
                      holds it while that pod is listed and ready, else the least-loaded
                      ready pod
    endpoint_of(sid)  the pod holding the session's cache; None once that pod has left
    replace(sid)      the session's pod failed it: move it to another ready pod
    release(sid)      the session is over
    set_endpoints(…)  the service's pods and their readiness changed

Where the endpoint list comes from:
- `Router.static([...])`: a fixed address list, all ready (`specd serve`, tests, any
  deployment without Kubernetes);
- `EndpointSliceWatcher`: the EndpointSlices of a Kubernetes Service, watched with the
  official `kubernetes` client in a background thread that calls `set_endpoints`.

What happens to sessions when the list changes (decided here, relied on by callers):
- an endpoint that turns *not ready* (readiness probe failing: the pod is draining after
  SIGTERM) gets no new sessions; its sessions stay where they are, because a draining
  pod still serves the streams it has open. The next `place` of such a session (the
  caller is re-opening a stream, which a draining pod refuses) moves it.
- an endpoint that *disappears* took its caches with it: `endpoint_of` returns None for
  its sessions and the next `place`/`replace` moves them.
Moving never loses anything: the caller re-opens the session from the committed tokens.

Concurrency: `Router` is thread-safe. Every method is synchronous, never blocks on I/O
and holds one `threading.Lock` for microseconds, so asyncio code (the gateway) calls it
directly from the event loop while the watcher thread calls `set_endpoints`.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubernetes.watch import Watch

log = logging.getLogger(__name__)

# How long an endpoint that failed a session is avoided for new sessions, unless it is
# the only one left. Outside Kubernetes nothing else reports a dead static address.
DEFAULT_SUSPECT_S = 5.0


class NoEndpoint(RuntimeError):
    """No ready endpoint can take a session (the gateway answers UNAVAILABLE)."""


@dataclass(frozen=True)
class EndpointState:
    """One endpoint as the router sees it (for metrics, logs and tests)."""

    address: str
    ready: bool
    sessions: int


def parse_addresses(text: str) -> list[str]:
    """`"a:1, b:2"` → `["a:1", "b:2"]`; raise ValueError naming a malformed entry."""
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"worker address {address!r} is not HOST:PORT")
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
        self._suspect_s = suspect_s
        self._clock = clock

    @classmethod
    def static(cls, service: str, addresses: Iterable[str], **kwargs) -> Router:
        """A router over a fixed list of addresses, all ready (no Kubernetes)."""
        return cls(service, {address: True for address in addresses}, **kwargs)

    # -- sessions ----------------------------------------------------------------------

    def place(self, session_id: str) -> str:
        """Where to open the session's stream now; a new session goes to the least loaded.

        Sticky: a placed session stays on its endpoint while that one is listed and ready.
        Otherwise (new, its pod left, or it is draining) it moves to the least-loaded
        ready endpoint. Raises NoEndpoint when no endpoint is ready.
        """
        with self._lock:
            current = self._session_at.get(session_id)
            if current is not None and self._ready.get(current, False):
                return current
            return self._move(session_id, avoid=None)

    def endpoint_of(self, session_id: str) -> str | None:
        """The endpoint holding the session's cache; None if unknown or that endpoint left."""
        with self._lock:
            current = self._session_at.get(session_id)
            return current if current in self._ready else None

    def replace(self, session_id: str) -> str:
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
        if added or removed:
            log.info("%s endpoints: +%s -%s (%d ready of %d)", self.service, sorted(added),
                     sorted(removed), sum(endpoints.values()), len(endpoints))

    def snapshot(self) -> list[EndpointState]:
        """Every listed endpoint with its readiness and session count, by address."""
        with self._lock:
            return [EndpointState(address, ready, self._load.get(address, 0))
                    for address, ready in sorted(self._ready.items())]

    # -- internals (called with the lock held) -----------------------------------------

    def _move(self, session_id: str, avoid: str | None) -> str:
        target = self._least_loaded(avoid)
        self._unassign(session_id)
        self._session_at[session_id] = target
        self._load[target] = self._load.get(target, 0) + 1
        self._placements += 1
        self._placed_at[target] = self._placements
        return target

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


# -- Kubernetes: the EndpointSlices of a Service ---------------------------------------

SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def in_cluster_namespace() -> str:
    """The namespace this pod runs in (mounted with its service account token)."""
    return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()


def endpoints_from_slices(slices: Iterable[dict], port_name: str) -> dict[str, bool]:
    """Merge EndpointSlices (as JSON dicts) into address → ready.

    An address is `ip:port` with the slice's port called `port_name` (IPv6 in brackets).
    A missing `conditions.ready` means ready (the API's own rule). During a slice
    rebalance an endpoint can sit in two slices: ready in either counts as ready.
    """
    merged: dict[str, bool] = {}
    for item in slices:
        port = next((p.get("port") for p in item.get("ports") or [] if p.get("name", "") == port_name), None)
        if port is None:
            log.warning("EndpointSlice %s has no port named %r; ignored",
                        item.get("metadata", {}).get("name"), port_name)
            continue
        for endpoint in item.get("endpoints") or []:
            if not endpoint.get("addresses"):
                continue
            # Only the first address has defined meaning; the controller sets exactly one.
            host = endpoint["addresses"][0]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            ready = (endpoint.get("conditions") or {}).get("ready") is not False
            merged[address] = merged.get(address, False) or ready
    return merged


@dataclass
class Backoff:
    """Exponential backoff with full jitter between failed list/watch attempts."""

    first_s: float = 0.5
    max_s: float = 30.0
    _attempt: int = field(default=0, init=False, repr=False)

    def next_delay(self) -> float:
        delay = min(self.max_s, self.first_s * 2 ** self._attempt)
        self._attempt += 1
        return random.uniform(0.0, delay)

    def reset(self) -> None:
        self._attempt = 0


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""


class EndpointSliceWatcher:
    """Feeds a Router from the EndpointSlices of one Service, in a background thread.

    List-then-watch, as every Kubernetes controller does: list the slices labelled
    `kubernetes.io/service-name=<service>`, hand the endpoints to the router, then watch
    from the list's resourceVersion, applying ADDED/MODIFIED/DELETED to the slices held
    and handing over the merged endpoints after each event. A watch that ends normally
    (server timeout) resumes from the last resourceVersion seen; 410 Gone (history
    compacted) means list again; any other error backs off, then lists again.

    The `kubernetes` client is synchronous, hence the thread; `Router` is thread-safe.
    Needs RBAC `list` and `watch` on `discovery.k8s.io` `endpointslices` in `namespace`.
    """

    def __init__(self, router: Router, service: str, namespace: str | None = None, *,
                 port_name: str = "grpc", configuration=None, watch_timeout_s: int = 300,
                 backoff: Backoff | None = None) -> None:
        """`configuration`: a `kubernetes.client.Configuration`; None loads the in-cluster one."""
        # Imported here and in the thread, not at module level: a gateway outside
        # Kubernetes never pays for importing the client.
        from kubernetes import client, config

        if configuration is None:
            configuration = client.Configuration()
            config.load_incluster_config(client_configuration=configuration)
        self.router = router
        self.service = service
        self.namespace = namespace or in_cluster_namespace()
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        self.backoff = backoff or Backoff()
        self._api = client.DiscoveryV1Api(client.ApiClient(configuration))
        self._selector = f"kubernetes.io/service-name={service}"
        self._slices: dict[str, dict] = {}  # slice name → slice as JSON; the watcher thread's own
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._watch: Watch | None = None
        self._thread = threading.Thread(target=self._run, name=f"endpointslices-{service}", daemon=True)

    def start(self) -> EndpointSliceWatcher:
        self._thread.start()
        return self

    def wait_synced(self, timeout_s: float) -> bool:
        """Block until the first list reached the router; False on timeout.

        From asyncio: `await asyncio.to_thread(watcher.wait_synced, 30)`.
        """
        return self._synced.wait(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the watch (closing its connection) and join the thread."""
        self._stopping.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException

        while not self._stopping.is_set():
            try:
                self._watch_from(self._list())
            except _Expired:
                log.info("%s EndpointSlice watch expired (410 Gone); listing again", self.service)
            except Exception as exc:  # noqa: BLE001 — any failure: back off, list again
                if self._stopping.is_set():
                    return
                reason = f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else repr(exc)
                delay = self.backoff.next_delay()
                log.warning("%s EndpointSlice list/watch failed (%s); retrying in %.1f s",
                            self.service, reason, delay)
                self._stopping.wait(delay)

    def _list(self) -> str | None:
        """List the slices, replace what is held, publish; return the resourceVersion."""
        response = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=self._selector, _request_timeout=30)
        raw = self._api.api_client.sanitize_for_serialization(response)
        self._slices = {item["metadata"]["name"]: item for item in raw.get("items") or []}
        self._publish()
        self._synced.set()
        self.backoff.reset()
        return response.metadata.resource_version if response.metadata else None

    def _watch_from(self, resource_version: str | None) -> None:
        """Apply watch events until stopped; resume after normal ends; raise on errors."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        while not self._stopping.is_set():
            self._watch = stream = watch.Watch()
            try:
                for event in stream.stream(
                        self._api.list_namespaced_endpoint_slice, self.namespace,
                        label_selector=self._selector, resource_version=resource_version,
                        allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                        # A silent dead connection must not hang the watch forever.
                        _request_timeout=(10, self.watch_timeout_s + 30)):
                    self._apply(event["type"], event["raw_object"])
            except ApiException as exc:
                if exc.status == 410:
                    raise _Expired from exc
                raise
            resource_version = stream.resource_version or resource_version

    def _apply(self, kind: str, item: dict) -> None:
        name = item.get("metadata", {}).get("name", "")
        if kind in ("ADDED", "MODIFIED"):
            self._slices[name] = item
        elif kind == "DELETED":
            self._slices.pop(name, None)
        else:  # BOOKMARK: only moves the resourceVersion on
            return
        self._publish()

    def _publish(self) -> None:
        self.router.set_endpoints(endpoints_from_slices(self._slices.values(), self.port_name))
