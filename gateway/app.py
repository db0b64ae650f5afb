"""The gateway, composed: its settings checked, its workers connected, its core built, and
the core served over gRPC (`gateway.edge.servicer`), over OpenAI-compatible HTTP
(`gateway.edge.http`) when --http-port is given, and to Prometheus when --metrics-port is.

The one place that knows every part of the gateway; no module imports it but the CLI's
launcher and the tests that start a gateway.
"""
from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from gateway.core import GatewayCore
from gateway.edge.auth import ApiKeyInterceptor, KeyRing, TenantQuota
from gateway.edge.connections import EdgeLimits, default_max_connections
from gateway.edge.http import OpenAIApp
from gateway.edge.httpserver import HttpServer
from gateway.edge.liveness import watch_verifiers
from gateway.edge.metrics import start_metrics_server
from gateway.edge.servicer import GatewayServicer
from gateway.policy.priors import best_caps, measure_overheads
from gateway.policy.selection import DraftSelector
from gateway.proposers.corpus import Corpus, NGramTable, check_corpus, read_corpus
from gateway.proposers.modelfree import SuffixCache
from gateway.settings import GatewaySettings
from gateway.stats.acceptance import AcceptanceStats
from gateway.stats.drift import load_baseline
from gateway.stats.paircosts import PairCosts
from gateway.workers.backend import Backend, connect
from gateway.workers.loadshare import keep_sharing, share_once
from specd.contract import SUFFIX, model_pair_label
from specd.grpcserver import RunningServer, start_health, start_server
from specd.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)


async def create_server(settings: GatewaySettings) -> RunningServer:
    """Connect to the workers (checking their models) and start serving the public API:
    gRPC, and OpenAI-compatible HTTP on settings.http_port when it is set.

    A malformed API key file raises `gateway.edge.auth.KeyFileError`, a bad baseline file,
    chat template file, corpus file or setting ValueError, before any worker is contacted;
    a corpus written with another tokenizer than the target's ValueError once it is known.
    """
    keys, quota = edge_keys(settings)
    problems = settings.problems()
    chat_template = None
    if settings.chat_template is not None:
        try:
            chat_template = settings.chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(f"cannot read the chat template {settings.chat_template}: {exc.strerror}")
    corpus = None
    if settings.corpus is not None:
        try:
            corpus = read_corpus(settings.corpus)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("; ".join(problems))
    baseline = load_baseline(settings.acceptance_baseline) if settings.acceptance_baseline else None
    # The health port first: while the gateway waits for its workers (minutes, for a GPU
    # deploy), a liveness probe finds it alive and a readiness probe finds it not ready.
    health_port = await start_health(settings.server)
    try:
        backend = await connect(settings)
        try:
            corpus_table = await _corpus_table(settings.corpus, corpus, backend)
        except BaseException:
            await backend.close()
            raise
    except BaseException:
        if health_port.server is not None:
            await health_port.server.stop(0)
        raise
    stats = AcceptanceStats(window_steps=settings.window_steps, drift=settings.drift, baseline=baseline)
    selector = None
    costs = PairCosts()
    if settings.draft_selection == "goodput" and len(backend.drafts) > 1:
        target = backend.target.name
        selector = DraftSelector(
            list(backend.drafts), settings.task_drafts,
            speedup=lambda draft, alpha: costs.predicted_speedup(model_pair_label(draft, target), alpha,
                                                                 settings.max_draft_length))
    suffix_cache = SuffixCache(settings.suffix_cache_tokens) if SUFFIX in settings.model_free else None
    core = GatewayCore(backend, settings, stats, costs, selector, suffix_cache, corpus_table)
    policies = core.policies
    policies.overheads = overheads = await measure_overheads(backend.target, backend.drafts.get(backend.default_draft),
                                                             core.generate)
    if overheads is not None:
        log.info("step overheads beyond the forwards: %.2f ms plain, %.2f ms speculative; AUTO's load cap starts "
                 "at %s (load → γ)", overheads.plain_ms, overheads.spec_ms,
                 best_caps(policies.prior(backend.default_draft) or {}))
    if settings.share_load_caps_s > 0:  # start from what the other gateways of the target learned
        await share_once(policies, backend.verifier)
    servicer = GatewayServicer(core)
    metrics = None
    if settings.metrics_port:
        metrics, _ = start_metrics_server(stats, costs, settings.metrics_host, settings.metrics_port,
                                          selector, suffix_cache, policies.load_caps, policies.floors)

    watch: asyncio.Task | None = None  # the verifiers' liveness, once the server runs
    sharing: asyncio.Task | None = None  # the load caps' sharing rounds (`gateway.workers.loadshare`)

    async def stop() -> None:
        for task in (watch, sharing):
            if task is not None:
                task.cancel()
        if servicer.http is not None:
            await servicer.http.stop()
        core.close()
        if metrics is not None:
            metrics.shutdown()
            metrics.server_close()
        await backend.close()

    service = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    interceptors = [ApiKeyInterceptor(keys, settings.protect_reflection, quota)] if keys is not None else []
    running = await start_server(
        settings.server, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        [service], interceptors=interceptors, on_stop=stop, options=edge_options(settings), health_port=health_port)
    running.servicer = servicer
    if settings.http_port is not None:
        tls = settings.server.tls
        limits = EdgeLimits(settings.http_header_timeout_s,
                            settings.http_max_connections or default_max_connections())
        try:
            http = HttpServer(OpenAIApp(core, keys, quota, chat_template, lambda: core.serving),
                              settings.server.host, settings.http_port, limits, *(
                                  str(path) if path else None for path in (tls.cert, tls.key, tls.client_ca)))
            await http.start()
        except BaseException:
            await running.stop(0)
            raise
        servicer.http = http

    async def drain(grace_s: float) -> None:
        core.set_serving(False)  # /health answers 503 at once, as gRPC health says NOT_SERVING
        if servicer.http is not None:
            await servicer.http.drain(grace_s)

    running.draining = drain
    watch = asyncio.get_running_loop().create_task(
        watch_verifiers(backend.verifier, running.health, [service], on_change=core.set_serving))
    if settings.share_load_caps_s > 0:
        sharing = asyncio.get_running_loop().create_task(
            keep_sharing(policies, backend.verifier, settings.share_load_caps_s))
    return running


