"""The fleet simulator runs the server's own engines, router, admission and controller on one clock."""

import dataclasses

import pytest

from apt_serve_ray.bench.simulator import CostModel, SimulatedEngine
from apt_serve_ray.bench.slo_metrics import attainment
from apt_serve_ray.bench.rate_shapes import OnOff, make_shaped_trace
from apt_serve_ray.bench.workloads import make_trace
from apt_serve_ray.config import EngineConfig
from deployments import fleet as fleet_module
from deployments.autoscaling import AutoscalingOptions
from deployments.cluster_control import ControlSettings
from deployments.fleet import FleetSettings, FleetSimulator
from deployments.fleet_scaling import RayAutoscaler
from deployments.request_router import FitAwareRequestRouter

COST = CostModel(base_s=0.02, per_token_s=0.0001, per_context_s=1e-6)
CONTROL = ControlSettings(light=0.7, heavy=0.95, max_ratio=0.5, ratio_step=0.1)


def make_engine(policy: str = "fcfs", num_pages: int = 200):
    config = EngineConfig(policy=policy, calibrate_rho=False, enable_watermarks=False, max_num_seqs=32)
    return lambda: SimulatedEngine(config, num_pages=num_pages, cost=COST, max_model_len=1024)


def trace(n: int, rate: float, seed: int = 0, max_model_len: int = 1024):
    reqs = make_trace("sharegpt", n, rate, seed=seed, max_model_len=max_model_len, max_output_len=64)
    return [dataclasses.replace(r, ttft_slo_ms=2000, tbt_slo_ms=500) for r in reqs]


def test_every_request_finishes_and_the_fleet_spreads_them():
    sim = FleetSimulator(make_engine(), FleetSettings(num_replicas=4), CONTROL)
    res = sim.run(trace(120, 20.0))
    assert len(res.timelines) == 120 and all(t.error is None and t.is_finished for t in res.timelines)
    received = [r.num_received for r in sim.replicas.values()]
    assert sum(received) == 120 and min(received) >= 15  # the fit-aware choice balances the load
    assert len(res.router_s) == 120 and all(s > 0 for s in res.router_s)
    for r in sim.replicas.values():  # every page back
        assert r.sim.cache.pool.num_free_pages == r.sim.cache.pool.num_pages


def test_the_decisions_are_the_servers_own_code():
    sim = FleetSimulator(make_engine(), FleetSettings(num_replicas=2), CONTROL)
    assert type(sim.router) is FitAwareRequestRouter
    assert sim.router.prefixes is not FleetSimulator(make_engine(), FleetSettings(), CONTROL).router.prefixes
    assert fleet_module.ClusterControl is __import__("deployments.cluster_control").cluster_control.ClusterControl
    assert fleet_module.AdmissionQueue is __import__("deployments.admission").admission.AdmissionQueue


def test_more_replicas_serve_more_within_slo():
    one = FleetSimulator(make_engine(), FleetSettings(num_replicas=1), CONTROL).run(trace(150, 12.0))
    four = FleetSimulator(make_engine(), FleetSettings(num_replicas=4), CONTROL).run(trace(150, 12.0))
    assert attainment(four.timelines) > attainment(one.timelines) + 0.2
    assert four.replica_seconds == pytest.approx(4 * four.duration_s, rel=1e-6)


def test_a_failed_replica_ends_its_requests_with_an_error_and_is_replaced():
    settings = FleetSettings(num_replicas=2, failures=((1.0, 0),), startup_s=2.0)
    sim = FleetSimulator(make_engine(), settings, CONTROL)
    res = sim.run(trace(80, 20.0))
    errors = [t for t in res.timelines if t.error]
    assert errors and all(t.error == "replica died" for t in errors)
    assert len(res.timelines) == 80 and all(t.error or t.is_finished for t in res.timelines)
    # (time, held, serving): at 1 s one dies and another starts; it serves from 3 s.
    assert [x for x in res.replicas if x[0] > 0][:2] == [(1.0, 2, 1), (3.0, 2, 2)]
    assert len(sim.replicas) == 2


