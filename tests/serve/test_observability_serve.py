"""Observability of the Ray Serve app: metrics read back after a scripted run, one trace across the
router -> engine handle call, the memory timeline over HTTP, and the Grafana dashboard.

One small app for the module (one engine replica of a tiny model, one request in flight at a time,
no waiting line, so a second concurrent request is refused), with metrics mirrored in memory and
spans kept by an in-memory exporter in every process.
"""

from __future__ import annotations

import json
import pathlib
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_helpers import assert_openai_error, load_report, wait_until

APP = "apt-obs"
PREFIX = "/obs"
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def app(serve_url, opt_tiny):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({
        "model": opt_tiny, "num_replicas": 1, "num_pages": 64, "num_threads": 1, "max_num_seqs": 4,
        "num_cpus_per_replica": 0.5, "max_in_flight_per_replica": 1, "max_queued_requests": 0,
        "control_interval_s": 0.1, "routing_stats_period_s": 0.5, "health_check_period_s": 1,
        "mirror_metrics": True, "tracing_exporter": "memory",
    }), name=APP, route_prefix=PREFIX)
    wait_until(lambda: len(call("Controller", "get_state").replicas) == 1, "the engine replica reports")
    yield opt_tiny
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(app, serve_url):
    with httpx.Client(base_url=serve_url + PREFIX, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def scripted_run(client, app):
    """Three completions one after another, one for a model that is not served, then four at once:
    the one in-flight slot takes the first and the rest are refused (no waiting line)."""
    ok = [completion(client, app, max_tokens=4) for _ in range(3)]
    assert all(r.status_code == 200 for r in ok), [r.text for r in ok]
    assert completion(client, "no-such-model", max_tokens=4).status_code == 404
    with ThreadPoolExecutor(4) as pool:
        burst = [r.status_code for r in pool.map(lambda _: completion(client, app, max_tokens=300), range(4))]
    assert sorted(set(burst)) == [200, 429] and burst.count(200) >= 1, burst
    num_finished = 3 + burst.count(200)
    wait_until(lambda: outcomes(call("EngineReplica", "metrics_snapshot")).get("length") == num_finished,
               "the engine counts every finished request")
    return {"request_ids": [r.json()["id"] for r in ok], "num_finished": num_finished,
            "num_rejected": burst.count(429)}


# Helpers ----------------------------------------------------------------------------------------
def call(deployment: str, method: str, *args):
    from ray import serve

    return getattr(serve.get_deployment_handle(deployment, APP), method).remote(*args).result()


def completion(client, model, **fields) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": "The quick brown fox", "temperature": 0,
                                                "ignore_eos": True, **fields})


def outcomes(snapshot: dict) -> dict:
    """Requests by outcome, summed over the other tags (service class, ...)."""
    counts: dict = {}
    for s in snapshot.get("apt_serve_requests_total", []):
        counts[s["tags"]["outcome"]] = counts.get(s["tags"]["outcome"], 0) + s["value"]
    return counts


def values(snapshot: dict, name: str) -> list:
    return [v for s in snapshot.get(name, []) for v in (s["value"] if isinstance(s["value"], list) else [s["value"]])]


