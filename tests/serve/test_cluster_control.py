"""The controller's decisions on fake replicas (``ClusterControl``, no Ray): each replica's own memory
drives its knobs, the summed memory gates admission for the cluster, and with prediction both move
before a forecast peak arrives, and back after; every decision carries the forecast behind it."""

from __future__ import annotations

import pytest
from serve_helpers import load_report

from apt_serve_ray.scheduler.predictor import Forecast
from deployments.cluster_control import ClusterControl, ControlSettings
from deployments.wire import ArrivalCount

LIGHT, HEAVY = 0.6, 0.85


def control(light: float = LIGHT, heavy: float = HEAVY, **kw) -> ClusterControl:
    return ClusterControl(ControlSettings(light, heavy, max_ratio=0.5, ratio_step=0.1, stale_after_s=5.0, **kw),
                          wall_clock=lambda: 0.0)


def report(c: ClusterControl, now: float, **used_by_replica: int):
    return {r: c.report(load_report(replica_id=r, num_pages=100, num_free_pages=100 - used), now)
            for r, used in used_by_replica.items()}


def test_a_full_replica_beside_an_empty_one_is_acted_on_alone():
    c = control()
    for t in range(3):
        report(c, t, full=100, empty=0)
        decisions = c.step(t)
    knobs = report(c, 3, full=100, empty=0)
    assert c.usage == 0.5 and c.cluster.admit  # the cluster reads half full: the cluster rule does nothing
    assert knobs["full"].cache_ratio == pytest.approx(0.3) and knobs["full"].is_pressured
    assert knobs["empty"].cache_ratio == 0.0 and not knobs["empty"].is_pressured
    assert all(d.replica_id == "full" for d in decisions)
    first = c.step(3) or decisions
    assert all(d.forecast is None for d in first)  # reactive: no forecast


def test_a_pressured_replica_is_released_once_its_own_memory_falls():
    c = control()
    report(c, 0, a=95, b=10)
    c.step(0)
    assert c.knobs("a").is_pressured
    report(c, 1, a=80, b=10)  # under heavy, still over light
    (decision,) = c.step(1)
    assert not c.knobs("a").is_pressured and decision.actions == ("raise_hidden_target", "unpressure_replica")
    assert "not pressured" in decision.reason


def test_pending_prompt_pages_count_toward_a_replicas_pressure():
    c = control()
    c.report(load_report(replica_id="a", num_pages=100, num_free_pages=50, num_pending_pages=40), 0)
    c.step(0)
    assert c.knobs("a").is_pressured


def test_the_cluster_rule_closes_admission_on_the_summed_memory_and_sets_every_replicas_floor():
    c = control()
    report(c, 0, a=90, b=90)
    decisions = c.step(0)
    assert not c.cluster.admit and c.cluster.ratio == pytest.approx(0.1)
    cluster = [d for d in decisions if d.replica_id is None]
    assert cluster and "close_admission" in cluster[0].actions and "admission off" in cluster[0].reason
    report(c, 1, a=10, b=10)
    c.step(1)
    assert c.cluster.admit and c.state_fields()["admission_open"]