def test_a_full_cluster_holds_requests_at_the_router_and_releases_them():
    """Pages for few requests: the controller closes admission over heavy, the routers' line holds the
    rest, and every request still ends (none lost)."""
    sim = FleetSimulator(make_engine(num_pages=40), FleetSettings(num_replicas=1), CONTROL)
    held = []
    original = sim._on_control

    def spy(period):
        original(period)
        held.append(sim.admission.held)

    sim._on_control = spy
    res = sim.run(trace(60, 30.0, max_model_len=512))
    assert any(held)
    assert sum(t.is_finished for t in res.timelines) == 60


def test_a_request_the_engine_refuses_ends_with_an_error_and_frees_its_slot():
    sim = FleetSimulator(make_engine(num_pages=20), FleetSettings(num_replicas=1), CONTROL)  # 320-token context
    res = sim.run(trace(30, 10.0))
    refused = [t for t in res.timelines if t.error]
    assert refused and all(t.error.startswith("invalid: prompt") for t in refused)
    assert sum(t.is_finished for t in res.timelines) == 30 - len(refused)
    assert sim.admission.num_in_flight == 0


def test_autoscaling_starts_replicas_after_their_startup_delay():
    shape = OnOff(low=2.0, high=20.0, period_s=60.0, duty=0.5)
    reqs = [dataclasses.replace(r, ttft_slo_ms=2000, tbt_slo_ms=500)
            for r in make_shaped_trace("sharegpt", 600, shape, max_model_len=1024, max_output_len=64)]
    options = AutoscalingOptions(policy="default", min_replicas=1, max_replicas=6, target_ongoing_requests=4)
    scaler = RayAutoscaler(options, max_num_seqs=32)
    settings = FleetSettings(num_replicas=1, startup_s=5.0, max_replicas=6)
    res = FleetSimulator(make_engine(), settings, CONTROL, autoscaler=scaler).run(reqs)
    assert all(t.is_finished for t in res.timelines)
    assert max(n for _, n, _ in res.replicas) > 1  # it scaled up ...
    first_up = next(t for t, n, serving in res.replicas if serving > 1)
    asked = next(t for t, target in scaler.decisions if target > 1)
    assert first_up >= asked + 5.0 - 1e-6  # ... each replica serving startup_s after it was asked for
    assert res.replica_seconds < 6 * res.duration_s


def test_settings_name_the_bad_field():
    with pytest.raises(ValueError, match="num_replicas"):
        FleetSettings(num_replicas=0)
    with pytest.raises(ValueError, match="startup_s"):
        FleetSettings(startup_s=-1)
    with pytest.raises(ValueError, match="control_interval_s"):
        FleetSettings(control_interval_s=0)


def test_requests_arriving_while_no_replica_serves_wait_for_the_next():
    """One replica fails: its requests end with an error, and what arrives while its replacement
    starts waits for it (as at Serve's handle), then finishes."""
    settings = FleetSettings(num_replicas=1, failures=((1.0, 0),), startup_s=3.0)
    sim = FleetSimulator(make_engine(), settings, CONTROL)
    reqs = trace(60, 15.0)
    res = sim.run(reqs)
    late = [t for r, t in zip(reqs, res.timelines) if 1.0 < r.arrival_s < 4.0]
    assert late and all(t.is_finished and t.first_token_s >= 4.0 for t in late)
    assert all(t.error in (None, "replica died") for t in res.timelines)
    assert sim.admission.num_in_flight == 0


def test_replica_hours_count_replicas_from_when_they_are_asked_for():
    sim = FleetSimulator(make_engine(), FleetSettings(num_replicas=1, startup_s=10.0, max_replicas=4), CONTROL,
                         autoscaler=lambda fleet: 3 if fleet.clock.now < 5 else 1)
    res = sim.run(trace(40, 4.0))
    # Two more asked for at 1 s (the first autoscaling tick), drained before they ever served.
    assert (1.0, 3, 1) in res.replicas
    assert res.replica_seconds > res.duration_s + 2 * 3.0
