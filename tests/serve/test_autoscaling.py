"""The engine replicas' autoscaling policies without a cluster (``deployments/autoscaling.py``): the forecast
scaler asks for replicas before a forecast peak, holds them through the downscale delay, keeps to its
bounds; Ray's default policy and ours run on the same ``AutoscalingContext`` the way Ray's controller runs
them; the app's ``autoscaling`` argument builds the engine replicas' ``AutoscalingConfig``."""

from __future__ import annotations

import dataclasses
import math
import types

import pytest

from deployments.autoscaling import (FORECAST_POLICY, RECEIVED_METRIC, AutoscalingOptions, ForecastAutoscalingPolicy,
                                     ForecastScaler, ForecastScalingSettings, make_context, ray_controller,
                                     ray_default_policy)

# An on/off day in miniature: 1 req/s, then 10 req/s for the last 60 s of every 120 s; a request stays 4 s.
PERIOD_S, ON_S, LOW, HIGH, STAY_S = 120, 60, 1, 10, 4
TARGET = 4  # requests in flight per replica: the peak needs HIGH * STAY_S / TARGET = 10 replicas
PEAK_REPLICAS = math.ceil(HIGH * STAY_S / TARGET)
FAST = dict(target_ongoing_requests=TARGET, startup_s=20.0, lead_s=5.0, downscale_delay_s=20.0, refresh_s=5.0,
            history_s=300.0)


def rate(t: int) -> int:
    return HIGH if t % PERIOD_S >= PERIOD_S - ON_S else LOW


def ongoing(t: int) -> int:
    """In flight at ``t``: what arrived over the last STAY_S seconds (Little's law, exactly)."""
    return sum(rate(s) for s in range(max(0, t - STAY_S + 1), t + 1))


def test_the_scaler_asks_for_the_peaks_replicas_a_start_up_ahead_and_lets_them_go_in_the_trough():
    scaler, replicas, asked = ForecastScaler(ForecastScalingSettings(**FAST)), 1, {}
    for t in range(480):
        replicas = asked[t] = scaler.decide(float(t), rate(t), ongoing(t), replicas, 1, 20)
    peak_starts = 3 * PERIOD_S + PERIOD_S - ON_S  # 420, after three periods of history
    let_go = min(t for t in range(3 * PERIOD_S, peak_starts) if asked[t] < PEAK_REPLICAS)
    ready = min(t for t in range(let_go, peak_starts) if asked[t] >= PEAK_REPLICAS)
    assert let_go <= 3 * PERIOD_S + STAY_S + FAST["downscale_delay_s"] + FAST["refresh_s"]
    assert min(asked[t] for t in range(let_go, ready)) <= 2  # the last peak's replicas went in the trough
    assert ready <= peak_starts - FAST["startup_s"]  # asked for early enough to have started by then
    assert scaler.forecast.model.startswith("holt-winters") and ongoing(ready) == STAY_S * LOW  # not reactive
    assert min(asked[t] for t in range(ready, 480)) >= PEAK_REPLICAS


def test_replicas_are_held_until_the_need_has_stayed_lower_for_the_downscale_delay():
    """No arrivals are fed, so the forecast adds nothing: the need is what is in flight."""
    delay = FAST["downscale_delay_s"]
    scaler, replicas, asked = ForecastScaler(ForecastScalingSettings(**FAST)), 1, {}
    need = {t: 40 if t < 100 or t == 111 else 4 for t in range(200)}  # a dip at 100-110, a blip at 111
    for t in range(200):
        replicas = asked[t] = scaler.decide(float(t), 0, need[t], replicas, 1, 20)
    assert asked[0] == 10  # up at once
    assert all(asked[t] == 10 for t in range(111 + int(delay) + 1))  # the blip restarted the wait
    assert asked[111 + int(delay) + 1] == 1 and asked[199] == 1


def test_a_first_decision_does_not_scale_down_before_the_delay_has_been_watched():
    scaler = ForecastScaler(ForecastScalingSettings(**FAST))
    assert scaler.decide(0.0, 0, 0, 6, 1, 20) == 6  # e.g. a redeployed policy facing a fleet of 6
    assert scaler.decide(FAST["downscale_delay_s"] + 1, 0, 0, 6, 1, 20) == 1


