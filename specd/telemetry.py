"""Tracing set-up shared by the three services, configured only by the standard OTEL_* variables.

Each service's entrypoint calls :func:`setup_tracing` once. Tracing is on when an OTLP
endpoint is configured (``OTEL_EXPORTER_OTLP_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) and neither ``OTEL_SDK_DISABLED=true`` nor
``OTEL_TRACES_EXPORTER=none`` says otherwise. Then spans go over OTLP/gRPC through a
``BatchSpanProcessor`` (``OTEL_BSP_*`` tune it); ``OTEL_SERVICE_NAME`` overrides the
service's own name and ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG`` choose the
sampler, all read by the SDK itself.

When tracing is off the global tracer provider stays OpenTelemetry's no-op one: no SDK
is imported, spans are non-recording singletons, and the code that builds span
attributes checks ``span.is_recording()`` first, so a request pays a few microseconds.
Span names and attributes are documented in docs/tracing.md.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from specd.steps import BatchStats

_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def tracing_configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the OTEL_* variables ask for spans to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in _ENDPOINT_VARIABLES)


def setup_tracing(service_name: str) -> bool:
    """Install an OTLP-exporting tracer provider if the environment asks for one.

    `service_name` is the default `service.name` resource attribute (OTEL_SERVICE_NAME
    wins). Returns whether tracing is on. The provider flushes its batch on exit, so a
    service stopped by SIGTERM exports what it has.
    """
    if not tracing_configured():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; attributes
    # passed in win over them, so the default name goes in only when none is set.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def tracing_enabled() -> bool:
    """Whether a real (SDK) tracer provider is installed, by setup_tracing or by a test."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """OpenTelemetry's aio server interceptor; none when tracing is off.

    Passed to each server explicitly instead of instrumenting grpc globally, so nothing
    outside our servers changes behaviour. Health checks are left out, and so are the
    workers' step streams: one lives as long as its gateway's connection and carries the
    steps of many requests, so its span would belong to no request; each step has a span
    of its own (`worker_step_span`).
    """
    if not tracing_enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    untraced = filters.any_of(filters.health_check(), filters.full_method_name("/specd.v1.Draft/Propose"),
                              filters.full_method_name("/specd.v1.Verifier/Verify"))
    return [aio_server_interceptor(filter_=filters.negate(untraced))]


def batch_span_attributes(batch: BatchStats) -> dict:
    """The batching attributes every worker step span carries (docs/tracing.md)."""
    return {"specd.batch.size": batch.size, "specd.batch.tokens": batch.tokens,
            "specd.batch.queue_ms": batch.queue_ms, "specd.batch.forwards": batch.forwards,
            "specd.batch.sessions": batch.sessions}


def start_worker_span(tracer: trace.Tracer, span_name: str, carrier: Mapping[str, str]) -> Span | None:
    """A worker span under the gateway's step span in `carrier`, ended by the caller
    (for work that outlives the RPC that started it); None without a trace context."""
    if not carrier:
        return None
    return tracer.start_span(span_name, context=propagate.extract(carrier), kind=SpanKind.INTERNAL)


@contextlib.contextmanager
def worker_step_span(tracer: trace.Tracer, span_name: str, carrier: Mapping[str, str]) -> Iterator[Span | None]:
    """A worker's span for one step, the child of the gateway's step span in `carrier`.

    Yields None, building nothing, when the message carries no trace context (tracing
    off at the gateway, or the request sampled out there): a worker span never starts
    a trace of its own. The span is not made current; an exception marks it failed.
    """
    if not carrier:
        yield None
        return
    span = tracer.start_span(span_name, context=propagate.extract(carrier), kind=SpanKind.SERVER)
    try:
        yield span
    except BaseException as exc:
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, str(exc)))
        raise
    finally:
        span.end()
