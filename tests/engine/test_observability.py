"""Engine-side observability: metrics values, request spans and their parents, the memory timeline."""

from __future__ import annotations

import json
import logging
import struct

import pytest

from apt_serve_ray import LLM, CacheTracker, SamplingParams
from apt_serve_ray.observability.metrics import EngineMetrics, InMemoryMetrics
from apt_serve_ray.observability.tracing import RequestTracer


def test_metrics_have_the_right_values_for_a_scripted_run(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=12, max_num_batched_tokens=512, cache_ratio=0.0,
              default_ttft_slo_ms=60_000, default_tbt_slo_ms=60_000, policy="sarathi")  # admits all: preempts
    backend = InMemoryMetrics()
    llm.llm_engine.add_observer(EngineMetrics(backend, model="opt-tiny", replica="r0"))
    engine = llm.llm_engine
    # Three requests of 60 + 30 tokens need 18 pages; 12 force preemptions.
    ids = [engine.add_request([11 + i] * 60, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)).request_id
           for i in range(3)]
    aborted = engine.add_request([5] * 10, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    engine.step()
    engine.abort_request(aborted.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    tags = {"model": "opt-tiny", "replica": "r0"}
    per_request = {**tags, "service_class": "none"}  # these requests name no service class
    assert backend.get("apt_serve_requests_total", **per_request, outcome="length") == 3
    assert backend.get("apt_serve_requests_total", **per_request, outcome="abort") == 1
    assert backend.get("apt_serve_slo_total", **per_request, result="met") == 3
    preemptions = backend.get("apt_serve_preemptions_total", **per_request, cause="memory")
    assert preemptions == engine.scheduler.num_preemptions > 0
    assert len(backend.get("apt_serve_engine_ttft_seconds", **per_request)) == 3
    assert len(backend.get("apt_serve_inter_token_gap_seconds", **per_request)) == 3 * 29
    assert backend.get("apt_serve_cache_pages", **tags, kind="free") == 12
    assert backend.get("apt_serve_requests_running", **tags) == 0
    assert len(backend.get("apt_serve_scheduler_seconds", **tags)) == engine.num_steps
    assert ids


def test_per_request_metrics_are_kept_per_service_class():
    """EngineMetrics on finished requests alone (a fake request, no engine): attainment, TTFT and
    queue time land under the request's class; the step gauges carry no class."""
    from types import SimpleNamespace

    from apt_serve_ray.observability import RequestEvent
    from apt_serve_ray.request import Request, RequestStatus

    backend = InMemoryMetrics()
    metrics = EngineMetrics(backend, model="m", replica="r")

    def finish(service_class, ttft_s, ttft_slo_ms):
        request = Request("r", [1, 2], SamplingParams(max_tokens=2), arrival_time=0.0, max_total_tokens=64,
                          ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=1_000, service_class=service_class)
        request.first_scheduled_time = 0.25
        for t in (ttft_s, ttft_s + 0.1):
            request.append_output_token(7, t)
        request.status, request.finish_time = RequestStatus.FINISHED_LENGTH, ttft_s + 0.1
        metrics.on_request_event(request, RequestEvent.FINISHED, ttft_s + 0.1, {})

    finish("interactive", 0.5, 1_000)  # met
    finish("interactive", 2.0, 1_000)  # missed its 1 s TTFT
    finish("batch", 2.0, 30_000)       # the same TTFT meets batch's 30 s
    finish(None, 0.5, 10_000)

    def slo(service_class):
        return {result: backend.get("apt_serve_slo_total", model="m", replica="r", service_class=service_class,
                                    result=result) for result in ("met", "missed_ttft")}

    assert slo("interactive") == {"met": 1, "missed_ttft": 1}
    assert slo("batch") == {"met": 1, "missed_ttft": None} and slo("none")["met"] == 1
    assert backend.get("apt_serve_engine_ttft_seconds", model="m", replica="r", service_class="interactive") == [0.5, 2.0]
    assert backend.get("apt_serve_queue_time_seconds", model="m", replica="r", service_class="batch") == [0.25]
    assert backend.get("apt_serve_requests_total", model="m", replica="r", service_class="batch", outcome="length") == 1
    metrics.on_step(None, SimpleNamespace(cache=SimpleNamespace(
        num_waiting=0, num_running=0, num_kv_pages=0, num_hidden_pages=0, num_free_pages=4, cache_ratio=0.0,
        hidden_share=0.0, usage=0.0, pages_by_kind={"kv": 0, "kv-int8": 0}, compressed_share=0.0),
        schedule_s=0.001, total_s=0.01), 1.0)
    assert backend.get("apt_serve_requests_waiting", model="m", replica="r") == 0


def test_a_requests_service_class_reaches_its_span_and_log_line(opt_tiny, caplog):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = LLM(opt_tiny, dtype="float32", num_pages=12)
    engine = llm.llm_engine
    engine.add_observer(RequestTracer(provider))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with caplog.at_level(logging.INFO, logger="apt_serve_ray.requests"):
        engine.add_request([5, 6, 7], params, "a", service_class="batch", priority=10)
        engine.add_request([5, 6, 7], params, "b")
        while engine.has_unfinished_requests():
            engine.step()
    spans = {s.attributes["request.id"]: s.attributes for s in exporter.get_finished_spans()}
    assert spans["a"]["request.service_class"] == "batch" and spans["a"]["request.priority"] == 10
    assert spans["b"]["request.service_class"] == "none"
    lines = {line["request_id"]: line for line in (json.loads(r.message) for r in caplog.records
                                                   if r.name == "apt_serve_ray.requests")}
    assert lines["a"]["service_class"] == "batch" and lines["b"]["service_class"] is None
    with pytest.raises(ValueError, match="service_class"):
        engine.make_request([5], params, service_class=3)
    with pytest.raises(ValueError, match="cache_salt"):
        engine.make_request([5], params, cache_salt="")


def test_request_spans_are_children_of_the_callers_span(opt_tiny):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from apt_serve_ray.observability.tracing import current_context_carrier

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = LLM(opt_tiny, dtype="float32", num_pages=6)
    llm.llm_engine.add_observer(RequestTracer(provider))
    engine = llm.llm_engine
    with provider.get_tracer("test").start_as_current_span("router.request") as parent:
        carrier = current_context_carrier()
    assert "traceparent" in carrier
    # 6 pages: the second request waits, then gets preempted or queued behind the first.
    for i in range(2):
        engine.add_request(engine.make_request([20 + i] * 40, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                               trace_context=carrier))
    while engine.has_unfinished_requests():
        engine.step()
    spans = [s for s in exporter.get_finished_spans() if s.name == "engine.request"]
    assert len(spans) == 2
    for span in spans:
        assert span.parent.span_id == parent.get_span_context().span_id
        assert span.context.trace_id == parent.get_span_context().trace_id
        names = [e.name for e in span.events]
        assert names[0] == "queued" and names[-1] == "finished"
        assert {"scheduled", "first_token"} <= set(names)
    assert any("preempted" in [e.name for e in s.events] for s in spans)


def test_cache_tracker_records_kinds_and_plots_a_png(opt_tiny, tmp_path):
    llm = LLM(opt_tiny, dtype="float32", num_pages=40, cache_ratio=0.5, enable_watermarks=True,
              max_num_batched_tokens=256)
    tracker = CacheTracker(llm)
    llm.generate([[30 + i] * (40 + 20 * i) for i in range(6)],
                 SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    series = tracker.series()
    assert max(series["kv"]) > 0 and max(series["hidden"]) > 0
    assert max(series["usage"]) > 0.7 and any(c["watermark"] == "light" for c in tracker.crossings)
    assert max(series["cache_ratio"]) > 0.5  # the light watermark raised the hidden target
    path = tracker.plot_memory_timeline(tmp_path / "timeline.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 300 and height > 200


def test_one_structured_log_line_per_finished_request(opt_tiny, caplog):
    llm = LLM(opt_tiny, dtype="float32", num_pages=20)
    with caplog.at_level(logging.INFO, logger="apt_serve_ray.requests"):
        out = llm.generate(["log me", "and me"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    lines = [json.loads(r.message) for r in caplog.records if r.name == "apt_serve_ray.requests"]
    assert sorted(line["request_id"] for line in lines) == sorted(o.request_id for o in out)
    for line in lines:
        assert line["output_tokens"] == 5 and line["outcome"] == "length" and line["kind"] == "kv"
        assert line["ttft_s"] > 0 and "p99_gap_s" in line and line["preemptions"] == 0


def test_tracing_exporter_is_validated():
    from apt_serve_ray.observability.tracing import configure_tracing

    assert configure_tracing("none") is None
    with pytest.raises(ValueError, match="tracing_exporter"):
        configure_tracing("zipkin-please")
