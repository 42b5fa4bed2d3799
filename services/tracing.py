"""OpenTelemetry set-up and W3C context helpers shared by every tier (docs/design.md §10).

One tracer provider per process (`setup_tracing`); components take a `Tracer` so tests can hand them
a provider with an in-memory exporter. Context crosses gRPC as the W3C `traceparent` string carried
in each session message, so a multiplexed or long-lived stream still parents every cycle correctly.
"""

from __future__ import annotations

from enum import StrEnum

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "dspark"


class Exporter(StrEnum):
    NONE = "none"
    CONSOLE = "console"
    OTLP = "otlp"


def setup_tracing(service_name: str, exporter: Exporter | str = Exporter.NONE,
                  endpoint: str | None = None) -> trace.Tracer:
    """Install this process's tracer provider and return its tracer. `none` records nothing."""
    exporter = Exporter(exporter)
    if exporter is Exporter.NONE:
        return trace.NoOpTracer()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is Exporter.CONSOLE:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # endpoint None: the exporter reads OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (default localhost:4317)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return provider.get_tracer(TRACER_NAME)


def current_traceparent() -> str:
    """The W3C traceparent of the current span, or "" outside any recording span."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def context_from(traceparent: str) -> Context | None:
    """The remote parent context of a received traceparent (None when empty)."""
    return _PROPAGATOR.extract({"traceparent": traceparent}) if traceparent else None
