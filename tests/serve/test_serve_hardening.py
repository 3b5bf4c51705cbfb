"""The HTTP API against clients that are not friendly: API keys (bearer auth), bodies too large, too
deep, not UTF-8, values out of every range, and property-based fuzzing from the server's own OpenAPI
schema (schemathesis). The promise: every answer is a 2xx or a 4xx with an OpenAI error body, never a
5xx, and the server keeps serving.

One small app for the module: one engine replica of opt-tiny with a short context (so that fuzzed
``max_tokens`` stay cheap), two API keys and a 64 KiB body limit.
"""

from __future__ import annotations

import json

import httpx
import pytest
from serve_helpers import assert_openai_error, sse_payloads, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP = "apt-hardening"
KEYS = ["sk-first-key", "sk-second-key"]
AUTH = {"Authorization": f"Bearer {KEYS[1]}"}
MAX_MODEL_LEN = 128
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def app(serve_url, opt_tiny):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({
        "model": opt_tiny, "num_replicas": 1, "num_pages": 64, "max_model_len": MAX_MODEL_LEN, "num_threads": 1,
        "max_num_seqs": 8, "num_cpus_per_replica": 0.5, "control_interval_s": 0.2, "routing_stats_period_s": 0.5,
        "api_keys": KEYS, "max_request_body_bytes": BODY_LIMIT,
    }), name=APP, route_prefix="/")
    yield opt_tiny
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(app, serve_url):
    with httpx.Client(base_url=serve_url, timeout=60, headers=AUTH) as c:
        wait_until(lambda: c.get("/v1/models").status_code == 200, "the app answers", timeout=60)
        yield c


def post(client, path: str, content: bytes, **headers) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json", **headers})


