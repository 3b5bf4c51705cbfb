"""The Ray Serve app end to end: two engine replicas of a tiny MHA model behind the router and the
controller, driven over HTTP (httpx and the official ``openai`` client) and through Python handles.
The model's generation config says ``temperature: 0``: requests that name no temperature are greedy.

One app for the module (its start dominates the cost); the tests that disturb it (memory pressure,
killing a replica) run last and wait for it to settle.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import assert_openai_error, sse_payloads, sse_payloads_from, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "apt-test"
NUM_PAGES = 128  # per replica: 2,048 tokens with a KV cache (opt-tiny: 16 tokens per KV page, 32 per hidden)
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def greedy_opt_tiny(opt_tiny, tmp_path_factory) -> str:
    """opt-tiny whose generation_config.json sets a default temperature of 0 (greedy)."""
    path = tmp_path_factory.mktemp("greedy") / "opt-tiny"
    shutil.copytree(opt_tiny, path)
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return str(path)


@pytest.fixture(scope="module")
def app(serve_url, greedy_opt_tiny):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({
        "model": greedy_opt_tiny, "num_replicas": 2, "num_pages": NUM_PAGES, "num_threads": 1, "max_num_seqs": 16,
        "num_cpus_per_replica": 0.5, "light_watermark": 0.6, "heavy_watermark": 0.85, "max_hidden_ratio": 0.5,
        "cache_kinds": ["hidden", "kv-int8"],  # at rest the ceiling is 0: outputs exact, pages KV
        "control_interval_s": 0.1, "retry_after_s": 1, "routing_stats_period_s": 0.5, "health_check_period_s": 1,
    }), name=APP, route_prefix="/")
    wait_until(lambda: len(controller_state().replicas) == 2, "both engine replicas report")
    yield greedy_opt_tiny
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(app, serve_url):
    with httpx.Client(base_url=serve_url, timeout=60) as c:
        yield c


# Helpers ----------------------------------------------------------------------------------------
def controller_state():
    """The controller's ``ControllerState``."""
    from ray import serve

    return serve.get_deployment_handle("Controller", APP).get_state.remote().result()


def replicas() -> dict:
    """Replica id -> its last ``LoadReport``."""
    return controller_state().replicas


def all_pages_free() -> bool:
    loads = replicas().values()
    return len(loads) == 2 and all(r.num_free_pages == r.num_pages and r.num_running == 0 for r in loads)


def completion(client, model, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "The quick brown fox", **fields})


# The API ----------------------------------------------------------------------------------------
def test_each_engine_replica_has_its_own_sampling_seed(app):
    seeds = [load.seed for load in replicas().values()]
    assert len(seeds) == 2 and seeds[0] != seeds[1]


