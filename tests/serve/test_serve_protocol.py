"""The OpenAI wire format (validation and error bodies) and the coalescing of token streams."""

from __future__ import annotations

import asyncio

import pytest

from deployments import openai_objects as objects
from deployments import openai_protocol as oai
from deployments.streaming import coalesced
from deployments.wire import StreamItem


@pytest.mark.parametrize("raw, param", [
    (b"{not json", None),
    (b"[]", None),
    ({"prompt": "x"}, "model"),
    ({"model": "m", "prompt": 1.5}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "presence_penalty": "a little"}, "presence_penalty"),
    ({"model": "m", "prompt": "x", "echo": True}, "echo"),
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": ["a"] * 65, "n": 2}, "prompt"),  # 130 choices
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "store": True}, "store"),
    # A field this server does not implement: refused by name, never ignored.
    ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ({"model": "m", "prompt": "x", "tbt_slo_ms": 0}, "tbt_slo_ms"),
    # Hostile input: each a 400, never an exception out of the router (a 500).
    (b"[" * 100_000 + b"]" * 100_000, None),  # nested past the parser's recursion limit
    (b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),  # over Python's 4,300 digits
    (b'{"model": "m", "prompt": "\xff"}', None),  # not UTF-8
    (b'{"model": "m", "prompt": "\\ud800"}', None),  # a lone surrogate
    ({"model": "m", "prompt": "x", "priority": 2**63}, "priority"),  # beyond int64
    ({"model": "m", "prompt": [1, -2**64]}, "prompt"),
])
def test_bad_completion_requests_name_the_field(raw, param):
    with pytest.raises(oai.APIError) as info:
        request = oai.parse_request(oai.CompletionRequest, raw)
        request.prompts()
    error = info.value
    assert error.status == 400 and error.param == param
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages.0.colour"),
    ({"web_search_options": {}}, "web_search_options"),
])
def test_bad_chat_requests_name_the_field(raw, param):
    with pytest.raises(oai.APIError) as info:
        oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      **raw})
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_what_the_peers_clients_send_is_accepted_and_means_what_they_mean():
    # vLLM's benchmark client (vllm bench serve): completions with these fields; chat with these.
    body = oai.parse_request(oai.CompletionRequest, {
        "model": "m", "prompt": "x", "repetition_penalty": 1.0, "max_tokens": 8, "logprobs": None, "stream": True,
        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0, "top_p": 0.9,
        "top_k": 5, "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": 0.25})
    kwargs = body.sampling_kwargs(default_max_tokens=16)
    assert (kwargs["min_p"], kwargs["frequency_penalty"], kwargs["presence_penalty"]) == (0.1, 0.5, 0.25)
    assert kwargs["logprobs"] is None
    chat = oai.parse_request(oai.ChatCompletionRequest, {
        "model": "m", "messages": [{"role": "user", "content": "x", "name": "ann"}], "max_completion_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 2,
        "logit_bias": {"50": -100}, "store": False, "parallel_tool_calls": False, "tool_choice": "none",
        "response_format": {"type": "text"}, "chat_template_kwargs": {"enable_thinking": False}})
    kwargs = chat.sampling_kwargs(default_max_tokens=100)
    assert kwargs["logprobs"] == 2 and kwargs["logit_bias"] == {"50": -100} and kwargs["max_tokens"] == 4
    assert oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 3}).num_logprobs == 3
    assert oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                         "logprobs": True}).num_logprobs == 0


def test_logprobs_objects_follow_openai():
    text = {7: "a", 8: " b", 9: "c"}.__getitem__
    per_token = [{7: -0.1, 9: -2.5}, {9: -0.5, 8: -1.0, 7: -3.0}]  # the second token was not the likeliest
    chat = objects.logprobs_object([7, 8], per_token, 1, text, chat=True)
    assert chat == {"content": [
        {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]},
        {"token": " b", "logprob": -1.0, "bytes": [32, 98],
         "top_logprobs": [{"token": "c", "logprob": -0.5, "bytes": [99]}]}]}
    completion = objects.logprobs_object([7, 8], per_token, 2, text, chat=False, offset=3)
    assert completion == {"tokens": ["a", " b"], "token_logprobs": [-0.1, -1.0],
                          "top_logprobs": [{"a": -0.1, "c": -2.5}, {"c": -0.5, " b": -1.0}], "text_offset": [3, 4]}


