"""Request preparation (deployments/preparation.py): an OpenAI body -> an EngineRequest and its
admission ticket, or an APIError naming the field; no cluster, a fake tokenizer."""

from __future__ import annotations

import pytest

from deployments import openai_protocol as oai
from deployments.preparation import ModelLimits, RequestPreparer

LIMITS = ModelLimits(max_model_len=100, tokens_per_page=16)


class FakeTokenizer:
    chat_template = None  # chat requests are refused: "this model has no chat template"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def prepare(body: dict, chat: bool = False, **sampling_defaults):
    preparer = RequestPreparer("m", FakeTokenizer(), sampling_defaults=sampling_defaults,
                               default_ttft_slo_ms=10_000.0, output_horizon_tokens=64)
    return preparer.prepare({"model": "m", **body}, chat, LIMITS, received=1.0)


def test_a_completion_becomes_a_tokenised_engine_request_and_its_ticket():
    prepared = prepare({"prompt": "hello", "max_tokens": 20, "priority": 2, "ttft_slo_ms": 500})
    request = prepared.request
    assert prepared.request_id.startswith("cmpl-") and request.request_id == prepared.request_id
    assert request.prompt == [ord(c) for c in "hello"] and request.num_prompt_tokens == 5
    assert request.max_tokens == 20 and request.scheduling_kwargs() == {"priority": 2, "ttft_slo_ms": 500}
    assert (prepared.ticket.num_pages, prepared.ticket.ttft_slo_s, prepared.ticket.priority) == (2, 0.5, 2)
    assert prepared.received == 1.0
    assert prepare({"prompt": "hello"}).request.max_tokens == 16  # OpenAI's default for completions


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
])
def test_bad_requests_are_api_errors_naming_the_field(body, status, param):
    with pytest.raises(oai.APIError) as info:
        prepare(body)
    assert (info.value.status, info.value.param) == (status, param)


def test_a_chat_request_for_a_model_without_a_chat_template_is_refused():
    with pytest.raises(oai.APIError) as info:
        prepare({"messages": [{"role": "user", "content": "hi"}]}, chat=True)
    assert info.value.param == "messages"
