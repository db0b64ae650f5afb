"""The `specd.v1.Draft` servicer and its server factory.

Thin by design: look up the draft, call the runtime on the model's thread, convert.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from specd.batching import Overloaded
from specd.config import DraftSettings
from specd.interceptors import clip, session_lost
from specd.runtime import ModelRunner, SessionNotFound
from specd.serving import RunningServer, start_server
from specd.steps import PreDraftRequest, Proposal
from specd.telemetry import batch_span_attributes, start_worker_span, worker_step_span
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.wire import (
    MAX_DRAFT_LENGTH,
    batch_to_pb,
    identity_mismatch,
    model_info_to_pb,
    pack_distributions,
    step_problems,
    transform_from_pb,
)
from specd.workermetrics import start_worker_metrics

# A proxy: it finds the provider that setup_tracing installs, whenever that happens.
_TRACER = trace.get_tracer("specd.draft")


def _span_attributes(name: str, request: worker_pb2.ProposeRequest, proposal: Proposal) -> dict:
    """Attributes of a `specd.draft.propose` span (docs/tracing.md)."""
    probs = proposal.token_probs
    attributes = {
        "gen_ai.request.model": name,
        "specd.session.id": request.delta.session_id,
        "specd.delta.start": request.delta.start,
        "specd.delta.tokens": len(request.delta.tokens),
        "specd.draft_length": request.draft_length,
        "specd.proposed": len(proposal.tokens),
        "specd.forward_ms": proposal.forward_ms,
        "specd.pre_drafted": proposal.pre_drafted,
        **batch_span_attributes(proposal.batch),
    }
    if probs:
        attributes.update({"specd.draft.token_probs": list(probs), "specd.draft.token_prob.min": min(probs),
                           "specd.draft.token_prob.mean": sum(probs) / len(probs)})
    return attributes


class DraftServicer(worker_pb2_grpc.DraftServicer):
    """Proposes draft tokens; one bidi stream per client request."""

    def __init__(self, drafts: dict[str, ModelRunner]) -> None:
        if not drafts:
            raise ValueError("the draft service needs at least one draft model")
        self.drafts = drafts
        self.default = next(iter(drafts))

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfoResponse:
        return worker_pb2.ModelInfoResponse(
            models=[model_info_to_pb(r.info) for r in self.drafts.values()])

    async def Propose(self, request_iterator: AsyncIterator[worker_pb2.ProposeRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.ProposeResponse]:
        opened: set[tuple[str, str]] = set()
        stream = uuid.uuid4().hex  # tags the sessions this stream opens
        try:
            async for request in request_iterator:
                name = request.draft_model or self.default
                runner = self.drafts.get(name)
                if request.HasField("expected_model"):  # the first message of the stream
                    await _check_identity(request.expected_model, runner, context)
                if runner is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"unknown draft model {clip(name)}; this service hosts {sorted(self.drafts)}")
                delta = request.delta
                transform = transform_from_pb(request.transform)
                problems = step_problems(runner.info, delta, transform, request.draft_length)
                if request.draft_length > MAX_DRAFT_LENGTH:
                    problems.append(f"draft_length {request.draft_length} is over {MAX_DRAFT_LENGTH}")
                if request.pre_draft.draft_length > MAX_DRAFT_LENGTH:
                    problems.append(f"pre_draft.draft_length {request.pre_draft.draft_length} is over "
                                    f"{MAX_DRAFT_LENGTH}")
                if problems:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
                opened.add((name, delta.session_id))
                with worker_step_span(_TRACER, "specd.draft.propose",
                                      request.trace_context.carrier) as span:
                    try:
                        pre_draft = (PreDraftRequest(request.pre_draft.draft_length, request.pre_draft.seed)
                                     if request.pre_draft.draft_length else None)
                        proposal = await runner.propose(delta.session_id, delta.start, list(delta.tokens),
                                                        request.draft_length, transform, request.seed,
                                                        request.min_confidence, stream, request.vocab_limit,
                                                        pre_draft)
                    except SessionNotFound as exc:
                        await context.abort(grpc.StatusCode.NOT_FOUND, session_lost("draft", exc))
                    except ValueError as exc:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    except Overloaded as exc:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"draft: {exc}")
                    if span is not None and span.is_recording():
                        span.set_attributes(_span_attributes(name, request, proposal))
                if proposal.pre_draft is not None:
                    _trace_pre_draft(request, proposal.pre_draft)
                response = worker_pb2.ProposeResponse(draft_tokens=proposal.tokens, forward_ms=proposal.forward_ms,
                                                      batch=batch_to_pb(proposal.batch),
                                                      pre_drafted=proposal.pre_drafted)
                if proposal.probs is not None:
                    response.draft_probs.CopyFrom(pack_distributions(proposal.probs, transform.sparse))
                yield response
        finally:
            for name, session_id in opened:
                self.drafts[name].end_session(session_id, stream)


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


async def _check_identity(expected: worker_pb2.ModelIdentity, runner: ModelRunner | None,
                          context: grpc.aio.ServicerContext) -> None:
    """Refuse (FAILED_PRECONDITION) a stream meant for a draft this service does not hold."""
    if runner is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"this draft service does not host {expected.name!r}, which the stream expects")
    problem = identity_mismatch(expected, runner.info)
    if problem is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)


async def create_server(settings: DraftSettings) -> RunningServer:
    """Load the drafts and start serving them on settings.server (port 0: any free port)."""
    runners = {name: ModelRunner(path, name=name, dtype=settings.model.dtype,
                                 max_sessions=settings.model.max_sessions, device=settings.model.device,
                                 batching=settings.model.batching, pre_draft_branches=settings.pre_draft_branches)
               for name, path in settings.drafts.items()}
    servicer = DraftServicer(runners)
    stop_metrics = start_worker_metrics(runners, "draft", settings.metrics_host, settings.metrics_port)

    async def close() -> None:
        stop_metrics()
        for runner in runners.values():
            await runner.close()

    running = await start_server(
        settings.server, lambda s: worker_pb2_grpc.add_DraftServicer_to_server(servicer, s),
        [worker_pb2.DESCRIPTOR.services_by_name["Draft"].full_name], on_stop=close)
    running.servicer = servicer
    return running
