"""The `specd.v1.Verifier` servicer and its server factory.

Thin by design: call the runtime on the target's thread, convert.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from specd.batching import Overloaded
from specd.config import VerifierSettings
from specd.interceptors import session_lost
from specd.runtime import ModelRunner, SessionNotFound
from specd.serving import RunningServer, start_server
from specd.telemetry import batch_span_attributes, worker_step_span
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.wire import (
    batch_to_pb,
    identity_mismatch,
    model_info_to_pb,
    pack_distributions,
    step_problems,
    transform_from_pb,
)
from specd.workermetrics import start_worker_metrics

# A proxy: it finds the provider that setup_tracing installs, whenever that happens.
_TRACER = trace.get_tracer("specd.verifier")


class VerifierServicer(worker_pb2_grpc.VerifierServicer):
    """Scores proposals with the target; one bidi stream per client request."""

    def __init__(self, target: ModelRunner) -> None:
        self.target = target

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfoResponse:
        return worker_pb2.ModelInfoResponse(models=[model_info_to_pb(self.target.info, self.target.tokenizer_files())])

    async def Verify(self, request_iterator: AsyncIterator[worker_pb2.VerifyRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.VerifyResponse]:
        opened: set[str] = set()
        stream = uuid.uuid4().hex  # tags the sessions this stream opens
        try:
            async for request in request_iterator:
                if request.HasField("expected_model"):  # the first message of the stream
                    problem = identity_mismatch(request.expected_model, self.target.info)
                    if problem is not None:
                        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
                delta = request.delta
                transform = transform_from_pb(request.transform)
                problems = step_problems(self.target.info, delta, transform, len(request.draft_tokens))
                if problems:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(problems))
                opened.add(delta.session_id)
                with worker_step_span(_TRACER, "specd.verifier.verify",
                                      request.trace_context.carrier) as span:
                    try:
                        scores = await self.target.score(delta.session_id, delta.start, list(delta.tokens),
                                                         list(request.draft_tokens), transform, stream)
                    except SessionNotFound as exc:
                        await context.abort(grpc.StatusCode.NOT_FOUND, session_lost("verifier", exc))
                    except ValueError as exc:
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                    except Overloaded as exc:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"verifier: {exc}")
                    if span is not None and span.is_recording():
                        span.set_attributes({
                            "gen_ai.request.model": self.target.info.name,
                            "specd.session.id": delta.session_id,
                            "specd.delta.start": delta.start,
                            "specd.delta.tokens": len(delta.tokens),
                            "specd.draft_length": len(request.draft_tokens),
                            "specd.positions_scored": len(request.draft_tokens) + 1,
                            "specd.forward_ms": scores.forward_ms,
                            **batch_span_attributes(scores.batch),
                        })
                response = worker_pb2.VerifyResponse(forward_ms=scores.forward_ms, batch=batch_to_pb(scores.batch))
                if scores.argmax is not None:
                    response.target_argmax.extend(scores.argmax)
                else:
                    assert scores.probs is not None  # sampled: the target's distributions
                    response.target_probs.CopyFrom(pack_distributions(scores.probs, transform.sparse))
                yield response
        finally:
            for session_id in opened:
                self.target.end_session(session_id, stream)


async def create_server(settings: VerifierSettings) -> RunningServer:
    """Load the target and start serving it on settings.server (port 0: any free port)."""
    target = ModelRunner(settings.target, dtype=settings.model.dtype,
                         max_sessions=settings.model.max_sessions,
                         device=settings.model.device, batching=settings.model.batching)
    servicer = VerifierServicer(target)
    stop_metrics = start_worker_metrics({target.info.name: target}, "verifier", settings.metrics_host,
                                        settings.metrics_port)

    async def close() -> None:
        stop_metrics()
        await target.close()

    running = await start_server(
        settings.server, lambda s: worker_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
        [worker_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name], on_stop=close)
    running.servicer = servicer
    return running
