"""The gateway's spans: `specd.generate` per request and `specd.step` per speculative step.

docs/design.md §8: a worker stream carries the steps of many requests (since worker protocol 3),
so the gRPC instrumentation gives it no span (`specd.telemetry.server_interceptors`).
Each step gets its own span here; its W3C trace context rides inside that step's worker messages (the
`trace_context.carrier` map), and the draft and verifier open their spans as its
children. The names and attributes are API, documented in docs/tracing.md.

Spans are started with an explicit parent and never made "current": the request runs
inside async generators that yield to the client between steps, and a context attached
there could leak into, or be detached from, another task's context.

When tracing is off, or the sampler dropped the request, the request span is a no-op
and the engine gets `NoTracer`: nothing is built per step.
"""
from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from gateway.request import Generation
from gateway.step.records import NoTracer, RequestStats, StepRecord, StepTracer

TRACER_NAME = "specd.gateway"


def token_kind(record: StepRecord) -> str:
    """What the step's one extra token was: `bonus` (all accepted), `recovered` or `target`.

    `target` is a plain decoding step (γ = 0), where the token is simply the target's.
    """
    if record.draft_length == 0:
        return "target"
    return "bonus" if record.bonus else "recovered"


def step_attributes(record: StepRecord) -> dict[str, int | float | str]:
    """The `specd.step` span's attributes for one step record."""
    attributes: dict[str, int | float | str] = {
        "specd.step.index": record.index,
        "specd.step.position": record.position,
        "specd.draft_length": record.draft_length,
        "specd.accepted": record.accepted,
        "specd.emitted": len(record.emitted),
        "specd.token.id": record.token,
        "specd.token.kind": token_kind(record),
        "specd.draft.hop_ms": record.draft_ms,
        "specd.draft.forward_ms": record.draft_forward_ms,
        "specd.draft.bytes": record.draft_bytes,
        "specd.verify.hop_ms": record.verify_ms,
        "specd.verify.forward_ms": record.verify_forward_ms,
        "specd.verify.bytes": record.verify_bytes,
        "specd.verify.batch_size": record.verify_batch.size,
        "specd.verify.batch_tokens": record.verify_batch.tokens,
        "specd.verify.queue_ms": record.verify_batch.queue_ms,
        "specd.pre_drafted": record.pre_drafted,
        "specd.ran_ahead": record.ran_ahead,
    }
    if record.proposer:  # the draft model's name, or a model-free proposer's (gateway.proposers.modelfree)
        attributes["specd.proposer"] = record.proposer
    if record.draft_batch.size:
        attributes.update({"specd.draft.batch_size": record.draft_batch.size,
                           "specd.draft.batch_tokens": record.draft_batch.tokens,
                           "specd.draft.queue_ms": record.draft_batch.queue_ms})
    if record.first_rejected is not None:
        attributes["specd.first_rejected"] = record.first_rejected
    if record.recovery_ms:
        attributes["specd.draft.recovery_ms"] = record.recovery_ms
    if record.proposal_in_hand:
        attributes["specd.draft.in_hand"] = True
    if record.load_cap is not None:  # why γ was no longer: the load cap, from the costs or learned
        attributes["specd.gamma.cap"], attributes["specd.gamma.cap_origin"] = record.load_cap
    return attributes


