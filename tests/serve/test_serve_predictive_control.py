"""Per-replica control end to end through Ray Serve, with prediction on: two replicas of a tiny MHA
model; one is filled past the heavy watermark by requests pinned to it, the other stays idle. Only the
full one's ratio rises and it is marked pressured, new requests go to the other, the cluster (half
full) keeps admitting, and the forecast is published in ``/health`` and as a metric."""

from __future__ import annotations

import time

import httpx
import pytest
from serve_helpers import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

APP, PREFIX = "apt-predictive", "/predictive"


@pytest.fixture(scope="module")
def app(serve_url, opt_tiny):
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app({
        "model": opt_tiny, "num_replicas": 2, "num_pages": 96, "num_threads": 1, "max_num_seqs": 16,
        "num_cpus_per_replica": 0.5, "light_watermark": 0.55, "heavy_watermark": 0.8, "max_hidden_ratio": 0.5,
        "control_interval_s": 0.1, "routing_stats_period_s": 0.2, "health_check_period_s": 1,
        "predictive_control": True, "forecast_horizon_s": 5, "mirror_metrics": True,
        "swap_space": 0,  # the full replica stays full: its preempted requests' pages do not leave the pool
    }), name=APP, route_prefix=PREFIX)
    wait_until(lambda: len(state().replicas) == 2, "both engine replicas report")
    yield opt_tiny
    serve.delete(APP)


def state():
    from ray import serve

    return serve.get_deployment_handle("Controller", APP).get_state.remote().result()


def test_only_the_pressured_replica_is_acted_on_and_new_requests_go_around_it(app, serve_url):
    from ray import serve

    from apt_serve_ray import SamplingParams
    from deployments.wire import EngineRequest

    full, idle = sorted(state().replicas)
    engine = serve.get_deployment_handle("EngineReplica", APP).options(stream=True)
    start = time.time()
    streams = [engine.generate.remote(EngineRequest([13 + i] * 300, SamplingParams(max_tokens=1000, ignore_eos=True),
                                                    f"fill-{i}-{start}"), replica_id=full) for i in range(4)]
    try:
        wait_until(lambda: (s := state()).knobs[full].is_pressured and s.replicas[full].is_pressured,
                   "the full replica is marked pressured and says so in its load report")
        s = state()
        assert s.knobs[full].cache_ratio > 0.0  # its own rule raised its ratio
        assert s.knobs[idle].cache_ratio == 0.0 and not s.knobs[idle].is_pressured
        assert s.admission_open and s.usage < 0.55  # the cluster reads half full: no cluster-wide action
        time.sleep(1.0)  # the request router's next stats poll
        with httpx.Client(base_url=serve_url + PREFIX, timeout=60) as client:
            served_by = [client.post("/v1/completions", json={"model": app, "prompt": "Hello there", "max_tokens": 4,
                                                              "ignore_eos": True}).headers["x-replica-id"]
                         for _ in range(5)]
            # The routers count arrivals and send them with their next poll; the forecast reads whole seconds.
            wait_until(lambda: client.get("/health").json()["forecast"]["recent_arrival_rate"] > 0,
                       "the forecast has seen the arrivals", timeout=10)
            wait_until(lambda: client.get("/health").json()["pressured_replicas"] == [full],
                       "the router's health shows the pressured replica", timeout=10)
        assert served_by == [idle] * 5
        decisions = [d for d in state().decisions if d.time >= start and d.replica_id == full]
        assert any("pressure_replica" in d.actions and d.forecast is not None for d in decisions), decisions
        assert not any(d.replica_id == idle for d in state().decisions if d.time >= start)
        controller = serve.get_deployment_handle("Controller", APP)
        metrics = controller.metrics_snapshot.remote().result()
        assert {m["tags"]["bound"] for m in metrics["apt_serve_forecast_arrival_rate"]} == {"point", "low", "high"}
        # The full replica's pressure comes and goes as its requests are preempted and resumed: poll.
        wait_until(lambda: {m["tags"]["replica"]: m["value"] for m in controller.metrics_snapshot.remote().result()
                            ["apt_serve_replica_pressured"]} == {full: 1, idle: 0},
                   "the pressure metric marks the full replica", timeout=15)
    finally:
        for stream in streams:
            stream.cancel()
    wait_until(lambda: not state().knobs[full].is_pressured, "the full replica is released once it empties")