def test_models_and_health(client, app):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == app
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_non_streaming(client, app):
    r = completion(client, app, max_tokens=12, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"]["completion_tokens"] == 12
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12
    assert r.headers["x-replica-id"] in replicas()


def test_streaming_matches_non_streaming_and_reports_usage(client, app):
    full = completion(client, app, max_tokens=16, temperature=0, ignore_eos=True).json()
    with client.stream("POST", "/v1/completions", json={
            "model": app, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = payloads[:-1]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])


def test_return_token_ids_gives_the_prompt_and_generated_ids_as_vllm_does(client, app):
    prompt = list(range(100, 140))
    body = {"model": app, "prompt": prompt, "max_tokens": 9, "ignore_eos": True, "return_token_ids": True}
    full = client.post("/v1/completions", json=body).json()
    choice = full["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 9
    assert full["usage"]["prompt_tokens_details"]["cached_tokens"] in range(0, 40, 16)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = sse_payloads(r)[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_a_next_turn_goes_where_its_history_is_cached_and_says_how_much_was(client, app):
    history = list(range(1000, 1200))  # 12 full pages and 8 tokens
    body = {"model": app, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
    first = client.post("/v1/completions", json={**body, "prompt": history})
    reply = first.json()["choices"][0]["token_ids"]
    second = client.post("/v1/completions", json={**body, "prompt": history + reply + [5, 6, 7]})
    assert second.headers["x-replica-id"] == first.headers["x-replica-id"]  # the router's prefix affinity
    # 207 tokens computed (the last reply token is sampled, never fed): 12 full pages named.
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    # A session header is accepted (where it sticks and where it gives way: test_serve_request_router.py).
    r = client.post("/v1/completions", json={**body, "prompt": [3] * 20}, headers={"x-session-id": "s-1"})
    assert r.status_code == 200


def test_sampling_fields_a_request_leaves_out_come_from_the_models_generation_config(client, app):
    greedy = completion(client, app, max_tokens=12, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    unset = [completion(client, app, max_tokens=12, ignore_eos=True, seed=i).json()["choices"][0]["text"]
             for i in range(3)]
    assert unset == [greedy] * 3
    # A temperature the request names wins (near-uniform logits of a random model: never the greedy text).
    sampled = [completion(client, app, max_tokens=12, ignore_eos=True, temperature=1.0, seed=i).json()
               for i in range(3)]
    assert all(s["choices"][0]["text"] != greedy for s in sampled), sampled


def test_stop_string_and_token_id_prompt(client, app):
    text = completion(client, app, max_tokens=24, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    stop = text.split()[3]
    cut = completion(client, app, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]).json()
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    ids = client.post("/v1/completions", json={"model": app, "prompt": [10, 20, 30, 40], "max_tokens": 5,
                                               "ignore_eos": True}).json()
    assert ids["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                            "prompt_tokens_details": {"cached_tokens": 0}}  # not a full page


def test_chat_streaming_and_not(client, app):
    request = {"model": app, "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello!"}],
               "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    body = client.post("/v1/chat/completions", json=request).json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert body["usage"]["completion_tokens"] == 10
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(p["choices"][0]["delta"].get("content", "") for p in payloads[:-1]) == message["content"]
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_client(serve_url, app):
    import openai

    oc = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in oc.models.list()] == [app]
    done = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
                                 extra_body={"ignore_eos": True})
    again = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
                                  extra_body={"ignore_eos": True})
    assert done.choices[0].text == again.choices[0].text and done.usage.completion_tokens == 8
    streamed = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=8, temperature=0.8, seed=7,
                                     stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    chat = oc.chat.completions.create(
        model=app, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "priority": -1, "ttft_slo_ms": 500})
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 6
    stream = oc.chat.completions.create(model=app, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                        temperature=0, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError) as info:
        oc.completions.create(model=app, prompt="x", max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        oc.completions.create(model="no-such-model", prompt="x")


def test_openai_client_logprobs_n_several_prompts_and_penalties(serve_url, app):
    import openai

    oc = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name three colours"}]
    # Chat logprobs: the chosen token's and the top ones, sorted; greedy picks the likeliest.
    chat = oc.chat.completions.create(model=app, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                      top_logprobs=3, extra_body={"ignore_eos": True, "cache_salt": "once"})
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and c.logprob == tops[0] <= 0
    # The same request streamed, under a salt of its own: no prefix-cache hit, so its prompt is computed
    # as the first one's was and the logprobs agree to the last digit (a hit attends the cached pages
    # another way, which in bf16 moves logprobs by ~1e-2 and may flip a near-tie).
    stream = oc.chat.completions.create(model=app, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=3, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True, "cache_salt": "stream"})
    chunks = list(stream)
    streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    assert chunks[-1].usage.prompt_tokens_details is None or not chunks[-1].usage.prompt_tokens_details.cached_tokens
    # Completion logprobs, n = 2 sampled with a seed (the two differ, each reproducible), two prompts.
    done = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=5, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs[0]) == 2 and lp.text_offset[0] == 0
    two = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=3,
                                extra_body={"ignore_eos": True})
    again = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=8, n=2, temperature=1.0, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text != two.choices[1].text
    assert [c.text for c in two.choices] == [c.text for c in again.choices]
    assert two.usage.completion_tokens == 16 and two.usage.prompt_tokens == done.usage.prompt_tokens
    many = oc.completions.create(model=app, prompt=["Once upon a time", "The capital of France"], max_tokens=4,
                                 n=2, temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == done.choices[0].text[:len(many.choices[0].text)]
    streamed = oc.chat.completions.create(model=app, messages=messages, max_tokens=5, n=2, temperature=1.0, seed=5,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    assert texts[0] and texts[1] and usage.completion_tokens == 10
    # Penalties and a logit bias change what greedy decoding picks.
    plain = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = plain.choices[0].model_extra["token_ids"]
    banned = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=12, temperature=0,
                                   logit_bias={str(ids[0]): -100}, extra_body={"ignore_eos": True,
                                                                                "return_token_ids": True})
    assert banned.choices[0].model_extra["token_ids"][0] != ids[0]
    penalised = oc.completions.create(model=app, prompt="Once upon a time", max_tokens=12, temperature=0,
                                      frequency_penalty=2.0, presence_penalty=2.0,
                                      extra_body={"ignore_eos": True, "repetition_penalty": 1.5,
                                                  "return_token_ids": True})
    out = penalised.choices[0].model_extra["token_ids"]
    assert len(set(out)) >= len(set(ids)) and out != ids


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}


