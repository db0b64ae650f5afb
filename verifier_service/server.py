"""The `specd.v1.Verifier` servicer and its server factory.

Thin by design: call the target's scorer (`verifier_service.scorer`), convert; the
stream's skeleton is `specd.worker.service`'s, shared with the draft.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace

from specd import wire
from specd.contract import MAX_DRAFT_LENGTH
from specd.errors import AheadStopped, InvalidArgument
from specd.grpcserver import RunningServer, start_server
from specd.sampling import Transform
from specd.steps import Scores
from specd.v1 import worker_pb2, worker_pb2_grpc
from specd.worker import service
from specd.worker.metrics import start_worker_metrics
from specd.worker.settings import VerifierSettings
from verifier_service.loadcaps import LoadCapBoard
from verifier_service.scorer import Scorer

# A proxy: it finds the provider that setup_tracing installs, whenever that happens.
_TRACER = trace.get_tracer("specd.verifier")
# The most plain steps one step may ask the verifier to score ahead (each reserves a step
# id at the gateway); the gateway asks fewer (`gateway.step.engine.RUN_AHEAD_STEPS`).
MAX_RUN_AHEAD_STEPS = 4096


class VerifierServicer(worker_pb2_grpc.VerifierServicer):
    """Scores proposals with the target; one multiplexed stream per gateway connection."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer
        self.load_caps = LoadCapBoard()

    async def GetModelInfo(self, request, context) -> worker_pb2.ModelInfoResponse:
        runner = self.scorer.runner
        return worker_pb2.ModelInfoResponse(models=[wire.model_info_to_pb(runner.info, runner.tokenizer_files())],
                                            protocol=wire.WORKER_PROTOCOL)

    async def ShareLoadCaps(self, request: worker_pb2.LoadCapTable, context) -> worker_pb2.LoadCapTable:
        return self.load_caps.share(request)  # a bad level raises InvalidArgument (`specd.interceptors`)

    async def Verify(self, request_iterator: AsyncIterator[worker_pb2.VerifySteps],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.VerifyResults]:
        async with contextlib.aclosing(service.serve_multiplexed(
                request_iterator, self._verify, worker_pb2.VerifyResults, worker_pb2.VerifyResult,
                "/specd.v1.Verifier/Verify")) as results:
            async for message in results:
                yield message

    async def _verify(self, request: worker_pb2.VerifyRequest, stream: service.StepStream,
                      step_id: int) -> worker_pb2.VerifyResponse:
        runner = self.scorer.runner
        if request.HasField("expected_model"):  # a step that opens a session
            service.check_model(request.expected_model, runner.info, "verifier")
        delta = request.delta
        transform = wire.transform_from_pb(request.transform)
        service.check_problems(wire.step_problems(runner.info, delta, transform, len(request.draft_tokens)))
        if request.run_ahead_steps > MAX_RUN_AHEAD_STEPS:
            raise InvalidArgument(f"run_ahead_steps is {request.run_ahead_steps}; at most {MAX_RUN_AHEAD_STEPS}")
        if len(request.draft_tokens) > MAX_DRAFT_LENGTH:
            raise InvalidArgument(f"draft_tokens carries {len(request.draft_tokens)} tokens; "
                                  f"at most {MAX_DRAFT_LENGTH}")
        try:
            logprobs = wire.logprobs_from_request(request)
            allowed = wire.allowed_from_request(request, runner.info.vocab_size)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc

        def answer_ahead(index: int, scores: Scores | None) -> None:
            # The steps after this one take the step ids the gateway reserved after its id.
            stream.answer(step_id + index, _response(scores, transform) if scores is not None else AheadStopped(
                f"the verifier stopped scoring ahead before step {index} after the one asked"))

        session = stream.session(runner, delta.session_id)
        scores = await service.traced_step(
            _TRACER, "specd.verifier.verify", request.trace_context.carrier,
            self.scorer.score(session, delta.start, list(delta.tokens), list(request.draft_tokens), transform,
                              list(request.draft_token_probs), wire.draws_from_pb(request), request.run_ahead_steps,
                              wire.ahead_draws_from_pb(request), answer_ahead, logprobs, allowed, delta.cache_salt),
            lambda scores: {
                **service.step_span_attributes(runner.info.name, delta, scores.forward_ms, scores.batch),
                "specd.draft_length": len(request.draft_tokens),
                "specd.positions_scored": len(request.draft_tokens) + 1,
                "specd.run_ahead_steps": request.run_ahead_steps})
        return _response(scores, transform)


def _response(scores: Scores, transform: Transform) -> worker_pb2.VerifyResponse:
    """A step's scores as the gateway reads them: the argmax, or the sampled verdict (and
    the log-probabilities, when asked)."""
    response = worker_pb2.VerifyResponse(forward_ms=scores.forward_ms, batch=wire.batch_to_pb(scores.batch),
                                         ran_ahead=scores.ran_ahead, logprobs=wire.logprobs_to_pb(scores.logprobs))
    if scores.argmax is not None:
        response.target_argmax.extend(scores.argmax)
    else:
        assert scores.verdict is not None  # sampled: the verdict
        verdict = scores.verdict
        response.accepted = verdict.accepted
        if verdict.bonus_token is not None:
            response.bonus_token = verdict.bonus_token
        else:
            assert verdict.rejected_row is not None  # a rejection carries p's row
            response.target_probs.CopyFrom(wire.pack_distributions(verdict.rejected_row[None], transform.sparse))
    return response


async def create_server(settings: VerifierSettings) -> RunningServer:
    """Load the target and start serving it on settings.server (port 0: any free port)."""
    scorer = Scorer(settings.target, settings.model, name=settings.target_name or None)
    name = scorer.runner.info.name
    servicer = VerifierServicer(scorer)
    stop_metrics = start_worker_metrics({name: scorer}, "verifier", settings.metrics_host, settings.metrics_port)

    watch: asyncio.Task | None = None  # the forwards' health, once serving

    async def close() -> None:
        if watch is not None:
            watch.cancel()
        stop_metrics()
        await scorer.runner.close()

    names = [worker_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]
    running = await start_server(
        settings.server, lambda s: worker_pb2_grpc.add_VerifierServicer_to_server(servicer, s), names, on_stop=close)
    running.servicer = servicer
    watch = asyncio.get_running_loop().create_task(
        service.watch_forwards({name: scorer.runner}, running.health, names))
    return running
