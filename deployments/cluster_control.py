"""The controller's decisions, without Ray: which knobs each replica gets and whether routers admit.

Three rules, each on its own signal (the ``Controller`` deployment feeds them heartbeats and arrival
counts and publishes what they decide)::

    replica r:  Watermarks(signal_r)    -> r's cache_ratio (the higher of its rule's and the cluster's)
                Watermarks(usage_r)     -> r.is_pressured (above heavy: routers steer new requests
                                           to the other replicas while any other has room)
    cluster:    Watermarks(used / pages over every replica)
                                        -> admission_open (routers answer 503 while closed) and the
                                           cluster's ratio, every replica's floor
    forecast:   forecast_usage > heavy  -> admission_limit = admission_share (routers let only that share
                                           of their in-flight slots through; the rest wait, in value
                                           order); 1 by default, i.e. off: measured to cost attainment

    usage_r  = (used_r + pending_r) / pages_r   (pending: prompts received, not prefilled yet)
    signal_r = usage_r, or with prediction max(usage_r, usage_r + extra_pages / num_replicas / pages_r);
               where the forecast alone lifts it over light, the ratio goes to its cap at once
    extra_pages = max(0, forecast peak token rate - token rate of the last horizon) * hold / tokens per page
    hold        = min(horizon, mean tokens held / mean token arrival rate, both over the last minute)

``extra_pages`` is the memory a forecast rise would add to what today's memory already holds
(steady traffic frees about what it takes, so only the rise counts). The forecast's *peak* rate over
the horizon (the highest per-second rate of its path, in tokens) is what memory must hold, not the
mean over the horizon, which rises only as the peak fills the horizon: with the mean, the signal
crossed light 0.6 s before an on/off peak, with a 5-s horizon. By Little's law a token is held
for ``mean tokens held / mean token arrival rate`` seconds on average, so a rise of ``d`` tokens/s
holds about ``d * hold`` more tokens once it has lasted that long; before the requests of the rise
finish, no more than ``d * horizon`` can pile up, hence the min. Little's law is a law of averages:
read off the instant (tokens held *now*), it said a token is held 0 s whenever the replicas had just
emptied, in the trough before every on/off peak, and the forecast of the peak added no memory at all
(measured: the forecast rate rose from 1 to 20 req/s over the 3 s before a peak while the forecast
usage stayed 0; docs/benchmarks.md, issue 14). Hence the means over ``LITTLE_WINDOW_S``. The router spreads
arrivals over the replicas, so each gets an equal share. So the ratio rises and admission tightens
*before* a forecast peak crosses the watermarks, and both relax as the forecast falls back. A replica
is marked pressured on its own memory only: every replica gets the same share of a forecast, so a
forecast cannot tell the routers which one to avoid. The cluster rule
applies to the cluster as a whole (one replica full beside an empty one reads as half full and
changes nothing there); the replica rule acts on the full one.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from apt_serve_ray.scheduler.predictor import Forecast, TrafficPredictor
from apt_serve_ray.scheduler.watermarks import Watermarks
from deployments.wire import ArrivalCount, ControllerDecision, Knobs, LoadReport


LITTLE_WINDOW_S = 60.0  # the means of tokens held and of token arrivals that give how long a token is held


@dataclass(frozen=True)
class ControlSettings:
    light: float
    heavy: float
    max_ratio: float
    ratio_step: float
    base_ratio: float = 0.0
    stale_after_s: float = 2.0
    predictive: bool = False
    horizon_s: float = 10.0
    history_s: float = 300.0
    # Routers' in-flight slots let through while a peak over heavy is forecast. 1: never tightened, the
    # default: on the on/off smoke run 0.75 held requests at the routers and lost 14 points of
    # attainment (docs/benchmarks.md, issue 14).
    admission_share: float = 1.0
    # The ratio falls only once the signal has stayed <= light - ratio_hysteresis for ratio_dwell
    # control intervals in a row (it rises at once): a replica's usage swings by half its pages as
    # requests come and go, and the plain rule moved its ratio up and down every other interval on the
    # on/off smoke runs (docs/benchmarks.md, issue 14). The Controller sets the dwell to ~2 s.
    ratio_hysteresis: float = 0.1
    ratio_dwell: int = 1

    def __post_init__(self) -> None:
        if not self.horizon_s > 0:
            raise ValueError(f"forecast_horizon_s: must be > 0 seconds, got {self.horizon_s!r}")
        if not 0.0 < self.admission_share <= 1.0:
            raise ValueError(f"predictive_admission_share: must be in (0, 1], got {self.admission_share!r}")

    def watermarks(self) -> Watermarks:
        return Watermarks(self.light, self.heavy, self.max_ratio, self.ratio_step, base=self.base_ratio,
                          hysteresis=min(self.ratio_hysteresis, self.light), dwell=self.ratio_dwell)


class ClusterControl:
    def __init__(self, settings: ControlSettings, wall_clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.cluster = settings.watermarks()
        self.predictor = TrafficPredictor(settings.history_s) if settings.predictive else None
        self.wall_clock = wall_clock
        self.replicas: dict[str, LoadReport] = {}  # replica id -> its last report
        self.last_heard: dict[str, float] = {}
        self.rules: dict[str, Watermarks] = {}  # replica id -> its own watermark rule
        self.usage = 0.0  # cluster: used / pages (today's signal)
        self.forecast: Forecast | None = None
        self.forecast_usage: float | None = None  # cluster usage with the forecast's extra pages
        self.admission_limit = 1.0
        self._held: deque[tuple[float, float]] = deque()  # (time, tokens held), over LITTLE_WINDOW_S

    # Inputs ---------------------------------------------------------------------------------------
    def report(self, load: LoadReport, now: float) -> Knobs:
        """A replica's heartbeat; the reply is its knobs as last decided (a new replica: the cluster's)."""
        self.replicas[load.replica_id] = load
        self.last_heard[load.replica_id] = now
        if load.replica_id not in self.rules:
            self.rules[load.replica_id] = self.settings.watermarks()
        return self.knobs(load.replica_id)

    def observe_arrivals(self, count: ArrivalCount, now: float) -> None:
        if self.predictor is not None and count.num_requests:
            self.predictor.observe(now, count.num_requests, count.num_prompt_tokens, count.num_output_tokens)

    def knobs(self, replica_id: str) -> Knobs:
        rule = self.rules.get(replica_id)
        if rule is None:
            return Knobs(cache_ratio=self.cluster.ratio)
        return Knobs(cache_ratio=max(rule.ratio, self.cluster.ratio), is_pressured=not rule.admit)

    def replica_usage(self, load: LoadReport) -> float:
        return min(1.0, (load.num_used_pages + load.num_pending_pages) / max(1, load.num_pages))

    # The decision ---------------------------------------------------------------------------------
    def drop_stale(self, now: float) -> list[str]:
        gone = [r for r, heard in self.last_heard.items() if now - heard > self.settings.stale_after_s]
        for replica_id in gone:
            del self.replicas[replica_id], self.last_heard[replica_id]
            self.rules.pop(replica_id, None)
        return gone

    def step(self, now: float) -> list[ControllerDecision]:
        """One control interval at ``now`` (the clock heartbeats and arrivals were stamped with):
        the decisions that changed something, cluster first."""
        self.drop_stale(now)
        total = sum(load.num_pages for load in self.replicas.values())
        if total == 0:
            return []
        self.usage = sum(load.num_used_pages for load in self.replicas.values()) / total
        extra_pages = self._forecast_extra_pages(now)
        knobs_before = {r: self.knobs(r) for r in self.replicas}
        decisions = []
        if self.forecast is not None:
            self.forecast_usage = min(1.0, self.usage + extra_pages / total)
        before = (self.cluster.ratio, self.cluster.admit)
        d = self.cluster.observe(self.usage)  # reactive: 503s only on memory actually in use
        if d.changed:
            decisions.append(self._decision(None, self.usage, d.reason + self._no_effect_note(), before))
        decisions += self._predictive_admission()
        share = extra_pages / max(1, len(self.replicas))
        for replica_id, load in self.replicas.items():
            rule, usage = self.rules[replica_id], self.replica_usage(load)
            signal = usage
            if self.forecast is not None:
                signal = max(usage, min(1.0, usage + share / max(1, load.num_pages)))
            before = (knobs_before[replica_id].cache_ratio, not knobs_before[replica_id].is_pressured)
            # A forecast peak is seen whole: the ratio goes to its cap at once rather than a step an
            # interval (the ratio is a ceiling: apt compresses only once memory runs short).
            rise_to = self.settings.max_ratio if usage <= self.settings.light < signal else 0.0
            d = rule.observe(signal, admit_usage=usage, rise_to=rise_to)
            if d.changed or self.knobs(replica_id).cache_ratio != before[0]:
                reason = d.reason.replace("admission off", "pressured: routers steer away").replace(
                    "admission on", "not pressured") or (
                    f"the cluster's ratio floor: {before[0]:.2f} -> {self.knobs(replica_id).cache_ratio:.2f}")
                if signal > usage:
                    reason += f" (own usage {usage:.2f})"
                decisions.append(self._decision(replica_id, usage, reason, before))
        return decisions

    def _forecast_extra_pages(self, now: float) -> float:
        if self.predictor is None:
            return 0.0
        s = self.settings
        self.predictor.observe(now, 0)  # time passes even when nothing arrives
        self.forecast = f = self.predictor.forecast(s.horizon_s, now)
        tokens_per_page = max(1, min((load.tokens_per_kv_page for load in self.replicas.values()), default=16))
        held_tokens = sum(load.num_used_pages for load in self.replicas.values()) * tokens_per_page
        peak_token_rate = max(f.token_rate, f.peak_arrival_rate * f.token_rate / f.arrival_rate) \
            if f.arrival_rate > 0 else f.token_rate
        return max(0.0, peak_token_rate - f.recent_token_rate) * self._hold_s(now, held_tokens) / tokens_per_page

    def _hold_s(self, now: float, held_tokens: float) -> float:
        """Seconds a token is held, by Little's law over the last ``LITTLE_WINDOW_S``: the mean of the
        tokens held at each step over the mean token arrival rate; at most the horizon (and the horizon
        while nothing has arrived)."""
        horizon = self.settings.horizon_s
        self._held.append((now, held_tokens))
        while self._held and self._held[0][0] < now - LITTLE_WINDOW_S:
            self._held.popleft()
        _, tokens = self.predictor.history(now)
        tokens = tokens[-int(LITTLE_WINDOW_S / self.predictor.bin_s):]
        arrival_rate = tokens.sum() / (len(tokens) * self.predictor.bin_s) if len(tokens) else 0.0
        if arrival_rate <= 0:
            return horizon
        return min(horizon, sum(held for _, held in self._held) / len(self._held) / arrival_rate)

    def _predictive_admission(self) -> list[ControllerDecision]:
        if self.forecast_usage is None:
            return []
        limit = self.settings.admission_share if self.forecast_usage > self.settings.heavy else 1.0
        if limit == self.admission_limit:
            return []
        before = (self.cluster.ratio, self.cluster.admit)
        verb = "tightened" if limit < 1.0 else "relaxed"
        self.admission_limit = limit
        actions = ("tighten_admission",) if limit < 1.0 else ("relax_admission",)
        reason = (f"forecast usage {self.forecast_usage:.2f} {'>' if limit < 1 else '<='} heavy "
                  f"{self.settings.heavy}: admission {verb} to {limit:.0%} of in-flight slots")
        return [self._decision(None, self.usage, reason, before, actions)]

    def _decision(self, replica_id: str | None, usage: float, reason: str, before: tuple,
                  actions: tuple[str, ...] = ()) -> ControllerDecision:
        f = self.forecast
        if f is not None:
            reason += (f" [forecast {f.arrival_rate:.2f} req/s ({f.arrival_rate_low:.2f}-{f.arrival_rate_high:.2f}),"
                       f" {f.token_rate:.0f} tok/s over {f.horizon_s:g} s vs {f.recent_token_rate:.0f} now;"
                       f" {f.model}; usage -> {self.forecast_usage:.2f}]")
        knobs = self.knobs(replica_id) if replica_id is not None else Knobs(self.cluster.ratio)
        admit = self.cluster.admit if replica_id is None else not knobs.is_pressured
        if knobs.cache_ratio != before[0]:
            actions += ("raise_hidden_target" if knobs.cache_ratio > before[0] else "lower_hidden_target",)
        if admit != before[1]:
            if replica_id is None:
                actions += ("open_admission" if admit else "close_admission",)
            else:
                actions += ("unpressure_replica" if admit else "pressure_replica",)
        return ControllerDecision(time=self.wall_clock(), usage=usage, cache_ratio=knobs.cache_ratio,
                                  admission_open=admit, reason=reason, replica_id=replica_id, forecast=f,
                                  forecast_usage=self.forecast_usage, admission_limit=self.admission_limit,
                                  actions=actions)

    def _no_effect_note(self) -> str:
        if any(load.compressed_kinds or load.hidden_allowed for load in self.replicas.values()):
            return ""
        return " (no compressed cache kind offered for this model: the ratio has no effect)"

    def state_fields(self) -> dict:
        """What ``ControllerState`` carries beyond the reports and decisions."""
        return dict(admission_open=self.cluster.admit, cache_ratio=self.cluster.ratio, usage=self.usage,
                    knobs={r: self.knobs(r) for r in self.replicas}, forecast=self.forecast,
                    forecast_usage=self.forecast_usage, admission_limit=self.admission_limit)


def describe(decision: ControllerDecision) -> str:
    """One log line: who, what changed, why."""
    who = f"replica {decision.replica_id}" if decision.replica_id else "cluster"
    return f"{who}: {decision.reason}"