# Metrics ----------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_requests_are_counted_by_outcome_where_they_end(scripted_run, app):
    router = call("Router", "metrics_snapshot")
    engine = call("EngineReplica", "metrics_snapshot")
    # The router counts what never reaches the engine; the engine counts what it finishes.
    assert outcomes(router) == {"invalid": 1, "rejected": scripted_run["num_rejected"]}
    assert outcomes(engine) == {"length": scripted_run["num_finished"]}
    assert all(s["tags"]["model"] == app for s in router["apt_serve_requests_total"] + engine["apt_serve_requests_total"])
    assert len(values(engine, "apt_serve_engine_ttft_seconds")) == scripted_run["num_finished"]
    assert len(values(engine, "apt_serve_inter_token_gap_seconds")) >= 3 * scripted_run["num_finished"]
    assert sum(values(engine, "apt_serve_slo_total")) == scripted_run["num_finished"]
    kinds = {s["tags"]["kind"] for s in engine["apt_serve_cache_pages"]}
    assert kinds == {"kv", "hidden", "kv-int8", "hidden-int8", "free"}
    # The scripted requests name no service class: they are the default class's, on both sides.
    assert {s["tags"]["service_class"] for s in engine["apt_serve_slo_total"]} == {"default"}
    assert {s["tags"]["service_class"] for s in router["apt_serve_ttft_seconds"]} == {"default"}


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ttft_is_split_into_serve_path_and_engine(scripted_run):
    router = call("Router", "metrics_snapshot")
    ttft = values(router, "apt_serve_ttft_seconds")
    serve_path = values(router, "apt_serve_serve_path_ttft_seconds")
    engine_ttft = values(call("EngineReplica", "metrics_snapshot"), "apt_serve_engine_ttft_seconds")
    assert len(ttft) == len(serve_path) == len(engine_ttft) == scripted_run["num_finished"]
    assert all(0 <= p <= t for p, t in zip(serve_path, ttft))
    assert sum(serve_path) < sum(ttft)  # the engine's part was taken out
    assert max(ttft) >= min(engine_ttft)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_controller_exports_its_state(scripted_run):
    controller = call("Controller", "metrics_snapshot")
    assert values(controller, "apt_serve_engine_replicas_reporting") == [1]
    states = {s["tags"]["state"]: s["value"] for s in controller["apt_serve_watermark_state"]}
    assert states == {"below_light": 1, "between": 0, "above_heavy": 0}
    assert values(controller, "apt_serve_admission_open") == [1]


def test_controller_counts_its_actions():
    """The decision loop on its own: pressure above both watermarks, then relief. The cluster's knobs
    and the one replica's each count their own actions."""
    import time

    from deployments.cluster_control import ClusterControl, ControlSettings
    from deployments.controller import Controller
    from deployments.metrics import ControllerMetrics, make_backend, snapshot

    controller = Controller.func_or_class.__new__(Controller.func_or_class)
    controller.control = ClusterControl(ControlSettings(0.5, 0.8, 0.5, 0.25, stale_after_s=60.0))
    controller.decisions = []
    controller._backend = make_backend({"model": "m"}, mirror=True)
    controller.metrics = ControllerMetrics(controller._backend)
    for used in (90, 10):
        controller.control.report(load_report(replica_id="r", num_pages=100, num_free_pages=100 - used),
                                  time.monotonic())
        controller.step()
    actions = {s["tags"]["action"]: s["value"] for s in snapshot(controller._backend)["apt_serve_controller_actions_total"]}
    assert actions == {"raise_hidden_target": 2, "close_admission": 1, "pressure_replica": 1,
                       "lower_hidden_target": 2, "open_admission": 1, "unpressure_replica": 1}
    pressured = snapshot(controller._backend)["apt_serve_replica_pressured"]
    assert pressured == [{"tags": {"model": "m", "replica": "r"}, "value": 0}]


# Traces -----------------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_one_trace_per_request_across_the_handle_call(scripted_run):
    def by_request(spans, name):  # Serve's own spans land in the same exporter
        return {s["attributes"]["request.id"]: s for s in spans if s["name"] == name}

    router_spans = by_request(call("Router", "finished_spans"), "router.request")
    engine_spans = by_request(call("EngineReplica", "finished_spans"), "engine.request")
    for request_id in scripted_run["request_ids"]:
        parent, child = router_spans[request_id], engine_spans[request_id]
        assert child["trace_id"] == parent["trace_id"] and child["parent_span_id"] == parent["span_id"]
        assert parent["attributes"]["request.outcome"] == "length"
        assert child["events"][0] == "queued" and child["events"][-1] == "finished"
        assert {"scheduled", "first_token"} <= set(child["events"])
        assert parent["events"] == ["admitted", "first_token"]