def test_openai_client_structured_output_and_a_tool_round_trip(serve_url, app):
    import jsonschema
    import openai

    oc = openai.OpenAI(base_url=serve_url + "/v1", api_key="unused", max_retries=0)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    for stream in (False, True):
        kwargs = dict(model=app, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=60,
                      temperature=0.7, seed=2,
                      response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                              "strict": True}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(stream=True, **kwargs)
                           if c.choices)
        else:
            text = oc.chat.completions.create(**kwargs).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
    done = oc.completions.create(model=app, prompt="Yes or no?", max_tokens=5, temperature=1.0,
                                 extra_body={"guided_choice": ["yes", "no"]})
    assert done.choices[0].text in ("yes", "no") and done.choices[0].finish_reason == "stop"
    done = oc.completions.create(model=app, prompt="A code:", max_tokens=12,
                                 extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", done.choices[0].text)

    # A tool round trip: the named call (arguments under the function's schema), its result, a reply.
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = oc.chat.completions.create(model=app, messages=messages, tools=[WEATHER], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    reply = oc.chat.completions.create(model=app, messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    # "required", streamed: the calls arrive as tool_calls deltas the client assembles.
    calls: dict[int, dict] = {}
    for chunk in oc.chat.completions.create(model=app, messages=messages[:1], tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, stream=True, parallel_tool_calls=False):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            last_reason = choice.finish_reason or None
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and last_reason == "tool_calls"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_python_handles(app):
    from ray import serve

    from deployments.openai_protocol import APIError

    handle = serve.get_app_handle(APP)
    body = handle.completions.remote({"model": app, "prompt": "Hello", "max_tokens": 5, "temperature": 0,
                                      "ignore_eos": True}).result()
    assert body["usage"]["completion_tokens"] == 5
    chunks = list(handle.options(stream=True).completions_stream.remote(
        {"model": app, "prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    chat = handle.chat.remote({"model": app, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                               "ignore_eos": True, "service_class": "interactive"}).result()
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] == 4
    deltas = list(handle.options(stream=True).chat_stream.remote(
        {"model": app, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True,
         "stream_options": {"include_usage": True}}))
    assert deltas[-1]["usage"]["completion_tokens"] == 4
    with pytest.raises(APIError) as info:
        handle.completions.remote({"model": app, "prompt": "x", "temperature": -1}).result()
    assert info.value.param == "temperature" and info.value.status == 400


BAD_REQUESTS = [
    ("malformed JSON", "/v1/completions", b'{"model": ', 400, None),
    ("not an object", "/v1/completions", [1, 2], 400, None),
    ("missing model", "/v1/completions", {"prompt": "x"}, 400, "model"),
    ("missing prompt", "/v1/completions", {"model": "{m}"}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "{m}"}, 400, "messages"),
    ("wrong type: prompt", "/v1/completions", {"model": "{m}", "prompt": 5}, 400, "prompt"),
    ("wrong type: max_tokens", "/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": "8"}, 400,
     "max_tokens"),
    ("wrong type: stream", "/v1/completions", {"model": "{m}", "prompt": "x", "stream": "yes"}, 400, "stream"),
    ("unknown model", "/v1/completions", {"model": "gpt-17", "prompt": "x"}, 404, "model"),
    ("empty messages", "/v1/chat/completions", {"model": "{m}", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("empty prompt", "/v1/completions", {"model": "{m}", "prompt": ""}, 400, "prompt"),
    ("negative max_tokens", "/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("zero max_tokens", "/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"model": "{m}", "prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("prompt over the context", "/v1/completions", {"model": "{m}", "prompt": "hello " * MAX_MODEL_LEN}, 400,
     "prompt"),
    ("token ids over the context", "/v1/completions", {"model": "{m}", "prompt": [5] * MAX_MODEL_LEN}, 400, "prompt"),
    ("prompt + max_tokens over the context", "/v1/completions",
     {"model": "{m}", "prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN - 99}, 400, "max_tokens"),
    ("token id out of the vocabulary", "/v1/completions", {"model": "{m}", "prompt": [10**7]}, 400, "prompt"),
    ("negative temperature", "/v1/completions", {"model": "{m}", "prompt": "x", "temperature": -0.5}, 400,
     "temperature"),
    ("top_p above 1", "/v1/completions", {"model": "{m}", "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_p zero", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "x"}],
                                            "top_p": 0}, 400, "top_p"),
    ("n = 0", "/v1/completions", {"model": "{m}", "prompt": "x", "n": 0}, 400, "n"),
    ("an unknown field", "/v1/completions", {"model": "{m}", "prompt": "x", "best_effort": True}, 400, "best_effort"),
    ("logit_bias out of the vocabulary", "/v1/completions", {"model": "{m}", "prompt": "x",
                                                             "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("presence_penalty out of range", "/v1/completions", {"model": "{m}", "prompt": "x", "presence_penalty": 3},
     400, "presence_penalty"),
    ("a regex the grammar library refuses", "/v1/completions", {"model": "{m}", "prompt": "x",
                                                                "guided_regex": "(unclosed"}, 400, "guided_regex"),
    ("a JSON schema that is not one", "/v1/chat/completions", {
        "model": "{m}", "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
     400, "response_format"),
    ("priority not an int", "/v1/completions", {"model": "{m}", "prompt": "x", "priority": "high"}, 400, "priority"),
    ("negative ttft_slo_ms", "/v1/completions", {"model": "{m}", "prompt": "x", "ttft_slo_ms": -1}, 400,
     "ttft_slo_ms"),
    ("tbt_slo_ms not a number", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "x"}],
                                                         "tbt_slo_ms": "fast"}, 400, "tbt_slo_ms"),
    ("stop not strings", "/v1/completions", {"model": "{m}", "prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ("unknown service class", "/v1/completions", {"model": "{m}", "prompt": "x", "service_class": "gold"}, 400,
     "service_class"),
]


def test_bad_input_gives_openai_errors_and_the_server_keeps_serving(client, app):
    for name, path, body, status, param in BAD_REQUESTS:
        if isinstance(body, dict):
            body = {k: (app if v == "{m}" else v) for k, v in body.items()}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = client.post(path, content=content, headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.text[:200])
        error = assert_openai_error(r, status)
        assert error["param"] == param, (name, error)
        if isinstance(body, dict) and param != "stream":  # the same refusal when streaming: a status, not a stream
            stream_body = json.loads(content)
            r = client.post(path, json={**stream_body, "stream": True})
            assert r.status_code == status, (name, r.text[:200])
            assert_openai_error(r, status)
    assert client.get("/v1/nope").status_code == 404
    assert completion(client, app, max_tokens=3).status_code == 200


# Routing ----------------------------------------------------------------------------------------
def test_routing_spreads_load(client, app):
    def one(i):
        r = completion(client, app, max_tokens=48, ignore_eos=True, seed=i)
        assert r.status_code == 200, r.text
        return r.headers["x-replica-id"]

    with ThreadPoolExecutor(12) as pool:
        served = list(pool.map(one, range(12)))
    counts = {rid: served.count(rid) for rid in set(served)}
    assert len(counts) == 2 and min(counts.values()) >= 3, counts


def test_routing_prefers_the_replica_where_the_request_fits(client, app, serve_url):
    wait_until(all_pages_free, "every page is free")
    # A 1,500-token prompt holds 94 of a replica's 128 pages: a 600-token one (38 pages) then fits
    # only on the other replica, whichever replica the first one went to. The big one runs for about
    # half a second in its engine; the small ones are all routed well within that.
    big = {"model": app, "prompt": [7] * 1500, "max_tokens": 540, "ignore_eos": True, "stream": True}
    small = {"model": app, "prompt": [9] * 600, "max_tokens": 8}
    with httpx.Client(base_url=serve_url, timeout=60) as holder, holder.stream(
            "POST", "/v1/completions", json=big) as held:
        next(held.iter_lines())
        with ThreadPoolExecutor(3) as pool:
            served = list(pool.map(lambda _: client.post("/v1/completions", json=small), range(3)))
        full = held.headers["x-replica-id"]
    assert all(r.status_code == 200 for r in served)
    assert all(r.headers["x-replica-id"] != full for r in served), [r.headers["x-replica-id"] for r in served]
    # The router's ledger keeps each request until a snapshot lists it as received: the replicas do list them.
    wait_until(lambda: all(r.received for r in replicas().values()), "both replicas list what they received")


def test_disconnect_aborts_the_request_and_frees_its_pages(client, app, serve_url):
    wait_until(all_pages_free, "every page is free")
    aborted_before = sum(r.num_aborted for r in replicas().values())
    with httpx.Client(base_url=serve_url, timeout=60) as c, c.stream("POST", "/v1/completions", json={
            "model": app, "prompt": [11] * 300, "max_tokens": 1700, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(5):
            next(lines)
        replica = r.headers["x-replica-id"]
        wait_until(lambda: replicas()[replica].num_free_pages < NUM_PAGES, "the request holds pages")
        # The open stream holds its admission slot at the router (one router here: /health is its view).
        assert client.get("/health").json()["requests_in_flight"] == 1
    # Closing the connection mid-stream: the engine aborts the request and its pages come back.
    wait_until(lambda: sum(r.num_aborted for r in replicas().values()) > aborted_before, "the request is aborted",
               timeout=15)
    wait_until(all_pages_free, "every page is free again", timeout=15)
    wait_until(lambda: client.get("/health").json()["requests_in_flight"] == 0, "the admission slot is released")


# The controller ---------------------------------------------------------------------------------
class PressureLoad:
    """Long requests sent straight to the engine replicas (around the router's admission) to hold
    memory; nobody reads them (the engines run regardless) and leaving cancels them."""

    def __init__(self, num_requests: int, prompt_len: int, max_tokens: int) -> None:
        from apt_serve_ray import SamplingParams
        from deployments.wire import EngineRequest

        self.requests = [EngineRequest([13 + i] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                       f"pressure-{i}-{time.time()}") for i in range(num_requests)]

    def __enter__(self):
        from ray import serve

        engine = serve.get_deployment_handle("EngineReplica", APP).options(stream=True)
        self.streams = [engine.generate.remote(r) for r in self.requests]
        return self

    def __exit__(self, *exc):
        for stream in self.streams:
            stream.cancel()


def test_controller_applies_the_watermarks_cluster_wide(client, app):
    wait_until(lambda: (s := controller_state()).admission_open and s.cache_ratio == 0.0,
               "the controller is at rest", timeout=30)
    start = time.time()
    with PressureLoad(num_requests=8, prompt_len=400, max_tokens=1600):
        # Above the light watermark: every replica's hidden target rises.
        wait_until(lambda: all(r.cache_ratio > 0 for r in replicas().values()), "replicas raise the hidden ratio")
        # Above the heavy one the router holds new work (heavy_watermark_action "hold", the default): a
        # request waits in its admission line for at most its TTFT target, then gets 503, Retry-After
        # and an OpenAI error. (Memory comes and goes as apt preempts: retried until one stays closed.)
        wait_until(lambda: not controller_state().admission_open, "admission closes")
        wait_until(lambda: client.get("/health").json()["admission_held"], "the router holds new requests")

        def held_then_refused():
            started = time.monotonic()
            r = completion(client, app, max_tokens=2, ttft_slo_ms=1000)
            return r.status_code == 503 and (r, time.monotonic() - started)

        r, waited = wait_until(held_then_refused, "a held request is refused after its TTFT target", timeout=30)
        assert waited >= 0.9, waited
        assert r.headers["retry-after"] == "1"
        assert assert_openai_error(r, 503)["code"] == "admission_closed"
        # One that can wait is held, not refused, and served once memory frees (checked below).
        patient = ThreadPoolExecutor(1).submit(
            completion, client, app, max_tokens=2, ttft_slo_ms=600_000)
        # The ceiling the controller raised is what apt chooses under: requests arriving at a full
        # pool now get compressed pages (issue 13: cache_ratio moves apt).
        with PressureLoad(num_requests=6, prompt_len=40, max_tokens=400):
            wait_until(lambda: any(sum(n for kind, n in r.pages_by_kind.items() if kind != "kv") > 0
                                   for r in replicas().values()), "apt takes compressed pages")
    # Pressure gone: admission opens again and the ratio steps back down to its base.
    wait_until(lambda: controller_state().admission_open, "admission reopens")
    assert patient.result(timeout=60).status_code == 200
    wait_until(lambda: all(r.cache_ratio == 0.0 for r in replicas().values()), "the hidden ratio falls back")
    assert completion(client, app, max_tokens=2).status_code == 200
    reasons = [d.reason for d in controller_state().decisions if d.time >= start]
    assert any("hidden target 0.00 -> 0.10" in r for r in reasons), reasons
    assert any("admission off" in r for r in reasons) and any("admission on" in r for r in reasons), reasons
    wait_until(all_pages_free, "every page is free again")


# Failures ---------------------------------------------------------------------------------------
def test_killed_engine_replica_is_replaced_and_its_requests_fail_cleanly(client, app, serve_url):
    import ray

    before = replicas()
    long_request = {"model": app, "prompt": [17] * 200, "max_tokens": 600, "ignore_eos": True, "stream": True}
    results: dict[int, list] = {}

    def stream(i: int, started: threading.Event, replica_ids: dict) -> None:
        with httpx.Client(base_url=serve_url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                         json=long_request) as r:
            replica_ids[i] = r.headers["x-replica-id"]
            lines = r.iter_lines()
            next(lines)
            started.set()
            results[i] = sse_payloads_from(lines)

    events, replica_ids = [threading.Event() for _ in range(4)], {}
    threads = [threading.Thread(target=stream, args=(i, events[i], replica_ids), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(30)
    victim = replica_ids[0]
    ray.kill(ray.get_actor(before[victim].actor_name, namespace="serve"), no_restart=True)
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a stream hung after its replica was killed"
    for i, payloads in results.items():
        assert payloads[-1] == "[DONE]"
        if replica_ids[i] == victim:
            assert "error" in payloads[-2] and payloads[-2]["error"]["code"] == "engine_failed"
        else:
            assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    # New requests succeed at once (on the survivor), and Serve brings the replica count back to two.
    for _ in range(3):
        assert completion(client, app, max_tokens=4).status_code == 200
    wait_until(lambda: len(r := replicas()) == 2 and victim not in r, "a new replica replaces the killed one",
               timeout=90, interval=0.5)
    served = {completion(client, app, max_tokens=4, seed=i).headers["x-replica-id"] for i in range(8)}
    assert served <= set(replicas())