def test_the_decision_stays_within_the_bounds():
    scaler = ForecastScaler(ForecastScalingSettings(**FAST))
    assert scaler.decide(0.0, 0, 1000, 1, 1, 5) == 5  # the need asks for 250
    assert scaler.decide(1.0, 0, 1000, 8, 1, 5) == 5  # max lowered under the fleet: at once
    assert scaler.decide(2.0, 0, 0, 1, 3, 5) == 3
    assert scaler.need == 0


@pytest.mark.parametrize("field, value", [
    ("target_ongoing_requests", 0), ("startup_s", -1.0), ("lead_s", float("nan")), ("downscale_delay_s", -5),
    ("little_window_s", 0), ("refresh_s", 0.0), ("history_s", float("inf")), ("season_s", 2.0),
    ("target_ongoing_requests", "2"),
])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ForecastScalingSettings(**{field: value})


def test_a_horizon_of_zero_is_refused():
    with pytest.raises(ValueError, match="lead_s"):
        ForecastScalingSettings(startup_s=0.0, lead_s=0.0)


@pytest.mark.parametrize("options, field", [
    ({}, "max_replicas"),
    ({"max_replicas": 2, "min_replicas": 3}, "max_replicas"),
    ({"max_replicas": 2, "policy": "magic"}, "policy"),
    ({"max_replicas": 2, "season_s": 400}, "season_s"),  # over half of history_s
    ({"max_replicas": 2, "startup_s": -1}, "startup_s"),
    ({"max_replicas": 2, "lead": 5}, "lead"),
])
def test_bad_autoscaling_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        AutoscalingOptions.model_validate(options)


def test_make_context_builds_rays_context_and_both_policies_decide_on_it():
    from ray.serve.config import AutoscalingContext

    config = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 16}
    ctx = make_context(now=1000.0, replicas=2, ongoing_requests=[40, 24], config=config, target_replicas=3,
                       requests_received={"replica-0": [(990.0, 5), (996.0, 11)], "replica-1": 7})
    assert isinstance(ctx, AutoscalingContext)
    assert (ctx.current_num_replicas, ctx.target_num_replicas, ctx.total_num_requests) == (2, 3, 64.0)
    assert (ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas) == (1, 8)
    assert ctx.current_time == 1000.0 and ctx.policy_state == {} and ctx.config.target_ongoing_requests == 16
    received = {r.unique_id: [(p.timestamp, p.value) for p in s] for r, s in ctx.raw_metrics[RECEIVED_METRIC].items()}
    assert received == {"replica-0": [(990.0, 5.0), (996.0, 11.0)], "replica-1": [(1000.0, 7.0)]}
    assert ray_default_policy(ctx) == (4.0, {})  # 64 in flight / 16 per replica
    replicas, state = ForecastAutoscalingPolicy(target_ongoing_requests=16)(ctx)
    assert replicas == 4 and state == {}
    with pytest.raises(ValueError, match="requests_received"):
        make_context(now=0.0, replicas=1, ongoing_requests=0, config=config, requests_received={"replica-9": 1})


def test_ray_runs_its_delays_on_the_contexts_clock_and_ours_scales_up_at_once():
    """Through Ray's own wrapper (its delays from the config, timed by ``ctx.current_time``) and bounds."""
    default = AutoscalingOptions(policy="default", max_replicas=8, target_ongoing_requests=16).autoscaling_config(32)
    forecast = AutoscalingOptions(max_replicas=8, target_ongoing_requests=16).autoscaling_config(32)
    assert default.upscale_delay_s == 30.0  # Ray's
    runs = {"default": (ray_controller(ray_default_policy), default),
            "forecast": (ray_controller(ForecastAutoscalingPolicy(**forecast.policy.policy_kwargs)), forecast)}
    first_up = {}
    for name, (policy, config) in runs.items():
        state, target = {}, 1
        for t in range(0, 60, 5):
            ctx = make_context(now=5000.0 + t, replicas=1, target_replicas=target, ongoing_requests=64, config=config,
                               policy_state=state)
            target, state = policy(ctx)
            if target > 1:
                first_up.setdefault(name, t)
        assert target == 4, name
    assert first_up == {"forecast": 0, "default": 30}