def test_a_replica_whose_memory_swings_keeps_its_ratio_and_lowers_it_once_it_stays_low():
    c = control(ratio_dwell=4)  # hysteresis 0.1 by default: the ratio falls at <= 0.5 here
    for t in range(8):  # usage 0.7 / 0.55 every other interval: over light, then just under it
        report(c, t, a=70 if t % 2 == 0 else 55, b=0)
        c.step(t)
    assert c.knobs("a").cache_ratio == pytest.approx(0.4)  # rose with each swing up, never fell
    ratios = []
    for t in range(8, 16):  # memory freed: falls after four low intervals, one step each
        report(c, t, a=10, b=0)
        c.step(t)
        ratios.append(c.knobs("a").cache_ratio)
    assert ratios == pytest.approx([0.4, 0.4, 0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    assert c.knobs("b").cache_ratio == 0.0


def test_a_replica_that_stops_reporting_is_dropped_and_a_new_one_gets_the_clusters_ratio():
    c = control()
    report(c, 0, a=90, b=90)
    c.step(0)
    report(c, 6, b=90)
    c.step(6)
    assert set(c.replicas) == {"b"} and "a" not in c.rules
    assert c.report(load_report(replica_id="new", num_pages=100, num_free_pages=100), 6).cache_ratio == c.cluster.ratio


def _arrivals(c: ClusterControl, now: float, n: int, tokens_per_request: int = 320) -> None:
    c.observe_arrivals(ArrivalCount("router", n, n * (tokens_per_request - 64), n * 64), now)


def _on_off(c: ClusterControl, until: float, start: float = 0.0, peak_used: int = 100) -> list:
    """On/off arrivals (1 req/s for 10 s, then 8 req/s for 10 s) with memory following them:
    ``peak_used`` pages per replica in the peak, 60% of it in the trough's first 3 s (the peak
    draining), then none; the decisions, with the time each was taken."""
    taken, t = [], start
    while t < until:
        phase = t % 20
        _arrivals(c, t + 0.25, 8 if phase >= 10 else 1)  # one poll per second
        used = peak_used if phase >= 10 else (int(0.6 * peak_used) if phase < 3 else 0)
        report(c, t + 0.5, a=used, b=used)
        taken += [(t + 1, d) for d in c.step(t + 1)]
        t += 1
    return taken


def test_prediction_raises_ratios_and_tightens_admission_before_a_forecast_peak():
    # Watermarks 0.4 / 0.5: the forecast peak (8 req/s, ~1.3 s a token) is ~half the pool.
    c = control(light=0.4, heavy=0.5, predictive=True, horizon_s=5.0, admission_share=0.5)
    taken = _on_off(c, until=108)  # five periods seen; 108 s: 2 s before the sixth peak
    f = c.forecast
    assert f is not None and f.model == "holt-winters/20s"
    assert f.token_rate > 2 * f.recent_token_rate  # the peak is seen coming while arrivals are low
    assert c.forecast_usage > 0.5 and c.usage == 0.0  # the replicas emptied in the trough
    assert c.admission_limit == 0.5
    assert c.knobs("a").cache_ratio > 0 and c.knobs("b").cache_ratio > 0  # on the forecast alone
    acted = [(t, d) for t, d in taken if t > 100 and d.actions]
    assert acted and all(d.forecast is not None and "forecast" in d.reason for _, d in acted)
    assert any("tighten_admission" in d.actions for _, d in acted)
    assert c.cluster.admit  # no 503s on a forecast: admission closes only on memory in use
    assert not c.knobs("a").is_pressured  # nor is a replica steered away from on a forecast


def test_forecast_memory_is_what_the_rise_holds_by_littles_law_at_most_a_horizon_of_arrivals():
    # 1 req/s of 320 tokens with 40 pages (640 tokens) held: a token is held 2 s. A rise to 8 req/s
    # (2,240 tokens/s more) holds ~4,480 more tokens = 280 pages (16 tokens each), not the 700 pages
    # the 5-s horizon's arrivals would take.
    for used, hold_s in ((20, 2.0), (200, 5.0)):  # 200 pages per replica: held 20 s, capped at 5
        c = control(predictive=True, horizon_s=5.0)
        for t in range(31):  # one a second in each of the 31 bins before t = 31
            _arrivals(c, t + 0.5, 1)
            for replica in "ab":
                c.report(load_report(replica_id=replica, num_pages=1000, num_free_pages=1000 - used), t + 0.5)
            c._forecast_extra_pages(t + 1)
        c.predictor.forecast = lambda horizon, now: _forecast(token_rate=8 * 320, recent_token_rate=320)
        assert c._forecast_extra_pages(31) == pytest.approx(7 * 320 * hold_s / 16)


def test_a_forecast_peak_adds_memory_when_the_replicas_have_just_emptied():
    """How long a token is held comes from the last minute's means, not from the instant: in the
    empty trough before a peak it still reads ~1-2 s, and the forecast of the peak raises the ratios
    before it lands (read off the instant, it read 0 s there and the forecast added nothing)."""
    c = control(light=0.4, heavy=0.5, predictive=True, horizon_s=5.0)
    _on_off(c, until=108)  # 108 s: 2 s before the sixth peak
    assert c.usage == 0.0 and c.forecast.token_rate > 2 * c.forecast.recent_token_rate
    assert c.forecast_usage > 0.4
    # The peak is seen whole: the ratio is at its cap before it lands, not a step an interval.
    assert c.knobs("a").cache_ratio == c.knobs("b").cache_ratio == 0.5
    reactive = control(light=0.4, heavy=0.5)
    _on_off(reactive, until=108)
    assert reactive.knobs("a").cache_ratio == 0.0  # without the forecast: nothing until the peak lands


def _forecast(**rates) -> Forecast:
    fields = dict(time=0.0, horizon_s=5.0, arrival_rate=8.0, arrival_rate_low=7.0, arrival_rate_high=9.0,
                  token_rate=0.0, token_rate_low=0.0, token_rate_high=0.0, peak_arrival_rate=8.0,
                  recent_arrival_rate=1.0, recent_token_rate=0.0, model="holt", num_history_s=100.0)
    return Forecast(**{**fields, **rates})


def test_prediction_relaxes_after_the_peak():
    c = control(predictive=True, horizon_s=5.0, admission_share=0.5)
    taken = _on_off(c, until=107)
    taken += _on_off(c, start=107, until=123)  # through the peak, into the off phase (next peak at 130 s)
    assert c.admission_limit == 1.0
    assert any("relax_admission" in d.actions for t, d in taken if t > 107)
    assert any("lower_hidden_target" in d.actions for t, d in taken if t > 107)


def test_steady_traffic_forecasts_no_extra_memory():
    c = control(predictive=True, horizon_s=5.0)
    t = 0.0
    while t < 120:
        _arrivals(c, t + 0.25, 4)
        report(c, t + 0.5, a=30, b=30)
        c.step(t + 1)
        t += 1
    assert c.forecast_usage == pytest.approx(c.usage, abs=0.06)
    assert c.admission_limit == 1.0 and c.knobs("a").cache_ratio == 0.0


@pytest.mark.parametrize("kw, field", [({"horizon_s": 0}, "forecast_horizon_s"),
                                       ({"admission_share": 0}, "predictive_admission_share")])
def test_bad_settings_name_the_app_argument(kw, field):
    with pytest.raises(ValueError, match=field):
        control(**kw)
