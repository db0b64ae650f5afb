"""The `specd.v1.Draft` servicer and its server factory.

Thin by design: look up the draft, call its drafter (`draft_service.drafter`), convert;
the stream's skeleton is `specd.worker.service`'s, shared with the verifier.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from opentelemetry import trace

from draft_service.drafter import Drafter
from specd import wire
from specd.contract import MAX_DRAFT_LENGTH
from specd.errors import InvalidArgument, clip
from specd.grpcserver import RunningServer, start_server
from specd.steps import DraftReply, PreDraftRequest
from specd.telemetry import start_worker_span
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.worker import service
from specd.worker.metrics import start_worker_metrics
from specd.worker.settings import DraftSettings

# A proxy: it finds the provider that setup_tracing installs, whenever that happens.
_TRACER = trace.get_tracer("specd.draft")


def _span_attributes(name: str, request: worker_pb2.ProposeRequest, proposal: DraftReply) -> dict:
    """Attributes of a `specd.draft.propose` or `specd.draft.recover` span (docs/tracing.md)."""
    probs = proposal.token_probs
    attributes = {
        **service.step_span_attributes(name, request.delta, proposal.forward_ms, proposal.batch),
        "specd.draft_length": request.draft_length,
        "specd.proposed": len(proposal.tokens),
        "specd.pre_drafted": proposal.pre_drafted,
    }
    if probs:
        attributes.update({"specd.draft.token_probs": list(probs), "specd.draft.token_prob.min": min(probs),
                           "specd.draft.token_prob.mean": sum(probs) / len(probs)})
    if proposal.recovered is not None:
        attributes["specd.recovered_token"] = proposal.recovered
    return attributes


class DraftServicer(worker_pb2_grpc.DraftServicer):
    """Proposes draft tokens; one multiplexed stream per gateway connection."""

    def __init__(self, drafts: dict[str, Drafter]) -> None:
        if not drafts:
            raise ValueError("the draft service needs at least one draft model")
        self.drafts = drafts
        self.default = next(iter(drafts))

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfoResponse:
        return worker_pb2.ModelInfoResponse(
            models=[wire.model_info_to_pb(d.runner.info) for d in self.drafts.values()],
            protocol=wire.WORKER_PROTOCOL)

    async def Propose(self, request_iterator: AsyncIterator[worker_pb2.ProposeSteps],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.ProposeResults]:
        async with contextlib.aclosing(service.serve_multiplexed(
                request_iterator, self._propose, worker_pb2.ProposeResults, worker_pb2.ProposeResult,
                "/specd.v1.Draft/Propose")) as results:
            async for message in results:
                yield message

    async def _propose(self, request: worker_pb2.ProposeRequest, stream: service.StepStream,
                       step_id: int) -> worker_pb2.ProposeResponse:
        name = request.draft_model or self.default
        drafter = self.drafts.get(name)
        if request.HasField("expected_model"):  # a step that opens a session
            service.check_model(request.expected_model, drafter.runner.info if drafter else None, "draft")
        if drafter is None:
            raise InvalidArgument(f"unknown draft model {clip(name)}; this service hosts {sorted(self.drafts)}")
        delta = request.delta
        transform = wire.transform_from_pb(request.transform)
        recovering = request.HasField("recovery")  # the recovered token takes a position too
        problems = wire.step_problems(drafter.runner.info, delta, transform, request.draft_length + recovering)
        problems += wire.recovery_problems(request, transform)
        if request.draft_length > MAX_DRAFT_LENGTH:
            problems.append(f"draft_length {request.draft_length} is over {MAX_DRAFT_LENGTH}")
        if request.pre_draft.draft_length > MAX_DRAFT_LENGTH:
            problems.append(f"pre_draft.draft_length {request.pre_draft.draft_length} is over {MAX_DRAFT_LENGTH}")
        service.check_problems(problems)
        session = stream.session(drafter.runner, delta.session_id)
        pre_draft = (PreDraftRequest(request.pre_draft.draft_length, request.pre_draft.seed)
                     if request.pre_draft.draft_length else None)
        carrier = request.trace_context.carrier
        # Here q of a greedy token is for the step's span alone (pre-drafting and a confidence
        # threshold rank the step themselves): an untraced step asks for argmaxes alone.
        proposal = await service.traced_step(
            _TRACER, "specd.draft.recover" if recovering else "specd.draft.propose", carrier,
            drafter.propose(session, delta.start, list(delta.tokens), wire.draft_request_from_pb(request, transform),
                           pre_draft, wire.recovery_from_pb(request), delta.cache_salt, ranked=bool(carrier)),
            lambda proposal: _span_attributes(name, request, proposal))
        if proposal.pre_draft is not None:
            _trace_pre_draft(request, proposal.pre_draft)
        response = worker_pb2.ProposeResponse(draft_tokens=proposal.tokens, forward_ms=proposal.forward_ms,
                                              batch=wire.batch_to_pb(proposal.batch), pre_drafted=proposal.pre_drafted)
        if not transform.greedy:  # q's rows stay here (kept for the next step's recovery)
            response.draft_token_probs.extend(proposal.token_probs)
        if proposal.recovered is not None:
            response.recovered_token = proposal.recovered
        return response


def _trace_pre_draft(request: worker_pb2.ProposeRequest, settled: asyncio.Future) -> None:
    """A `specd.draft.pre_draft` span from now until the branches settle: in a trace it
    overlaps the verifier's span of the same step (docs/tracing.md)."""
    span = start_worker_span(_TRACER, "specd.draft.pre_draft", request.trace_context.carrier)
    if span is None:
        return

    def end(future: asyncio.Future) -> None:
        if not future.cancelled():
            span.set_attributes({"specd.pre_draft.draft_length": request.pre_draft.draft_length,
                                 "specd.pre_draft.accepted_lengths": future.result()})
        span.end()

    settled.add_done_callback(end)


async def create_server(settings: DraftSettings) -> RunningServer:
    """Load the drafts and start serving them on settings.server (port 0: any free port).
    Several drafts share the worker's --gpu-memory-fraction equally (`specd.worker.memory`)."""
    model = settings.model
    if model.batching.gpu_memory_fraction and settings.drafts:
        model = replace(model, batching=replace(
            model.batching, gpu_memory_fraction=model.batching.gpu_memory_fraction / len(settings.drafts)))
    drafters = {name: Drafter(path, model, name=name, pre_draft_branches=settings.pre_draft_branches,
                              kept_rows_bytes=settings.kept_rows_mib << 20,
                              grammar_mask_budget_ms=settings.grammar_mask_budget_ms, draft_base=settings.draft_base,
                              cpu_weights=settings.cpu_weights)
                for name, path in settings.drafts.items()}
    servicer = DraftServicer(drafters)
    stop_metrics = start_worker_metrics(drafters, "draft", settings.metrics_host, settings.metrics_port)

    watch: asyncio.Task | None = None  # the forwards' health, once serving

    async def close() -> None:
        if watch is not None:
            watch.cancel()
        stop_metrics()
        for drafter in drafters.values():
            await drafter.runner.close()

    names = [worker_pb2.DESCRIPTOR.services_by_name["Draft"].full_name]
    running = await start_server(
        settings.server, lambda s: worker_pb2_grpc.add_DraftServicer_to_server(servicer, s), names, on_stop=close)
    running.servicer = servicer
    runners = {name: drafter.runner for name, drafter in drafters.items()}
    watch = asyncio.get_running_loop().create_task(service.watch_forwards(runners, running.health, names))
    return running
