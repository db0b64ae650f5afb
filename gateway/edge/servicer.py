"""The public `specd.v1.Gateway` servicer and the gateway's server factory.

The servicer is a thin adapter over `gateway.core.GatewayCore`: it turns a
GenerateRequest into a `ClientRequest`, and the core's chunks (the last with its
`RequestSummary`) and errors into protobuf and statuses (the interceptors map the typed
errors; Busy gets gRPC's retry pushback here).
`create_server` builds the core once and serves it over gRPC, and over OpenAI-compatible
HTTP (`gateway.edge.http`) when --http-port is given.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc

from gateway.core import Chunk, GatewayCore, RequestSummary
from gateway.edge.auth import ApiKeyInterceptor, KeyRing, TenantQuota
from gateway.edge.choices import choice_requests, merged
from gateway.edge.connections import EdgeLimits, default_max_connections
from gateway.edge.http import HttpServer, OpenAIApp
from gateway.edge.liveness import watch_verifiers
from gateway.edge.metrics import start_metrics_server
from gateway.grammar import StructureSpec
from gateway.policy.loadcap import LoadCap
from gateway.policy.priors import best_caps, measure_overheads
from gateway.policy.selection import DraftSelector
from gateway.proposers.modelfree import SuffixCache
from gateway.request import ClientRequest, Mode
from gateway.settings import DRAFT_SELECTIONS, GatewaySettings
from gateway.stats.acceptance import AcceptanceStats
from gateway.stats.drift import load_baseline
from gateway.stats.paircosts import PairCosts
from gateway.step.engine import TokenLogprob
from gateway.step.records import Finish
from gateway.workers.backend import connect
from gateway.workers.loadshare import keep_sharing, share_once
from specd.contract import DIAGNOSTIC_SEGMENT, MAX_DRAFT_LENGTH, MODEL_FREE, SUFFIX, model_pair_label
from specd.grpcserver import RunningServer, start_health, start_server
from specd.steps import ModelInfo
from specd.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger(__name__)

_MODES = {
    gateway_pb2.SPECULATION_MODE_AUTO: Mode.AUTO,
    gateway_pb2.SPECULATION_MODE_FIXED: Mode.FIXED,
    gateway_pb2.SPECULATION_MODE_OFF: Mode.OFF,
}
_FINISH = {
    Finish.LENGTH: gateway_pb2.FINISH_REASON_LENGTH,
    Finish.EOS: gateway_pb2.FINISH_REASON_EOS,
    Finish.STOP: gateway_pb2.FINISH_REASON_STOP,
}


def structure_from_pb(message: gateway_pb2.StructuredOutput) -> StructureSpec | None:
    """The request's structure, or None when no kind is set."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_schema":
        return StructureSpec("json", message.json_schema)
    if kind == "json_object":
        return StructureSpec("json_object", "")
    if kind == "choice":
        return StructureSpec("choice", json.dumps(list(message.choice.choices)))
    return StructureSpec(kind, getattr(message, kind))


def client_request_from_pb(request: gateway_pb2.GenerateRequest) -> ClientRequest:
    """A GenerateRequest as a `ClientRequest` (proto3's unset fields as None; a seed of 0,
    which proto3 cannot tell from none, asks the gateway to pick one)."""
    sampling, speculation = request.sampling, request.speculation
    mode = _MODES.get(speculation.mode)
    return ClientRequest(
        prompt=request.prompt, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
        seed=sampling.seed or None,
        max_new_tokens=sampling.max_new_tokens if sampling.HasField("max_new_tokens") else None,
        stop=list(sampling.stop), presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias), min_p=sampling.min_p, min_tokens=sampling.min_tokens,
        stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs if sampling.HasField("logprobs") else None,
        structure=structure_from_pb(sampling.structured),
        mode=mode.value if mode is not None else str(speculation.mode),
        draft_length=speculation.draft_length, min_draft_length=speculation.min_draft_length,
        max_draft_length=speculation.max_draft_length, draft_model=speculation.draft_model,
        policy=speculation.policy, min_draft_confidence=speculation.min_draft_confidence,
        overlap=speculation.overlap if speculation.HasField("overlap") else None,
        task_type=request.task_type, user_segment=request.user_segment, cache_salt=request.cache_salt)


