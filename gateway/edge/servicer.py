"""The public `specd.v1.Gateway` servicer.

A thin adapter over `gateway.core.GatewayCore`: it turns a GenerateRequest into a
`ClientRequest`, and the core's chunks (the last with its `RequestSummary`) and errors into
protobuf and statuses (the interceptors map the typed errors; Busy gets gRPC's retry
pushback here). `gateway.app` builds the core and serves this over gRPC.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

import grpc

from gateway.core import Chunk, GatewayCore, RequestSummary
from gateway.edge.choices import choice_requests, merged
from gateway.edge.httpserver import HttpServer
from gateway.grammar import StructureSpec
from gateway.policy.loadcap import LoadCap
from gateway.request import ClientRequest, Mode
from gateway.step.engine import TokenLogprob
from gateway.step.records import Finish
from specd.contract import DIAGNOSTIC_SEGMENT, model_pair_label
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
        # proto3 cannot tell 0 from unset: a γ field of 0 is unset, as the API says.
        draft_length=speculation.draft_length or None, min_draft_length=speculation.min_draft_length or None,
        max_draft_length=speculation.max_draft_length or None, draft_model=speculation.draft_model,
        policy=speculation.policy, min_draft_confidence=speculation.min_draft_confidence or None,
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
                                              model_free=True) for name in settings.hosted_model_free]
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
    policies = core.policies
    caps = policies.load_caps()
    draft = core.backend.default_draft
    if not caps and draft:
        price = policies.pricing(draft)
        pair = model_pair_label(draft, core.backend.target.name)
        caps = {pair: LoadCap(policies.max_draft_length, price=price, alpha=policies.pair_alpha(draft),
                              shared=policies.shared_caps(pair))} if price else {}
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
