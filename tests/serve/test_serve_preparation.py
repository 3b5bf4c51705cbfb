"""Request preparation (deployments/preparation.py): an OpenAI body -> an EngineRequest and its
admission ticket, or an APIError naming the field; no cluster, a fake tokenizer."""

from __future__ import annotations

import pytest

from deployments import openai_protocol as oai
from deployments.preparation import ModelLimits, RequestPreparer
from deployments.service_classes import ServiceClass, ServiceClasses

LIMITS = ModelLimits(max_model_len=100, tokens_per_page=16)


class FakeTokenizer:
    chat_template = None  # chat requests are refused: "this model has no chat template"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def prepare(body: dict, chat: bool = False, header: str | None = None, classes: ServiceClasses | None = None,
            **sampling_defaults):
    preparer = RequestPreparer("m", FakeTokenizer(), sampling_defaults=sampling_defaults,
                               default_ttft_slo_ms=10_000.0, output_horizon_tokens=64, service_classes=classes)
    return preparer.prepare({"model": "m", **body}, chat, LIMITS, received=1.0, service_class_header=header)


def test_a_completion_becomes_a_tokenised_engine_request_and_its_ticket():
    prepared = prepare({"prompt": "hello", "max_tokens": 20, "priority": 2, "ttft_slo_ms": 500})
    request = prepared.request
    assert prepared.request_id.startswith("cmpl-") and request.request_id == prepared.request_id
    assert request.prompt == [ord(c) for c in "hello"] and request.num_prompt_tokens == 5
    # The request's own priority and TTFT target; the default class sets nothing (the engine's defaults).
    assert request.max_tokens == 20 and request.scheduling_kwargs() == {
        "priority": 2, "ttft_slo_ms": 500, "service_class": "default"}
    assert (prepared.ticket.num_pages, prepared.ticket.ttft_slo_s, prepared.ticket.priority) == (2, 0.5, 2)
    assert prepared.received == 1.0
    assert prepare({"prompt": "hello"}).request.max_tokens == 16  # OpenAI's default for completions
    salted = prepare({"prompt": "hello", "cache_salt": "tenant-1"}).request
    assert salted.cache_salt == "tenant-1" and salted.scheduling_kwargs()["cache_salt"] == "tenant-1"


def test_sampling_fields_a_request_leaves_out_take_the_models_defaults():
    request = prepare({"prompt": "hi", "top_k": 7}, temperature=0.0, top_k=5).request
    assert request.sampling.temperature == 0.0 and request.sampling.top_k == 7
    assert prepare({"prompt": "hi"}).request.sampling.temperature == 1.0  # no defaults: SamplingParams' own


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x" * 100}, 400, "prompt"),  # no room left in the context
    ({"prompt": "x" * 5, "max_tokens": 96}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1.0}, 400, "temperature"),
    ({"prompt": [5, "a"]}, 400, "prompt"),
    ({"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
])
def test_bad_requests_are_api_errors_naming_the_field(body, status, param):
    with pytest.raises(oai.APIError) as info:
        prepare(body)
    assert (info.value.status, info.value.param) == (status, param)


def test_a_chat_request_for_a_model_without_a_chat_template_is_refused():
    with pytest.raises(oai.APIError) as info:
        prepare({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert info.value.param == "messages"


# Service classes --------------------------------------------------------------------------------
def hints(prepared) -> tuple:
    r, t = prepared.request, prepared.ticket
    return r.service_class, r.priority, r.ttft_slo_ms, r.tbt_slo_ms, t.priority, t.ttft_slo_s


def test_a_request_chooses_its_class_by_field_or_header_else_gets_the_default():
    assert hints(prepare({"prompt": "hi"})) == ("default", None, None, None, 0, 10.0)  # the engine's defaults
    assert hints(prepare({"prompt": "hi"}, header="batch")) == ("batch", 10, 30_000, 1_000, 10, 30.0)
    assert hints(prepare({"prompt": "hi"}, header="interactive")) == ("interactive", 0, 1_000, 100, 0, 1.0)
    assert hints(prepare({"prompt": "hi", "service_class": "interactive"})) == ("interactive", 0, 1_000, 100, 0, 1.0)
    both = prepare({"prompt": "hi", "service_class": "interactive"}, header="interactive")
    assert both.request.service_class == "interactive"


def test_the_requests_own_hints_override_its_classs_and_unset_ones_fall_to_the_engine():
    prepared = prepare({"prompt": "hi", "service_class": "interactive", "priority": 3, "tbt_slo_ms": 250})
    assert hints(prepared) == ("interactive", 3, 1_000, 250, 3, 1.0)
    # A class that leaves a field out leaves it to the engine's default_* (and the router's default TTFT).
    classes = ServiceClasses({"bulk": ServiceClass(priority=5)}, default="bulk")
    prepared = prepare({"prompt": "hi"}, classes=classes)
    assert prepared.request.scheduling_kwargs() == {"priority": 5, "service_class": "bulk"}
    assert prepared.ticket.ttft_slo_s == 10.0


@pytest.mark.parametrize("body, header, param", [
    ({"service_class": "gold"}, None, "service_class"),
    ({}, "gold", "x-service-class"),
    ({"service_class": "batch"}, "interactive", "service_class"),  # two different names
    ({"service_class": 1}, None, "service_class"),
])
def test_an_unknown_or_ambiguous_class_is_a_400_naming_the_field_and_the_valid_names(body, header, param):
    with pytest.raises(oai.APIError) as info:
        prepare({"prompt": "hi", **body}, header=header)
    assert (info.value.status, info.value.param) == (400, param)
    if "gold" in (body.get("service_class"), header):
        assert "['batch', 'default', 'interactive']" in info.value.message


@pytest.mark.parametrize("classes, default, field", [
    ({"batch": ServiceClass()}, "interactive", "default_service_class"),
    ({"no spaces": ServiceClass()}, "no spaces", "service_classes"),
])
def test_service_classes_are_checked_once_naming_the_field(classes, default, field):
    with pytest.raises(ValueError, match=field):
        ServiceClasses(classes, default)


def test_a_request_names_a_lora_adapter_as_its_model():
    preparer = RequestPreparer("m", FakeTokenizer(), sampling_defaults={}, default_ttft_slo_ms=10_000.0,
                               output_horizon_tokens=64, adapters=("sql", "chat"))
    request = preparer.prepare({"model": "sql", "prompt": "hi"}, False, LIMITS, received=1.0).request
    assert request.lora_name == "sql" and request.scheduling_kwargs()["lora_name"] == "sql"
    base = preparer.prepare({"model": "m", "prompt": "hi"}, False, LIMITS, received=1.0).request
    assert base.lora_name is None and "lora_name" not in base.scheduling_kwargs()
    with pytest.raises(oai.APIError) as info:
        preparer.prepare({"model": "other", "prompt": "hi"}, False, LIMITS, received=1.0)
    assert info.value.status == 404 and "`sql`" in str(info.value.message)
