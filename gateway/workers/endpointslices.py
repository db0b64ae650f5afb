"""The EndpointSlices of a Kubernetes Service, watched live, as a `gateway.workers.router.Router`'s
endpoint list.

`EndpointSliceWatcher` lists and watches the slices of one Service with the official
`kubernetes` client, in a background thread, and hands the merged endpoints (address →
ready) to the router after every change; `endpoints_from_slices` is the merge.
"""
from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gateway.workers.router import Router

if TYPE_CHECKING:
    from kubernetes.watch import Watch

log = logging.getLogger(__name__)

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

    def wait_synced(self, timeout_s: float | None) -> bool:
        """Block until the first list reached the router (None: without limit); False on timeout.

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