# Service classes --------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_request_gets_its_service_classs_slos_by_header_or_body_field(client, app, scripted_run):
    def engine_span(response):
        assert response.status_code == 200, response.text
        request_id = response.json()["id"]
        spans = wait_until(lambda: [s for s in call("EngineReplica", "finished_spans")
                                    if s["name"] == "engine.request" and s["attributes"]["request.id"] == request_id],
                           "the engine's span for the request ends")
        return spans[0]["attributes"]

    def slo_count(service_class) -> float:
        return sum(s["value"] for s in call("EngineReplica", "metrics_snapshot").get("apt_serve_slo_total", [])
                   if s["tags"]["service_class"] == service_class)

    batch = engine_span(client.post("/v1/completions", headers={"x-service-class": "batch"}, json={
        "model": app, "prompt": "The quick brown fox", "max_tokens": 3, "ignore_eos": True}))
    assert (batch["request.service_class"], batch["request.priority"], batch["slo.ttft_ms"], batch["slo.tbt_ms"]) == (
        "batch", 10, 30_000, 1_000)
    # The body's field chooses too, and the request's own ttft_slo_ms overrides its class's.
    interactive = engine_span(completion(client, app, max_tokens=3, service_class="interactive", ttft_slo_ms=5_000))
    assert (interactive["request.service_class"], interactive["request.priority"], interactive["slo.ttft_ms"],
            interactive["slo.tbt_ms"]) == ("interactive", 0, 5_000, 100)
    wait_until(lambda: slo_count("interactive") == 1, "the engine counts the interactive request under its class")
    router_classes = {s["tags"]["service_class"] for s in call("Router", "metrics_snapshot")["apt_serve_ttft_seconds"]}
    assert router_classes == {"batch", "default", "interactive"}  # earlier requests name no class

    unknown = client.post("/v1/completions", headers={"x-service-class": "gold"},
                          json={"model": app, "prompt": "x", "max_tokens": 1})
    error = assert_openai_error(unknown, 400)
    assert error["param"] == "x-service-class" and "['batch', 'default', 'interactive']" in error["message"]


# Memory timeline --------------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_memory_timeline_over_http(client, scripted_run):
    replica = next(iter(call("Controller", "get_state").replicas))
    png = client.get("/v1/debug/memory_timeline", params={"replica": replica})
    assert png.status_code == 200 and png.headers["content-type"] == "image/png"
    assert png.content[:8] == b"\x89PNG\r\n\x1a\n" and len(png.content) > 5_000
    data = client.get("/v1/debug/memory_timeline", params={"format": "json"}).json()
    assert data["replica_id"] == replica and data["series"]["t"]
    assert max(data["series"]["kv"]) > 0 and all(k in data["series"] for k in ("hidden", "free", "cache_ratio"))
    assert client.get("/v1/debug/memory_timeline", params={"replica": "nope"}).status_code == 404


# Dashboard --------------------------------------------------------------------------------------
def defined_metric_names() -> set[str]:
    names = set()
    for path in ("apt_serve_ray/observability/metrics.py", "deployments/metrics.py"):
        names |= set(re.findall(r'"(apt_serve_[a-z0-9_]+)"', (ROOT / path).read_text()))
    return names


def test_grafana_dashboard_queries_only_metrics_we_define():
    dashboard = json.loads((ROOT / "k8s/grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs and dashboard["title"]
    queried = {re.sub(r"_(bucket|sum|count)$", "", m)
               for e in exprs for m in re.findall(r"ray_(apt_serve_[a-z0-9_]+)", e)}
    defined = defined_metric_names()
    assert queried and queried <= defined, sorted(queried - defined)
    for needed in ("apt_serve_requests_waiting", "apt_serve_ttft_seconds", "apt_serve_slo_total",
                   "apt_serve_cache_pages", "apt_serve_hidden_target_ratio", "apt_serve_controller_actions_total"):
        assert needed in queried
    assert any("histogram_quantile" in e for e in exprs)
    # Per service class: attainment, TTFT and queue time.
    by_class = {m for e in exprs if "by (service_class" in e or "by (le, service_class" in e
                for m in re.findall(r"ray_(apt_serve_[a-z0-9_]+?)(?:_bucket)?\{", e)}
    assert {"apt_serve_slo_total", "apt_serve_ttft_seconds", "apt_serve_queue_time_seconds"} <= by_class
    assert "grafana_dashboard.json" in (ROOT / "k8s/README.md").read_text()
