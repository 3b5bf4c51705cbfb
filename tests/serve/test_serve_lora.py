"""LoRA adapters through the server (issue 43, item 3): a request's ``model`` names an adapter, /v1/models
lists each with its parent, and an adapter's output through HTTP is the engine's offline output."""

from __future__ import annotations

import httpx
import pytest

from apt_serve_ray import LLM, SamplingParams
from tests.serve.serve_helpers import assert_openai_error

APP = "apt-lora-test"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lora_app(serve_url, opt_tiny, tmp_path_factory):
    from ray import serve

    from deployments.app import build_app
    from tests.models.test_lora import _peft

    root = tmp_path_factory.mktemp("adapters")
    _peft(opt_tiny, str(root / "sql"), ["q_proj", "v_proj"], r=8, alpha=16, seed=1)
    _peft(opt_tiny, str(root / "late"), ["q_proj", "v_proj", "fc1"], r=4, alpha=8, seed=3)
    serve.run(build_app({
        "model": opt_tiny, "served_model_name": "opt-tiny", "dtype": "float32", "num_replicas": 2, "num_pages": 64,
        "num_threads": 1, "num_cpus_per_replica": 0.5, "lora_modules": [f"sql={root / 'sql'}"], "max_loras": 2,
        "max_lora_rank": 8, "allow_runtime_lora_updating": True, "control_interval_s": 0.1,
    }), name=APP, route_prefix="/lora")
    yield opt_tiny, str(root / "sql"), str(root / "late")
    serve.delete(APP)


def test_a_request_names_its_adapter_as_its_model(lora_app, serve_url):
    base, adapter, _ = lora_app
    with httpx.Client(base_url=serve_url + "/lora", timeout=60) as client:
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in models] == [("opt-tiny", None), ("sql", "opt-tiny")]
        assert models[1]["root"] == adapter
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        texts = {}
        for model in ("opt-tiny", "sql"):
            response = client.post("/v1/completions", json={"model": model, **body})
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
            texts[model] = response.json()["choices"][0]["text"]
        assert_openai_error(client.post("/v1/completions", json={"model": "nope", **body}), 404)
    llm = LLM(base, dtype="float32", num_pages=64, lora_modules=(f"sql={adapter}",), max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    offline = llm.generate([PROMPT, PROMPT], sp, lora_name=[None, "sql"])
    assert texts == {"opt-tiny": offline[0].outputs[0].text, "sql": offline[1].outputs[0].text}
    assert texts["opt-tiny"] != texts["sql"]


def test_adapters_load_and_unload_at_run_time_as_vllms_endpoints_do(lora_app, serve_url):
    base, _, late = lora_app
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=serve_url + "/lora", timeout=60) as client:
        assert_openai_error(client.post("/v1/completions", json={"model": "late", **body}), 404)
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": late})
        assert loaded.status_code == 200 and "added successfully" in loaded.text
        assert_openai_error(client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": late}), 400)
        assert_openai_error(client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nope"}), 400)
        assert_openai_error(client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
        assert "late" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        # Whichever replica serves it loads it on its first request for it; the offline engine's output.
        texts = set()
        for _ in range(4):
            response = client.post("/v1/completions", json={"model": "late", **body})
            assert response.status_code == 200, response.text
            texts.add(response.json()["choices"][0]["text"])
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert unloaded.status_code == 200, unloaded.text
        assert_openai_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "late"}), 404)
        assert_openai_error(client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 400)  # from start
        assert_openai_error(client.post("/v1/completions", json={"model": "late", **body}), 404)
    llm = LLM(base, dtype="float32", num_pages=64, lora_modules=(f"late={late}",), max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert texts == {llm.generate([PROMPT], sp, lora_name="late")[0].outputs[0].text}


def test_more_adapters_than_slots_are_served_at_once(lora_app, serve_url):
    """Three adapters over two slots a replica, requests of all of them at once: each replica loads what
    its requests name into a slot no request holds, or holds a request until one is, and every answer is
    the offline engine's."""
    import concurrent.futures

    base, sql, late = lora_app
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=serve_url + "/lora", timeout=120) as client:
        for name in ("late2", "late3"):
            loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": late})
            assert loaded.status_code == 200, loaded.text
        names = ["sql", "late2", "late3"] * 3

        def post(name):
            return client.post("/v1/completions", json={"model": name, **body})

        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            responses = list(pool.map(post, names))
        for name in ("late2", "late3"):
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    llm = LLM(base, dtype="float32", num_pages=64, lora_modules=(f"sql={sql}", f"late={late}"), max_lora_rank=8)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {"sql": llm.generate([PROMPT], sp, lora_name="sql")[0].outputs[0].text,
            "late": llm.generate([PROMPT], sp, lora_name="late")[0].outputs[0].text}
    assert [r.json()["choices"][0]["text"] for r in responses] == [want["sql" if n == "sql" else "late"] for n in names]