def test_sampling_fields_left_out_take_the_models_defaults():
    request = oai.parse_request(oai.CompletionRequest, {"model": "m", "prompt": "x", "top_p": 0.5})
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    kwargs = request.sampling_kwargs(default_max_tokens=16, defaults=defaults)
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["top_k"]) == (0.2, 0.5, 40)  # the request's own wins
    assert "temperature" not in request.sampling_kwargs(default_max_tokens=16)  # none: SamplingParams' default


def test_chat_requests_accept_text_parts_and_max_completion_tokens():
    request = oai.parse_request(oai.ChatCompletionRequest, {
        "model": "m", "max_completion_tokens": 7,
        "messages": [{"role": "user",
                      "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]})
    assert request.conversation() == [{"role": "user", "content": "Hi there"}]
    assert request.sampling_kwargs(default_max_tokens=100)["max_tokens"] == 7
    with pytest.raises(oai.APIError, match="messages.0.role"):
        oai.parse_request(oai.ChatCompletionRequest, {"model": "m", "messages": [{"role": "bot", "content": "x"}]})


def test_library_value_errors_keep_their_field():
    assert oai.from_value_error(ValueError("top_p: must be in (0, 1], got 2")).param == "top_p"
    assert oai.from_value_error(ValueError("something odd happened")).param is None
    overloaded = oai.APIError("busy", status=503, retry_after_s=1.4)
    assert overloaded.headers() == {"Retry-After": "1"}


def test_stream_chunks_follow_openai():
    chunk = objects.chunk("chatcmpl-1", "m", 1, chat=True, text="", role=True, include_usage=True)
    assert chunk["choices"][0]["delta"] == {"role": "assistant", "content": ""} and chunk["usage"] is None
    last = objects.chunk("chatcmpl-1", "m", 1, chat=True, text="", reason="stop")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop" and "usage" not in last
    usage = objects.chunk("cmpl-1", "m", 1, chat=False, usage_=objects.usage(3, 4), include_usage=True)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert objects.sse("[DONE]") == "data: [DONE]\n\n"


async def _source(items, delay_after=(), fail_at=None):
    for i, item in enumerate(items):
        if i == fail_at:
            raise RuntimeError("engine died")
        yield item
        if i in delay_after:
            await asyncio.sleep(0.05)


def _item(i, **extra):
    return StreamItem(str(i), (i,), **extra)


@pytest.mark.asyncio
async def test_coalesced_merges_what_piled_up_and_keeps_order():
    items = [_item(0, replica_id="r"), _item(1), _item(2), _item(3, finish_reason="stop")]
    out = []
    async for merged in coalesced(_source(items), StreamItem.merge):
        out.append(merged)
        await asyncio.sleep(0.01)  # a slow consumer: the rest pile up meanwhile
    assert "".join(m.text for m in out) == "0123"
    assert [t for m in out for t in m.token_ids] == [0, 1, 2, 3]
    assert len(out) < 4 and out[0].replica_id == "r" and out[-1].finish_reason == "stop"


@pytest.mark.asyncio
async def test_coalesced_passes_items_one_by_one_to_a_fast_consumer_and_raises_errors_in_order():
    out = [m async for m in coalesced(_source([_item(0), _item(1)], delay_after={0}), StreamItem.merge)]
    assert [m.text for m in out] == ["0", "1"]
    seen = []
    with pytest.raises(RuntimeError, match="engine died"):
        async for merged in coalesced(_source([_item(0), _item(1), _item(2)], delay_after={0, 1}, fail_at=2),
                                      StreamItem.merge):
            seen.append(merged.text)
    assert seen == ["0", "1"]


@pytest.mark.asyncio
async def test_closing_coalesced_closes_its_source():
    closed = asyncio.Event()

    async def endless():
        try:
            i = 0
            while True:
                yield _item(i)
                i += 1
                await asyncio.sleep(0.001)
        finally:
            closed.set()

    stream = coalesced(endless(), StreamItem.merge)
    await anext(stream)
    await stream.aclose()
    assert closed.is_set()


def test_openapi_describes_the_request_bodies_without_refs():
    body = oai.openapi_body(oai.ChatCompletionRequest)["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" not in repr(body) and "$defs" not in body
    assert body["properties"]["messages"]["items"]["properties"]["role"]["enum"][0] == "system"


def test_api_keys_accept_any_configured_key_and_nothing_else():
    from deployments.auth import ApiKeys, resolve_keys

    keys = ApiKeys(resolve_keys(["sk-one", "sk-two"]))
    assert keys.is_valid("Bearer sk-one") and keys.is_valid("bearer sk-two")
    assert not any(keys.is_valid(h) for h in (None, "", "Bearer", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one",
                                              "sk-one", "Bearer \u00e9"))
    assert keys.check("/health", None) is None
    error = keys.check("/v1/models", "Bearer nope")
    assert error.status == 401 and error.body()["error"]["code"] == "invalid_api_key"
    assert ApiKeys().is_valid(None)  # no keys: no auth
    with pytest.raises(ValueError, match="api_keys"):
        resolve_keys(["sk-one", ""])


async def _timed(n, every_s, end_after_s=0.0):
    for i in range(n):
        yield _item(i)
        await asyncio.sleep(every_s)
    await asyncio.sleep(end_after_s)


@pytest.mark.asyncio
async def test_coalesced_min_interval_paces_a_fast_consumer_and_keeps_every_token():
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = [m async for m in coalesced(_timed(40, 0.005), StreamItem.merge, min_interval_s=0.05)]
    elapsed = loop.time() - start
    assert [t for m in out for t in m.token_ids] == list(range(40))
    # ~0.2 s of tokens at one item per 50 ms: about 4-5 items, not 40 (one per token without pacing).
    assert 2 <= len(out) <= 8, len(out)
    assert elapsed < 0.5
    unpaced = [m async for m in coalesced(_timed(10, 0.005), StreamItem.merge)]
    assert len(unpaced) == 10


@pytest.mark.asyncio
async def test_coalesced_min_interval_never_holds_back_the_end_or_an_error():
    loop = asyncio.get_running_loop()
    start = loop.time()
    out = [m async for m in coalesced(_timed(3, 0.0), StreamItem.merge, min_interval_s=5.0)]
    assert [t for m in out for t in m.token_ids] == [0, 1, 2]
    assert loop.time() - start < 1.0  # the source ended: no 5-s wait
    start = loop.time()
    with pytest.raises(RuntimeError, match="engine died"):
        async for _ in coalesced(_source([_item(0), _item(1)], fail_at=1), StreamItem.merge, min_interval_s=5.0):
            pass
    assert loop.time() - start < 1.0
    with pytest.raises(ValueError, match="min_interval_s"):
        await anext(coalesced(_timed(1, 0.0), StreamItem.merge, min_interval_s=-1.0))


@pytest.mark.asyncio
async def test_coalesced_asks_a_callable_interval_before_every_item():
    asked = []

    def interval() -> float:
        asked.append(len(asked))
        return 0.0 if len(asked) < 4 else 10.0  # then 10 s: only the end ends the wait

    loop = asyncio.get_running_loop()
    start = loop.time()
    out = [m async for m in coalesced(_timed(20, 0.002), StreamItem.merge, min_interval_s=interval)]
    assert [t for m in out for t in m.token_ids] == list(range(20))
    assert len(asked) >= 4 and loop.time() - start < 1.0
    assert len(out) <= 4  # after the interval grew, the rest came in the item the end released


def test_stream_interval_widens_with_the_replicas_streams_up_to_a_quarter_of_the_gap_target():
    from deployments.streaming import stream_interval

    assert stream_interval(0.05, 3, None, 1000) == 0.05  # no budget: the base
    assert stream_interval(0.05, 2, 50.0, 1000) == 0.05  # 2 streams x 20 items/s: within 50 items/s
    assert stream_interval(0.05, 10, 50.0, 1000) == pytest.approx(0.2)  # 10 streams share 50 items/s
    assert stream_interval(0.05, 100, 50.0, 1000) == 0.25  # never past TBT / 4
    assert stream_interval(0.05, 100, 50.0, 100) == 0.025  # a tight target: finer, whatever the load
    assert stream_interval(0.0, 0, 50.0, 1000) == 0.0


def test_a_request_shed_before_it_started_is_a_503_with_retry_after():
    from apt_serve_ray.engine.outputs import OVERLOADED
    from deployments.responses import failure

    shed = failure(StreamItem("", finish_reason="error", error=f"{OVERLOADED}: cannot start in time"))
    assert shed.status == 503 and shed.code == "cannot_start_in_time" and shed.type == "server_overloaded"
    assert int(shed.headers()["Retry-After"]) >= 1
    broken = failure(StreamItem("", finish_reason="error", error="RuntimeError: boom"))
    assert broken.status == 500 and "Retry-After" not in broken.headers()