def test_the_policy_reads_arrivals_from_the_replicas_counters_and_forecasts_from_where_they_end():
    policy = ForecastAutoscalingPolicy(**FAST)
    config = AutoscalingOptions(max_replicas=4, **FAST).autoscaling_config(32)

    def tick(now: float, received: dict) -> None:
        policy(make_context(now=now, replicas=sorted(received), ongoing_requests=0, config=config,
                            requests_received=received))

    tick(10.0, {"a": [(0.0, 100), (6.0, 160)]})  # a's first sample is its baseline: 60 over [0, 6)
    tick(16.0, {"a": [(6.0, 160), (12.0, 220)], "b": [(9.0, 30)]})  # b joins: its baseline
    tick(22.0, {"a": [(12.0, 220), (18.0, 280)], "b": [(9.0, 30), (15.0, 36)]})
    arrivals, _ = policy.scaler.predictor.history(18.0)
    assert list(arrivals) == [10.0] * 9 + [11.0] * 6 + [10.0] * 3  # spread over the bins; b's 1/s from 9 s
    assert policy.scaler.forecast.time == 15.0  # b's counts end there: the forecast starts from them
    tick(28.0, {"a": [(18.0, 280), (24.0, 340)]})  # b is gone, and forgotten
    assert policy.scaler.forecast.time == 24.0


def test_the_policy_loads_the_way_rays_controller_loads_it():
    """Serialised with the deployment's config (Ray pickles the class by value, the kwargs as JSON), then
    instantiated once with its kwargs: the settings the app chose, the target half the engine's batch."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.config import DeploymentConfig

    config = AutoscalingOptions(min_replicas=2, max_replicas=6, startup_s=90).autoscaling_config(max_num_seqs=32)
    assert config.policy.policy_function == FORECAST_POLICY
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0.0, 0.0)  # the policy holds its own
    shipped = DeploymentConfig.from_proto_bytes(DeploymentConfig(autoscaling_config=config).to_proto_bytes())
    policy = _resolve_policy_callable(shipped.autoscaling_config.policy)
    assert type(policy).__name__ == "ForecastAutoscalingPolicy"
    assert dataclasses.asdict(policy.scaler.settings) == dataclasses.asdict(ForecastScalingSettings(
        target_ongoing_requests=16.0, startup_s=90.0))
    assert (shipped.autoscaling_config.min_replicas, shipped.autoscaling_config.max_replicas) == (2, 6)


def test_the_app_argument_gives_the_engine_replicas_an_autoscaling_config():
    from deployments.app import AppArgs, build_app, replica_scaling

    fixed = AppArgs.model_validate({"num_replicas": 2})
    assert replica_scaling(fixed, fixed.engine_config()) == {"num_replicas": 2} and fixed.max_engine_replicas == 2
    args = AppArgs.model_validate({"max_num_seqs": 8, "autoscaling": {"max_replicas": 3, "lead_s": 20}})
    (config,) = replica_scaling(args, args.engine_config()).values()
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 3, 4.0)
    assert config.policy.policy_kwargs["lead_s"] == 20.0 and args.max_engine_replicas == 3
    router = build_app(args)._bound_deployment
    engine, _, router_options = router.init_args
    assert engine._bound_deployment._deployment_config.autoscaling_config == config
    assert router_options.max_in_flight == 8 * 3  # slots for the most replicas there may be
    default = AppArgs.model_validate({"autoscaling": {"policy": "default", "max_replicas": 3, "min_replicas": 0}})
    (config,) = replica_scaling(default, default.engine_config()).values()
    assert config.policy.is_default_policy_function() and config.downscale_delay_s == 120.0
    with pytest.raises(ValueError, match="num_replicas"):
        AppArgs.model_validate({"num_replicas": 2, "autoscaling": {"max_replicas": 3}})
    with pytest.raises(ValueError, match="max_replicas"):
        build_app({"autoscaling": {"max_replicas": 1, "min_replicas": 2}})


def test_the_engine_replica_reports_its_received_requests_as_a_counter():
    from deployments.engine_replica import EngineReplica

    replica = types.SimpleNamespace(num_requests=7)
    assert EngineReplica.func_or_class.record_autoscaling_stats(replica) == {RECEIVED_METRIC: 7.0}