async def _corpus_table(path: Path | None, corpus: Corpus | None, backend: Backend) -> NGramTable | None:
    """The corpus proposer's table, once the target is known to share the corpus's tokenizer
    (ValueError when it does not). Built off the event loop, where the health port answers
    the probes meanwhile."""
    if corpus is None or path is None:
        return None
    target = backend.target
    problem = check_corpus(corpus, path, target.tokenizer_fingerprint, target.vocab_size)
    if problem is not None:
        raise ValueError(problem)
    began = time.perf_counter()
    table = await asyncio.to_thread(NGramTable, corpus.sequences)
    log.info("the corpus proposer drafts from %s: %d answers, %d tokens, %d contexts (built in %.1f s)",
             path, len(corpus.sequences), corpus.tokens, len(table), time.perf_counter() - began)
    return table


def edge_keys(settings: GatewaySettings) -> tuple[KeyRing | None, TenantQuota]:
    """The API keys, when the gateway has a key file (KeyFileError when it is malformed),
    and the per-tenant share both front ends hold requests against.

    Each tenant (segment) may hold --key-max-in-flight requests; unset, three quarters of
    --max-concurrent-requests when the file names more than one tenant (a lone tenant
    may use everything): no tenant takes all the capacity while another waits.
    """
    if settings.api_keys_file is None:
        return None, TenantQuota()
    keys = KeyRing.load(settings.api_keys_file)
    share = settings.key_max_in_flight
    if not share and len(keys.segments) > 1:
        share = max(1, settings.max_concurrent_requests * 3 // 4)
    return keys, TenantQuota(share)


def edge_options(settings: GatewaySettings) -> list[tuple[str, int]]:
    """The public server's small limits; the worker channels keep `specd.grpcserver`'s large ones."""
    return [
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", 16 * 1024 * 1024),  # replies are text and ids, never distributions
        ("grpc.max_concurrent_streams", settings.max_streams_per_connection),
        ("grpc.max_metadata_size", 16 * 1024),
        # Keepalive policy: clients may ping every min_client_ping_interval_s, with or
        # without calls in flight; a client pinging faster gets GOAWAY after 2 strikes.
        ("grpc.http2.min_ping_interval_without_data_ms", int(settings.min_client_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.keepalive_permit_without_calls", 1),
        # The server pings an idle connection every 2 minutes and drops it when no answer
        # comes within 20 s: a vanished client does not hold its streams for ever.
        ("grpc.keepalive_time_ms", 120_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # gRPC clients keep one connection to one gateway: without an age, gateways the
        # autoscaler adds get no traffic from clients already connected. gRPC spreads the
        # age by ±10%; a call in flight then has half an hour to finish.
        *([("grpc.max_connection_age_ms", int(settings.max_connection_age_s * 1000)),
           ("grpc.max_connection_age_grace_ms", 1_800_000)] if settings.max_connection_age_s > 0 else []),
    ]
