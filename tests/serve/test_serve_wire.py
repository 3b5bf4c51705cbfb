"""The contracts between the deployments (deployments/wire.py): what crosses Ray between router,
engine replicas, request router and controller."""

from __future__ import annotations

import pickle

import pytest
from serve_helpers import load_report

from apt_serve_ray import SamplingParams
from deployments.wire import (ArrivalCount, ControllerDecision, ControllerState, EngineRequest, InvalidRequest, Knobs,
                              LoadReport, StreamItem)


def test_every_contract_survives_pickling_as_ray_sends_it():
    request = EngineRequest([1, 2, 3], SamplingParams(temperature=0, max_tokens=4, stop=["."]), "cmpl-1",
                            priority=-1, ttft_slo_ms=500.0, trace_context={"traceparent": "00-ab-cd-01"},
                            service_class="interactive")
    report = load_report(num_free_pages=100)
    state = ControllerState(admission_open=False, cache_ratio=0.1, usage=0.95, retry_after_s=2.0,
                            replicas={"r": report},
                            decisions=(ControllerDecision(1.0, 0.95, 0.1, False, "usage 0.95 > heavy 0.9"),))
    from apt_serve_ray.scheduler.predictor import TrafficPredictor

    forecast = TrafficPredictor().forecast(5, now=0)
    predicted = ControllerState(admission_open=True, cache_ratio=0.0, usage=0.2, retry_after_s=2.0,
                                knobs={"r": Knobs(0.3, is_pressured=True)}, forecast=forecast, forecast_usage=0.9,
                                admission_limit=0.75, decisions=(ControllerDecision(
                                    1.0, 0.2, 0.1, True, "forecast", replica_id="r", forecast=forecast,
                                    forecast_usage=0.9, actions=("raise_hidden_target",)),))
    objects = [request, StreamItem("a", (5,), replica_id="r", num_prompt_tokens=3), InvalidRequest("prompt: empty"),
               report, Knobs(cache_ratio=0.2), state, predicted, ArrivalCount("router", 3, 300, 96),
               load_report(is_pressured=True)]
    for obj in objects:
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_an_engine_request_knows_its_size_and_scheduling_hints():
    request = EngineRequest([1] * 7, SamplingParams(max_tokens=9), tbt_slo_ms=50.0)
    assert request.num_prompt_tokens == 7 and request.max_tokens == 9
    assert request.scheduling_kwargs() == {"tbt_slo_ms": 50.0}  # no class: an older sender's request still works
    labelled = EngineRequest([1], SamplingParams(), priority=10, service_class="batch")
    assert labelled.scheduling_kwargs() == {"priority": 10, "service_class": "batch"}
    assert EngineRequest("a text prompt", SamplingParams()).num_prompt_tokens is None  # routing leaves it to Serve
    with pytest.raises(ValueError, match="sampling"):
        EngineRequest([1], {"temperature": 0})


def test_merged_stream_items_keep_the_first_items_header_and_the_last_items_end():
    first = StreamItem("Hel", (1,), replica_id="r", num_prompt_tokens=4, engine_ttft_s=0.1)
    middle = StreamItem("lo", (2,))
    last = StreamItem(" you", (3, 4), finish_reason="length", num_output_tokens=4, engine_ttft_s=0.1, engine_e2e_s=0.5)
    merged = StreamItem.merge([first, middle, last])
    assert merged == StreamItem("Hello you", (1, 2, 3, 4), replica_id="r", num_prompt_tokens=4, engine_ttft_s=0.1,
                                finish_reason="length", num_output_tokens=4, engine_e2e_s=0.5)
    assert merged.is_final and not merged.is_failed
    assert StreamItem.merge([middle]) is middle
    assert StreamItem("", finish_reason="error", error="boom").is_failed


def test_a_load_report_goes_through_serves_routing_stats_as_a_dict():
    report = load_report(num_free_pages=7, num_pending_pages=2)
    stats = report.to_dict()
    assert isinstance(stats, dict) and stats["num_free_pages"] == 7
    assert LoadReport.from_dict(stats) == report and report.num_used_pages == 121
    with pytest.raises(TypeError):  # a report of another version says so instead of routing on guesses
        LoadReport.from_dict({**stats, "num_kv_pages": 3})
