"""Prometheus exposition of a worker's load: sessions held, steps queued, KV memory, the
prefix cache (vLLM's names: prompt tokens looked up and found, and the blocks it holds),
and how many of the steps the verifier scored ahead were asked for.

The gauge of open sessions is how a leak shows: once every request is over, it returns
to 0 (tests/test_batching.py checks it). Read at scrape time from the models; the
collector never writes. No gRPC here.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from specd.worker.runtime import ModelRunner

PREFIX = "specd_worker_"


@dataclass(frozen=True)
class RoleLoad:
    """What a model's role holds or has done beside its runner's sessions (each role fills
    its own figures; the other role's stay 0, as every series is exposed for both)."""

    kept_rows_bytes: int = 0  # the draft's kept q rows (`draft_service.drafter`)
    pre_drafted_sessions: int = 0  # sessions with branches pre-drafted (`draft_service.predraft`)
    run_ahead_answered: int = 0  # plain steps the verifier scored ahead (`verifier_service.runahead`)
    run_ahead_dropped: int = 0  # ...and runs of them cut short


class ServedModel(Protocol):
    """A model as a worker serves it: a role (a drafter, a scorer) over its runner."""

    runner: ModelRunner

    def role_load(self) -> RoleLoad: ...


class WorkerCollector(Collector):
    """Gauges of every model a worker hosts, labelled by model name and role (draft, verifier)."""

    def __init__(self, models: Mapping[str, ServedModel], role: str) -> None:
        self.models = models
        self.role = role

    def collect(self):
        labels = ["model", "role"]
        sessions = GaugeMetricFamily(PREFIX + "sessions", "Sessions (KV caches) the worker holds.", labels=labels)
        queued = GaugeMetricFamily(PREFIX + "queued_steps", "Steps waiting for a batched forward.",
                                   labels=labels)
        kv_bytes = GaugeMetricFamily(PREFIX + "kv_bytes", "Bytes of KV storage held by idle sessions.", labels=labels)
        kept_rows = GaugeMetricFamily(PREFIX + "kept_rows_bytes",
                                      "Bytes of the q rows draft sessions keep for their next recovered token.",
                                      labels=labels)
        pre_drafts = GaugeMetricFamily(PREFIX + "pre_drafted_sessions",
                                       "Sessions with branches pre-drafted for their next step (overlap).",
                                       labels=labels)
        run_ahead = CounterMetricFamily(PREFIX + "run_ahead_steps",
                                        "Plain steps the verifier scored ahead and answered unasked (outcome "
                                        "answered), and runs of them cut short (outcome dropped: by another step "
                                        "of the session, its end or eviction, a full KV pool, a failed forward).",
                                        labels=[*labels, "outcome"])
        queries = CounterMetricFamily(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
                                      labels=labels)
        hits = CounterMetricFamily(PREFIX + "prefix_cache_hits",
                                   "Of them, tokens whose keys and values were reused (vLLM's prefix_cache_hits).",
                                   labels=labels)
        cached = GaugeMetricFamily(PREFIX + "prefix_cache_blocks",
                                   "KV blocks the prefix cache indexes, held by a session or not.", labels=labels)
        for name, model in self.models.items():
            runner, load = model.runner, model.role_load()
            queries.add_metric([name, self.role], runner.pool.prefix_queries)
            hits.add_metric([name, self.role], runner.pool.prefix_hits)
            cached.add_metric([name, self.role], runner.pool.cached_blocks)
            run_ahead.add_metric([name, self.role, "answered"], load.run_ahead_answered)
            run_ahead.add_metric([name, self.role, "dropped"], load.run_ahead_dropped)
            sessions.add_metric([name, self.role], len(runner.sessions))
            pre_drafts.add_metric([name, self.role], load.pre_drafted_sessions)
            queued.add_metric([name, self.role], runner.scheduler.queued)
            kv_bytes.add_metric([name, self.role], runner.sessions.kv_bytes())
            kept_rows.add_metric([name, self.role], load.kept_rows_bytes)
        return [sessions, queued, kv_bytes, kept_rows, pre_drafts, run_ahead, queries, hits, cached]


def start_worker_metrics(models: Mapping[str, ServedModel], role: str, host: str,
                         port: int) -> Callable[[], None]:
    """Serve /metrics on host:port from a background thread (port 0: off); returns its stop."""
    if not port:
        return lambda: None
    registry = CollectorRegistry()
    registry.register(WorkerCollector(models, role))
    server, _ = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return stop
