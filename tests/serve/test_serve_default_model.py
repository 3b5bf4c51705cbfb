"""End to end with the real default model: the application of serve_config.yaml answers a chat request
with real text (over HTTP, as `serve run serve_config.yaml` would)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_app(serve_url):
    from ray import serve

    from deployments.app import build_app

    (app,) = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"]
    # The test session's Ray has 2 CPUs and may still hold other apps' replicas: ask for less; and
    # one compute thread, since the other test worker keeps a core busy (two OpenMP threads on one
    # free core waited for each other at every barrier: the start-up took 130 s instead of 30).
    args = {**app["args"], "num_cpus_per_replica": 0.5, "num_threads": 1}
    serve.run(build_app(args), name="apt-default", route_prefix="/default")
    yield app["args"]["model"], serve_url + "/default"
    serve.delete("apt-default")


def test_the_default_model_answers_a_chat_request_with_real_text(default_app):
    model, base_url = default_app
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": model, "temperature": 0, "max_tokens": 40,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]})
    assert r.status_code == 200, r.text
    body = r.json()
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer
    assert body["choices"][0]["finish_reason"] == "stop"
    # The same request streamed gives the same text (greedy), token by token.
    import json

    request = {"model": model, "temperature": 0, "max_tokens": 40, "stream": True,
               "messages": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=request, timeout=120) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == answer
