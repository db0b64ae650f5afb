"""The public `specd.v1.Gateway` servicer and the gateway's server factory.

Each RPC: validate the request (INVALID_ARGUMENT with every problem named), open one
session on each worker, run `gateway.engine.speculate`, turn tokens into text, reply.
"""
from __future__ import annotations

import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from gateway.backend import Backend, connect
from gateway.engine import Finish, GenerationRequest, Limits, RequestStats, speculate
from gateway.policy import FixedPolicy, Mode
from gateway.text import TextAssembler
from gateway.workers import DraftLink, LinkSettings, VerifierLink, WorkerError
from specd.config import GatewaySettings
from specd.sampling import Transform
from specd.serving import RunningServer, start_server
from specd.v1 import gateway_pb2, gateway_pb2_grpc

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


class InvalidRequest(ValueError):
    """The request cannot be served as asked; the message says what to change."""


@dataclass(frozen=True)
class ParsedRequest:
    generation: GenerationRequest
    mode: Mode
    draft_length: int
    stop: list[str]


def parse_request(request: gateway_pb2.GenerateRequest, backend: Backend,
                  settings: GatewaySettings) -> ParsedRequest:
    """Validate a public request against the models and settings; collect every problem."""
    problems: list[str] = []
    sampling, speculation = request.sampling, request.speculation
    transform = Transform(sampling.temperature, sampling.top_k, sampling.top_p or 1.0)
    problems += transform.problems()

    prompt_ids = backend.tokenizer(request.prompt)["input_ids"]
    context = backend.target.max_context
    if not prompt_ids:
        problems.append("prompt is empty after tokenization; send some text")
    elif len(prompt_ids) >= context:
        problems.append(f"prompt is {len(prompt_ids)} tokens but the target's context window is "
                        f"{context}; shorten the prompt to at most {context - 1} tokens")
    room = max(context - len(prompt_ids), 0)
    max_new = sampling.max_new_tokens or min(settings.default_max_new_tokens, room)
    if sampling.max_new_tokens and len(prompt_ids) + max_new > context:
        problems.append(f"max_new_tokens={max_new} with a {len(prompt_ids)}-token prompt exceeds the "
                        f"target's context window of {context}; ask for at most {room}")

    mode = _MODES.get(speculation.mode)
    if mode is None:
        problems.append(f"unknown speculation mode {speculation.mode}")
    draft_length = speculation.draft_length or settings.default_draft_length
    if speculation.draft_length > settings.max_draft_length:
        problems.append(f"draft_length={speculation.draft_length} exceeds this gateway's maximum of "
                        f"{settings.max_draft_length}")
    draft_model = speculation.draft_model or backend.default_draft
    if speculation.draft_model and speculation.draft_model not in backend.drafts:
        problems.append(f"unknown draft model {speculation.draft_model!r}; available: "
                        f"{sorted(backend.drafts) or 'none (no draft service configured)'}")
    if mode is Mode.FIXED and not backend.drafts:
        problems.append("speculation mode FIXED needs a draft service, and this gateway has none; "
                        "use AUTO or OFF")
    if problems:
        raise InvalidRequest("; ".join(problems))

    if mode is Mode.OFF or not backend.drafts:
        draft_model = ""
    seed = sampling.seed or secrets.randbits(63)
    generation = GenerationRequest(list(prompt_ids), transform, seed, max_new, draft_model)
    return ParsedRequest(generation, mode, draft_length, list(sampling.stop))


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Serves Generate and GenerateStream over the draft and verifier workers."""

    def __init__(self, backend: Backend, settings: GatewaySettings) -> None:
        self.backend = backend
        self.settings = settings

    def _limits(self, draft_model: str) -> Limits:
        target = self.backend.target
        draft = self.backend.drafts.get(draft_model)
        return Limits(
            target_context=target.max_context,
            draft_context=draft.max_context if draft else 0,
            vocab_size=target.vocab_size,
            eos_token_ids=frozenset(target.eos_token_ids),
        )

    def _links(self, draft_model: str) -> tuple[DraftLink | None, VerifierLink]:
        link = LinkSettings(uuid.uuid4().hex, self.settings.worker_timeout_s,
                            self.settings.max_session_reopens)
        verifier = VerifierLink("verifier", lambda: self.backend.verifier.Verify(wait_for_ready=True), link)
        draft = None
        if draft_model:
            draft = DraftLink(f"draft {draft_model!r}",
                              lambda: self.backend.draft.Propose(wait_for_ready=True), link)
        return draft, verifier

    async def _chunks(self, request: gateway_pb2.GenerateRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateChunk]:
        began = time.perf_counter()
        try:
            parsed = parse_request(request, self.backend, self.settings)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        generation = parsed.generation
        policy = FixedPolicy(0 if parsed.mode is Mode.OFF else parsed.draft_length)
        draft, verifier = self._links(generation.draft_model)
        text = TextAssembler(self.backend.tokenizer, parsed.stop)
        stats = RequestStats()
        finish = Finish.LENGTH
        try:
            steps = speculate(generation, policy, draft, verifier, self._limits(generation.draft_model), stats)
            async with contextlib.aclosing(steps):
                async for emission in steps:
                    delta, kept = text.add(emission.tokens)
                    if text.stopped:
                        finish = Finish.STOP
                    elif emission.finish is not None:
                        finish = emission.finish
                    if emission.finish is None and not text.stopped:
                        yield gateway_pb2.GenerateChunk(text=delta, token_ids=kept)
                        continue
                    yield gateway_pb2.GenerateChunk(
                        text=delta + text.finish(), token_ids=kept, finish_reason=_FINISH[finish],
                        stats=self._stats_pb(stats, generation, draft, verifier, text, began))
                    return
        except WorkerError as exc:
            await context.abort(exc.code, str(exc))
        finally:
            for link in (draft, verifier):
                if link is not None:
                    await link.close()

    @staticmethod
    def _stats_pb(stats: RequestStats, generation: GenerationRequest, draft: DraftLink | None,
                  verifier: VerifierLink, text: TextAssembler, began: float) -> gateway_pb2.GenerationStats:
        return gateway_pb2.GenerationStats(
            steps=stats.steps,
            proposed_tokens=stats.proposed_tokens,
            accepted_tokens=stats.accepted_tokens,
            acceptance_rate=stats.acceptance_rate,
            draft_lengths=stats.draft_lengths,
            accepted_lengths=stats.accepted_lengths,
            mean_tokens_per_step=len(text.token_ids) / stats.steps if stats.steps else 0.0,
            prompt_tokens=len(generation.prompt_ids),
            generated_tokens=len(text.token_ids),
            draft_ms=stats.draft_ms,
            verify_ms=stats.verify_ms,
            total_ms=(time.perf_counter() - began) * 1e3,
            seed=generation.seed,
            draft_model=generation.draft_model,
            session_reopens=verifier.reopens + (draft.reopens if draft else 0),
        )

    async def GenerateStream(self, request, context):
        async for chunk in self._chunks(request, context):
            yield chunk

    async def Generate(self, request, context) -> gateway_pb2.GenerateResponse:
        response = gateway_pb2.GenerateResponse()
        parts = []
        async for chunk in self._chunks(request, context):
            parts.append(chunk.text)
            response.token_ids.extend(chunk.token_ids)
            if chunk.HasField("stats"):
                response.finish_reason = chunk.finish_reason
                response.stats.CopyFrom(chunk.stats)
                response.trace_id = chunk.trace_id
        response.text = "".join(parts)
        return response


async def create_server(settings: GatewaySettings) -> RunningServer:
    """Connect to the workers (checking their models) and start serving the public API."""
    backend = await connect(settings)
    servicer = GatewayServicer(backend, settings)
    return await start_server(
        settings.server, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
        [gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name], on_stop=backend.close)