# API keys -----------------------------------------------------------------------------------------
def test_every_route_but_health_needs_a_valid_key(client, app, serve_url):
    body = {"model": app, "prompt": "Hello", "max_tokens": 3}
    with httpx.Client(base_url=serve_url, timeout=60) as anonymous:
        assert anonymous.get("/health").status_code == 200  # probes need no secret
        for method, path, key in [("POST", "/v1/completions", None), ("POST", "/v1/completions", "sk-wrong"),
                                  ("POST", "/v1/chat/completions", "sk-first-ke"), ("GET", "/v1/models", None),
                                  ("GET", "/openapi.json", None), ("GET", "/v1/debug/memory_timeline", "x"),
                                  ("GET", "/no/such/route", None)]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            r = anonymous.request(method, path, json=body if method == "POST" else None, headers=headers)
            error = assert_openai_error(r, 401)
            assert error["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", (path, key)
            assert (key or "sk-") not in r.text
        # Either configured key opens every route; the scheme's case does not matter.
        for key in KEYS:
            r = anonymous.post("/v1/completions", json=body, headers={"Authorization": f"bearer {key}"})
            assert r.status_code == 200, r.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and sse_payloads(r)[-1] == "[DONE]"


def test_openai_client_sends_the_key_as_a_bearer_token(serve_url, app):
    import openai

    good = openai.OpenAI(base_url=serve_url + "/v1", api_key=KEYS[0], max_retries=0)
    assert [m.id for m in good.models.list()] == [app]
    done = good.completions.create(model=app, prompt="Once", max_tokens=4, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 4
    bad = openai.OpenAI(base_url=serve_url + "/v1", api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=app, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"


def test_keys_are_never_shown(app):
    from deployments.app import AppArgs
    from deployments.auth import resolve_keys

    args = AppArgs.model_validate({"model": app, "api_keys": KEYS})
    assert not any(key in repr(args) or key in str(args.model_dump()) for key in KEYS)
    # The variable is read when the argument is not given; an explicit [] turns auth off.
    env = {"APT_SERVE_API_KEYS": "sk-a, sk-b"}
    assert [k.get_secret_value() for k in resolve_keys(None, env)] == ["sk-a", "sk-b"]
    assert [k.get_secret_value() for k in resolve_keys(["sk-c"], env)] == ["sk-c"]
    assert resolve_keys([], env) == () and resolve_keys(None, {}) == ()


# Hand-made hostile input --------------------------------------------------------------------------
def hostile_bodies(model: str) -> list[tuple[str, str, bytes, int, str | None]]:
    ok = {"model": model, "prompt": "x"}

    def with_(**fields) -> bytes:
        return json.dumps({**ok, **fields}).encode()

    # 900 deep: within what the JSON parser takes, so the request model and the checks meet it.
    deep = b'{"model": "%s", "prompt": "x", "logit_bias": ' % model.encode() + b'{"a": ' * 900 + b"1" \
        + b"}" * 900 + b"}"
    return [
        ("deep nesting", "/v1/completions", b"[" * 200_000 + b"]" * 200_000, 400, None),
        ("deep nesting in a free-form field", "/v1/completions", deep, 400, "logit_bias"),
        ("deep nesting under the limit", "/v1/chat/completions", b'{"messages": ' + b"[" * 30_000 + b"]" * 30_000
         + b"}", 400, None),
        ("invalid UTF-8", "/v1/completions", b'{"model": "m", "prompt": "\xff\xfe\xfa"}', 400, None),
        ("a lone surrogate", "/v1/completions", with_(prompt="\ud800"), 400, None),
        ("an integer of 5,000 digits", "/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": '
         + b"9" * 5000 + b"}", 400, None),
        ("max_tokens over int64", "/v1/completions", with_(max_tokens=2**70), 400, "max_tokens"),
        ("huge max_tokens", "/v1/completions", with_(max_tokens=10**12), 400, "max_tokens"),
        ("huge n", "/v1/completions", with_(n=10**9), 400, "n"),
        ("huge logprobs", "/v1/completions", with_(logprobs=10**9), 400, "logprobs"),
        ("huge priority", "/v1/completions", with_(priority=2**64), 400, "priority"),
        ("huge seed", "/v1/completions", with_(seed=-2**64), 400, "seed"),
        ("token id over int64", "/v1/completions", with_(prompt=[2**64]), 400, "prompt"),
        ("negative token id", "/v1/completions", with_(prompt=[-1]), 400, "prompt"),
        ("prompt longer than the model", "/v1/completions", with_(prompt=[5] * (MAX_MODEL_LEN + 10)), 400, "prompt"),
        ("chat longer than the model", "/v1/chat/completions", json.dumps({"model": model, "messages": [
            {"role": "user", "content": "hello " * MAX_MODEL_LEN}]}).encode(), 400, "messages"),
        ("wrong types", "/v1/chat/completions", json.dumps({"model": 5, "messages": "hi", "stream": 1}).encode(),
         400, None),
        ("null body", "/v1/completions", b"null", 400, None),
        ("empty body", "/v1/completions", b"", 400, None),
    ]


def test_hostile_bodies_get_400_naming_the_field(client, app):
    for name, path, body, status, param in hostile_bodies(app):
        assert len(body) <= BODY_LIMIT or name == "deep nesting", name
        r = post(client, path, body)
        if name == "deep nesting":  # over the limit: refused before it is parsed
            assert_openai_error(r, 413)
            continue
        error = assert_openai_error(r, status)
        if param is not None:
            assert error["param"] == param, (name, error)
    assert client.post("/v1/completions", json={"model": app, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_bodies_over_the_limit_get_413_with_or_without_a_length(client, app):
    big = json.dumps({"model": app, "prompt": "x" * (BODY_LIMIT + 1)}).encode()
    r = post(client, "/v1/completions", big)
    assert assert_openai_error(r, 413)["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is checked while the body is read
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert assert_openai_error(r, 413)["code"] == "request_too_large"
    assert client.post("/v1/completions", json={"model": app, "prompt": "x", "max_tokens": 2}).status_code == 200


# Schema-driven fuzzing ----------------------------------------------------------------------------
FUZZ_EXAMPLES = {"POST /v1/completions": 100, "POST /v1/chat/completions": 100, "GET /v1/models": 5,
                 "GET /health": 5, "GET /v1/debug/memory_timeline": 10,
                 "POST /v1/load_lora_adapter": 20, "POST /v1/unload_lora_adapter": 20}  # 404 here: off in this app


def test_fuzzing_from_the_openapi_schema_finds_no_server_error(client, app, serve_url):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    operations = {f"{op.method.upper()} {op.path}": op for op in (r.ok() for r in schema.get_all_operations())}
    assert set(operations) == set(FUZZ_EXAMPLES), sorted(operations)
    seen: dict[int, int] = {}

    def named_model(case, use_ours: bool):
        """Half the generated bodies name the served model, so they get past the model check."""
        if use_ours and isinstance(case.body, dict):
            case.body["model"] = app
        return case

    for name, operation in operations.items():
        cases = st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode))

        @settings(max_examples=FUZZ_EXAMPLES[name], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=cases, use_ours=st.booleans())
        def fuzz(case, use_ours):
            response = named_model(case, use_ours).call(base_url=serve_url, headers=AUTH, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (name, case.body, case.query, response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, (name, response.text[:300])

        fuzz()
    print("fuzz statuses:", seen)
    assert any(200 <= s < 300 for s in seen) and any(400 <= s < 500 for s in seen), seen
    assert client.post("/v1/completions", json={"model": app, "prompt": "x", "max_tokens": 2}).status_code == 200
