"""A stand-in Kubernetes API server for EndpointSlices, on loopback, for tests.

No real API server can run on this machine (no kube-apiserver, kind or k3s), so the
gateway's EndpointSliceWatcher is tested against this: an `http.server` in a thread that
speaks the part of the API the watcher uses, the way the real one does:

- `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v`
  answers an `EndpointSliceList` whose `metadata.resourceVersion` is the current one;
- the same with `watch=true&resourceVersion=N` streams the events after N as
  newline-delimited JSON (`{"type": "ADDED"|"MODIFIED"|"DELETED", "object": ...}`) over
  chunked transfer encoding, and ends after `timeoutSeconds`;
- a watch from a resourceVersion older than the history kept answers HTTP 200 with one
  `ERROR` event carrying a 410 `Status` (Expired), as the real server does.

Test controls: `put_slice`/`delete_slice` change state and emit events; `compact()`
forgets history and ends open watches (an API server restart); `fail_next(n)` answers
the next n requests with HTTP 500; `requests` records what the client asked and
`expired_watches` how many watches got 410.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

PATH_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class Event:
    resource_version: int
    type: str
    object: dict


def endpoint_slice(name: str, namespace: str, service: str, endpoints: list[tuple[str, bool]],
                   port: int, port_name: str, resource_version: int) -> dict:
    """An EndpointSlice as the API serves it; endpoints are (ip, ready)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "labels": {SERVICE_LABEL: service},
                     "resourceVersion": str(resource_version)},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready, "serving": ready,
                                                         "terminating": False}}
                      for ip, ready in endpoints],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


class StandinApiServer:
    """EndpointSlice list/watch on 127.0.0.1; use as a context manager."""

    def __init__(self, namespace: str = "specd") -> None:
        self.namespace = namespace
        self.requests: list[dict[str, str]] = []  # query of each request, plus "path"
        self.expired_watches = 0  # watches answered with 410 Gone
        self._slices: dict[str, dict] = {}
        self._events: list[Event] = []
        self._resource_version = 100
        self._oldest_kept = 0  # watches from before this resourceVersion get 410
        self._watch_generation = 0  # bumped to end every open watch
        self._failures_left = 0
        self._closed = False
        self._cond = threading.Condition()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}"

    def configuration(self):
        """A kubernetes client Configuration pointing here."""
        from kubernetes import client

        return client.Configuration(host=self.url)

    def __enter__(self) -> StandinApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._http.shutdown()
        self._http.server_close()

    # -- test controls -------------------------------------------------------------------

    def put_slice(self, name: str, service: str, endpoints: list[tuple[str, bool]], *,
                  port: int = 50053, port_name: str = "grpc") -> None:
        """Create (ADDED) or replace (MODIFIED) a slice of `service`."""
        with self._cond:
            kind = "MODIFIED" if name in self._slices else "ADDED"
            self._resource_version += 1
            item = endpoint_slice(name, self.namespace, service, endpoints, port, port_name,
                                  self._resource_version)
            self._slices[name] = item
            self._emit(kind, item)

    def delete_slice(self, name: str) -> None:
        with self._cond:
            item = self._slices.pop(name)
            self._resource_version += 1
            item = {**item, "metadata": {**item["metadata"], "resourceVersion": str(self._resource_version)}}
            self._emit("DELETED", item)

    def compact(self) -> None:
        """Forget all history and end open watches: resuming from an old version gets 410."""
        with self._cond:
            self._events.clear()
            self._resource_version += 1  # a fresh list gets a version a watch can start from
            self._oldest_kept = self._resource_version
            self._watch_generation += 1
            self._cond.notify_all()

    def fail_next(self, count: int) -> None:
        """Answer the next `count` requests with HTTP 500."""
        with self._cond:
            self._failures_left = count

    def count(self, kind: str) -> int:
        """How many `list` or `watch` requests were served."""
        watching = kind == "watch"
        return sum(1 for r in list(self.requests) if (r.get("watch") == "true") == watching)

    # -- serving -------------------------------------------------------------------------

    def _emit(self, kind: str, item: dict) -> None:
        self._events.append(Event(self._resource_version, kind, item))
        self._cond.notify_all()

    def _matching(self, selector: str, item: dict) -> bool:
        if not selector:
            return True
        key, _, value = selector.partition("=")
        return item["metadata"]["labels"].get(key) == value

    def _list_body(self, selector: str) -> dict:
        with self._cond:
            return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self._resource_version)},
                    "items": [s for s in self._slices.values() if self._matching(selector, s)]}

    def _watch_events(self, since: int, selector: str, timeout_s: float):
        """Yield events after `since` until the timeout, a compaction or shutdown."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            generation = self._watch_generation
            if since < self._oldest_kept:
                self.expired_watches += 1
                yield {"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {since}"}}
                return
        while True:
            with self._cond:
                while True:
                    # A compaction ends open watches even if newer events are waiting.
                    if self._closed or generation != self._watch_generation:
                        return
                    pending = [e for e in self._events if e.resource_version > since]
                    left = deadline - time.monotonic()
                    if pending or left <= 0:
                        break
                    self._cond.wait(left)
            if not pending:
                return
            for event in pending:
                since = event.resource_version
                if self._matching(selector, event.object):
                    yield {"type": event.type, "object": event.object}

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # chunked streaming, as the real API server

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                server.requests.append({"path": url.path, **query})
                with server._cond:
                    failing = server._failures_left > 0
                    server._failures_left -= failing
                expected = f"{PATH_PREFIX}{server.namespace}/endpointslices"
                if failing:
                    return self._send_json(500, _status(500, "InternalError", "injected failure"))
                if url.path != expected:
                    return self._send_json(404, _status(404, "NotFound", f"no route {url.path}"))
                selector = query.get("labelSelector", "")
                if query.get("watch") != "true":
                    return self._send_json(200, server._list_body(selector))
                self._stream(server._watch_events(int(query.get("resourceVersion") or 0), selector,
                                                  float(query.get("timeoutSeconds") or 60)))

            def _send_json(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, events) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    for event in events:
                        line = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped watching

        return Handler


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}