class StepSpans:
    """The engine's `StepTracer` while a request is traced: one `specd.step` span per step."""

    def __init__(self, tracer: trace.Tracer, parent: Span) -> None:
        self._tracer = tracer
        self._parent = trace.set_span_in_context(parent, otel_context.Context())
        self._open: Span | None = None

    def begin_step(self, index: int) -> dict[str, str]:
        """Open the step's span; return its W3C trace context for the worker messages."""
        span = self._tracer.start_span("specd.step", context=self._parent,
                                       attributes={"specd.step.index": index})
        self._open = span
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def add_event(self, name: str, attributes: dict[str, int | float | str]) -> None:
        """An event on the open step's span (drift noticed while counting the step)."""
        if self._open is not None:
            self._open.add_event(name, attributes)

    def observe(self, record: StepRecord) -> None:
        """The step's record: its attributes go on the span, which ends."""
        if self._open is None:
            return
        self._open.set_attributes(step_attributes(record))
        self._open.end()
        self._open = None

    def close(self, error: BaseException | None = None) -> None:
        """End a step span left open by a step that did not finish (an error, a cancel)."""
        if self._open is None:
            return
        if error is not None:
            self._open.record_exception(error)
            self._open.set_status(Status(StatusCode.ERROR, str(error)))
        self._open.end()
        self._open = None


class RequestTrace:
    """The `specd.generate` span of one request and what hangs off it.

    `start` opens it as a child of the current context (the gRPC server span when the
    interceptor runs, which carries a client's own traceparent); `finish` sets the
    totals and ends it; `end` is the safety net for every other way out.
    """

    def __init__(self, span: Span, tracer: trace.Tracer) -> None:
        self.span = span
        recording = span.is_recording()
        self.step_tracer: StepTracer = StepSpans(tracer, span) if recording else NoTracer()
        # The W3C trace id the response reports, when the trace will exist somewhere.
        self.trace_id = format(span.get_span_context().trace_id, "032x") if recording else ""
        self._ended = False

    def step_event(self, name: str, attributes: dict[str, int | float | str]) -> None:
        """An event on the current step's span; nothing when the request is not traced."""
        if isinstance(self.step_tracer, StepSpans):
            self.step_tracer.add_event(name, attributes)

    @classmethod
    def start(cls, generation: Generation, *, target_model: str, model_pair: str, task_type: str,
              user_segment: str, mode: str, policy: str) -> RequestTrace:
        """Open the request span; set what is known before the first step."""
        tracer = trace.get_tracer(TRACER_NAME)
        span = tracer.start_span("specd.generate", kind=SpanKind.INTERNAL)
        if span.is_recording():
            transform = generation.transform
            span.set_attributes({
                "gen_ai.operation.name": "text_completion",
                "gen_ai.request.model": target_model,
                "gen_ai.request.temperature": transform.temperature,
                "gen_ai.request.top_k": transform.top_k,
                "gen_ai.request.top_p": transform.top_p,
                "gen_ai.request.seed": generation.seed,
                "gen_ai.request.max_tokens": generation.stopping.max_new_tokens,
                "gen_ai.usage.input_tokens": len(generation.prompt_ids),
                "specd.draft.model": generation.draft_model,
                "specd.model_pair": model_pair,
                "specd.speculation.mode": mode,
                "specd.policy": policy,
                "specd.task_type": task_type,
                "specd.user_segment": user_segment,
            })
        return cls(span, tracer)

    def finish(self, stats: RequestStats, generated_tokens: int, finish_reason: str) -> None:
        """Set the request's totals and end its span (before the last chunk goes out)."""
        if self.span.is_recording():
            attributes: dict[str, int | float | str | list[str]] = {
                "gen_ai.usage.output_tokens": generated_tokens,
                "gen_ai.response.finish_reasons": [finish_reason],
                "specd.steps": stats.steps,
                "specd.proposed_tokens": stats.proposed_tokens,
                "specd.accepted_tokens": stats.accepted_tokens,
                "specd.acceptance_rate": stats.acceptance_rate,
                "specd.mean_tokens_per_step": stats.tokens_per_step(generated_tokens),
            }
            self.span.set_attributes(attributes)
        self.end()

    def end(self, error: BaseException | None = None) -> None:
        """End the span (and a step left open) once; mark it failed if `error` is given."""
        if self._ended:
            return
        self._ended = True
        if isinstance(self.step_tracer, StepSpans):
            self.step_tracer.close(error)
        if error is not None:
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self.span.end()
