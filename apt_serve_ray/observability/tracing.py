"""OpenTelemetry traces: one span per request in the engine, a child of the caller's span.

The caller (the router) injects its context into a plain dict carrier (W3C ``traceparent``) and sends
it with the request; the engine extracts it, so router and engine spans share one trace across the
Ray handle call. Exporter by configuration: "none" (default), "console", "otlp" when
``opentelemetry-exporter-otlp`` is installed, or "memory" (kept in the process, for tests:
``finished_spans()``).
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.propagate import extract, inject

from apt_serve_ray.observability.metrics import NO_SERVICE_CLASS
from apt_serve_ray.observability.observer import EngineObserver, RequestEvent

EXPORTERS = ("none", "console", "otlp", "memory")
_configured: dict[str, object] = {}


def configure_tracing(exporter: str = "none", service_name: str = "apt-serve-ray"):
    """Install a tracer provider for this process (once). Returns it, or None for "none"."""
    if exporter not in EXPORTERS:
        raise ValueError(f"tracing_exporter: must be one of {EXPORTERS}, got {exporter!r}")
    if exporter == "none":
        return None
    if exporter in _configured:
        return _configured[exporter]
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter == "memory":
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        span_exporter = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        provider.memory_exporter = span_exporter
        trace.set_tracer_provider(provider)
        _configured[exporter] = provider
        return provider
    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise ValueError("tracing_exporter: 'otlp' needs `pip install opentelemetry-exporter-otlp`") from exc
        span_exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    _configured[exporter] = provider
    return provider


def finished_spans() -> list[dict]:
    """Spans the "memory" exporter holds in this process, as plain dicts (ids in hex)."""
    provider = _configured.get("memory")
    if provider is None:
        return []
    return [{"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": f"{s.context.span_id:016x}",
             "parent_span_id": f"{s.parent.span_id:016x}" if s.parent else None,
             "events": [e.name for e in s.events], "attributes": dict(s.attributes or {})}
            for s in provider.memory_exporter.get_finished_spans()]


def current_context_carrier() -> dict[str, str]:
    """The active span's context as a dict to send along with a request."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return carrier


class RequestTracer(EngineObserver):
    """Engine-side span per request with events queued, scheduled, first_token, preempted, finished."""

    def __init__(self, tracer_provider=None) -> None:
        self.tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("apt_serve_ray.engine.llm_engine")
        self._spans: dict[str, object] = {}

    def on_request_event(self, request, event, now, attrs) -> None:
        import time

        now_ns = time.time_ns()
        if event is RequestEvent.QUEUED:
            parent = extract(request.trace_context) if request.trace_context else None
            span = self.tracer.start_span("engine.request", context=parent, start_time=now_ns, attributes={
                "request.id": request.request_id, "request.prompt_tokens": request.num_prompt_tokens,
                "request.priority": request.priority, "slo.ttft_ms": request.ttft_slo_ms, "slo.tbt_ms": request.tbt_slo_ms,
                "request.service_class": request.service_class or NO_SERVICE_CLASS,
            })
            self._spans[request.request_id] = span
        span = self._spans.get(request.request_id)
        if span is None:
            return
        span.add_event(event.value, attributes={k: v for k, v in attrs.items() if isinstance(v, (str, int, float, bool))},
                       timestamp=now_ns)
        if event is RequestEvent.FINISHED:
            span.set_attribute("request.output_tokens", request.num_output_tokens)
            span.set_attribute("request.outcome", request.status.value)
            span.set_attribute("request.preemptions", request.num_preemptions)
            span.set_attribute("cache.kind", request.last_kind.value if request.last_kind else "none")
            span.end(end_time=now_ns)
            del self._spans[request.request_id]