def _logprobs_pb(logprobs: tuple[TokenLogprob, ...]) -> list[gateway_pb2.TokenLogprobs]:
    return [gateway_pb2.TokenLogprobs(token_id=one.token, logprob=one.logprob, top_ids=[t for t, _ in one.top],
                                      top_logprobs=[v for _, v in one.top]) for one in logprobs]


def _stats_pb(summary: RequestSummary) -> gateway_pb2.GenerationStats:
    """A request's summary as the public API's statistics message (the same fields)."""
    return gateway_pb2.GenerationStats(**dataclasses.asdict(summary))


def _chunk_pb(index: int, chunk: Chunk) -> gateway_pb2.GenerateChunk:
    message = gateway_pb2.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, index=index,
                                        logprobs=_logprobs_pb(chunk.logprobs))
    if chunk.finish is not None:
        assert chunk.summary is not None  # the last chunk carries the summary
        message.finish_reason = _FINISH[chunk.finish]
        message.stats.CopyFrom(_stats_pb(chunk.summary))
        message.trace_id = chunk.trace_id
    return message


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and GenerateStream (through the core), and the read-only RPCs."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.http: HttpServer | None = None  # the HTTP front end over the same core, when started

    async def _chunks(self, request: gateway_pb2.GenerateRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateChunk]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        # aclosing: a client that goes away closes the links now, not at garbage collection.
        # InvalidRequest, Busy and WorkerError leave as their statuses (specd.interceptors).
        choices = choice_requests(client_request_from_pb(request), request.n or 1)
        async with contextlib.aclosing(merged([self.core.generate(one, deadline) for one in choices])) as chunks:
            async for index, chunk in chunks:
                yield _chunk_pb(index, chunk)

    async def GetAcceptanceStats(self, request, context) -> gateway_pb2.AcceptanceStatsResponse:
        # An unknown label is InvalidArgument: INVALID_ARGUMENT (specd.interceptors).
        core = self.core
        rows = core.stats.query(list(request.group_by), dict(request.filter), request.window)
        response = gateway_pb2.AcceptanceStatsResponse(window_steps=core.stats.window_steps)
        for labels, counts in rows:
            response.rows.add(
                labels=labels, drafts=counts.drafts, draft_tokens=counts.draft_tokens,
                accepted_tokens=counts.accepted_tokens, emitted_tokens=counts.emitted_tokens,
                acceptance_rate=counts.acceptance_rate, mean_acceptance_length=counts.mean_acceptance_length,
                proposed_per_position=counts.proposed_per_position,
                accepted_per_position=counts.accepted_per_position,
                acceptance_by_generation_bucket={k: a / p for k, (p, a) in counts.by_generation_bucket.items() if p})
        for row in core.costs.cost_table():
            response.costs.add(model_pair=row.model_pair, target_step_ms=row.target_step_ms,
                               draft_ms_per_token=row.draft_ms_per_token, draft_cost_ratio=row.draft_cost_ratio,
                               verify_cost_ratio=row.verify_cost_ratio)
        return response

    async def GetGatewayInfo(self, request, context) -> gateway_pb2.GatewayInfoResponse:
        core = self.core
        backend, settings = core.backend, core.settings
        drafts = [(info, "") for info in backend.drafts.values()] + list(backend.unusable.values())
        # Tenants (callers with API keys) see names and digests, not the host's paths.
        paths = settings.api_keys_file is None
        target = backend.target
        model_free = [gateway_pb2.ServedModel(name=name, vocab_size=target.vocab_size, max_context=target.max_context,
                                              tokenizer_fingerprint=target.tokenizer_fingerprint, usable=True,
                                              model_free=True) for name in settings.model_free]
        return gateway_pb2.GatewayInfoResponse(
            target=_served_model(backend.target, "", paths),
            drafts=[_served_model(info, problem, paths) for info, problem in drafts] + model_free,
            max_draft_length=settings.max_draft_length, default_draft_length=settings.default_draft_length,
            auto_policy=settings.auto_policy, task_drafts=settings.task_drafts,
            draft_selection="goodput" if core.selector is not None else "task-map",
            diagnostic_segment=DIAGNOSTIC_SEGMENT, drift_min_drop=settings.drift.min_drop,
            drift_baseline_pinned=bool(core.stats.baseline), load_caps=_load_cap_rows(core))

    async def GenerateStream(self, request, context):
        # aclosing: a cancelled call ends the request's worker sessions now, not at garbage collection.
        async with contextlib.aclosing(self._chunks(request, context)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        completions = [gateway_pb2.Completion(index=i) for i in range(request.n or 1)]
        parts: list[list[str]] = [[] for _ in completions]
        trace_id = ""
        async for chunk in self._chunks(request, context):
            completion = completions[chunk.index]
            parts[chunk.index].append(chunk.text)
            completion.token_ids.extend(chunk.token_ids)
            completion.logprobs.extend(chunk.logprobs)
            if chunk.HasField("stats"):
                completion.finish_reason = chunk.finish_reason
                completion.stats.CopyFrom(chunk.stats)
                trace_id = trace_id or chunk.trace_id
        for completion, texts in zip(completions, parts):
            completion.text = "".join(texts)
        first, *others = completions
        return gateway_pb2.GenerateResponse(text=first.text, token_ids=first.token_ids,
                                            finish_reason=first.finish_reason, stats=first.stats, trace_id=trace_id,
                                            logprobs=first.logprobs, choices=others)


def _load_cap_rows(core: GatewayCore) -> list[gateway_pb2.LoadCapRow]:
    """Each pair's load caps: the prior's at every load it priced, the cap in force where a
    level has run (a pair with no request yet: the default draft's prior alone)."""
    caps = core.load_caps()
    if not caps and core.backend.default_draft:
        prior = core.prior(core.backend.default_draft)
        pair = model_pair_label(core.backend.default_draft, core.backend.target.name)
        caps = {pair: LoadCap(core.settings.max_draft_length, prior=prior,
                              shared=core.shared_caps(pair))} if prior else {}
    rows = []
    for pair, load_cap in sorted(caps.items()):
        in_force, origins = load_cap.caps(), load_cap.origins()
        for load, prior_cap in sorted(load_cap.prior_caps.items()):
            origin = origins.get(load, "prior")
            rows.append(gateway_pb2.LoadCapRow(model_pair=pair, load=load, prior=prior_cap,
                                               cap=in_force.get(load, prior_cap),
                                               learned=origin == "learned", origin=origin))
    return rows


def _served_model(info: ModelInfo, problem: str, path: bool) -> gateway_pb2.ServedModel:
    """A worker's ModelInfo as the public API shows it (no tokenizer files; the model's
    directory only when `path`)."""
    return gateway_pb2.ServedModel(
        name=info.name, vocab_size=info.vocab_size, max_context=info.max_context,
        tokenizer_fingerprint=info.tokenizer_fingerprint, weights_digest=info.weights_digest,
        parameter_bytes=info.parameter_bytes, card_json=info.card_json, model_path=info.model_path if path else "",
        usable=not problem, problem=problem)


async def create_server(settings: GatewaySettings) -> RunningServer:
    """Connect to the workers (checking their models) and start serving the public API:
    gRPC, and OpenAI-compatible HTTP on settings.http_port when it is set.

    A malformed API key file raises `gateway.edge.auth.KeyFileError`, a bad baseline file,
    chat template file or setting ValueError, before any worker is contacted.
    """
    keys, quota = edge_keys(settings)
    problems = settings.drift.problems()
    if settings.draft_selection not in DRAFT_SELECTIONS:
        problems.append(f"draft selection must be one of {list(DRAFT_SELECTIONS)}, got {settings.draft_selection!r}")
    problems += model_free_problems(settings)
    if not 1 <= settings.max_draft_length <= MAX_DRAFT_LENGTH:  # the workers refuse a longer step
        problems.append(f"--max-draft-length must be in [1, {MAX_DRAFT_LENGTH}], got {settings.max_draft_length}")
    elif not 0 <= settings.default_draft_length <= settings.max_draft_length:
        problems.append(f"--draft-length must be in [0, {settings.max_draft_length}] (--max-draft-length), got "
                        f"{settings.default_draft_length}")
    if settings.http_header_timeout_s <= 0 or settings.http_max_connections < 0 or settings.max_chat_messages < 1:
        problems.append("--http-header-timeout must be above 0, --http-max-connections 0 or more and "
                        "--max-chat-messages 1 or more")
    chat_template = None
    if settings.chat_template is not None:
        try:
            chat_template = settings.chat_template.read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(f"cannot read the chat template {settings.chat_template}: {exc.strerror}")
    if problems:
        raise ValueError("; ".join(problems))
    baseline = load_baseline(settings.acceptance_baseline) if settings.acceptance_baseline else None
    # The health port first: while the gateway waits for its workers (minutes, for a GPU
    # deploy), a liveness probe finds it alive and a readiness probe finds it not ready.
    health_port = await start_health(settings.server)
    try:
        backend = await connect(settings)
    except BaseException:
        if health_port.server is not None:
            await health_port.server.stop(0)
        raise
    stats = AcceptanceStats(window_steps=settings.window_steps, drift=settings.drift, baseline=baseline)
    selector = None
    costs = PairCosts()
    if settings.draft_selection == "goodput" and len(backend.drafts) > 1:
        target, max_gamma = backend.target.name, settings.max_draft_length
        selector = DraftSelector(
            list(backend.drafts), settings.task_drafts,
            speedup=lambda draft, alpha: costs.predicted_speedup(model_pair_label(draft, target), alpha, max_gamma))
    suffix_cache = SuffixCache(settings.suffix_cache_tokens) if SUFFIX in settings.model_free else None
    core = GatewayCore(backend, settings, stats, costs, selector, suffix_cache)
    core.overheads = await measure_overheads(core)
    if core.overheads is not None:
        log.info("step overheads beyond the forwards: %.2f ms plain, %.2f ms speculative; AUTO's load cap starts "
                 "at %s (load → γ)", core.overheads.plain_ms, core.overheads.spec_ms,
                 best_caps(core.prior(backend.default_draft) or {}))
    if settings.share_load_caps_s > 0:  # start from what the other gateways of the target learned
        await share_once(core)
    servicer = GatewayServicer(core)
    metrics = None
    if settings.metrics_port:
        metrics, _ = start_metrics_server(stats, costs, settings.metrics_host, settings.metrics_port,
                                          selector, suffix_cache, core.load_caps, core.floors)

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
        sharing = asyncio.get_running_loop().create_task(keep_sharing(core, settings.share_load_caps_s))
    return running


def model_free_problems(settings: GatewaySettings) -> list[str]:
    """What is wrong with the model-free proposer settings."""
    problems = []
    unknown = [name for name in settings.model_free if name not in MODEL_FREE]
    if unknown:
        problems.append(f"unknown model-free proposers {unknown}; choose from {list(MODEL_FREE)}")
    if not 1 <= settings.prompt_lookup_min <= settings.prompt_lookup_max:
        problems.append(f"prompt lookup needs 1 ≤ min n ≤ max n, got {settings.prompt_lookup_min} and "
                        f"{settings.prompt_lookup_max}")
    if settings.suffix_cache_tokens < 0:
        problems.append(f"the suffix cache cannot hold {settings.suffix_cache_tokens} tokens; give 0 or more")
    return problems


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
