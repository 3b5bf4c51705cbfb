"""Forecast-driven autoscaling of the engine replicas, as a Ray Serve custom autoscaling policy.

Ray's default policy scales on the requests in flight now (``ongoing / target_ongoing_requests``
replicas), up only after ``upscale_delay_s``; an engine replica takes about a minute to start (placement,
the engine process, weights, calibration), so a peak is served by the replicas asked for a minute before
it. This policy asks for them ahead of the peak, from the ``TrafficPredictor``'s forecast::

    horizon   = startup_s + lead_s    (a replica asked for now serves from startup_s on)
    W         = mean ongoing / mean arrival rate, both over the last little_window_s
                (Little's law: how long a request stays, its queueing included)
    predicted = forecast peak arrival rate over the horizon x W
    desired   = ceil(max(ongoing now, predicted) / target_ongoing_requests), within [min, max]

It scales up at once, and down only to what the need has stayed at or under for the last
``downscale_delay_s``. The peak is the highest per-second rate on the forecast's path, so one noisy
second of the season counts: it errs towards a replica too many. Little's law is read off means, not
the instant: the ongoing count of a replica fleet that has just emptied says a request stays 0 s, and a
forecast peak would then ask for nothing (``cluster_control.py`` measured the same on memory). The
forecast is refitted every ``refresh_s`` and covers every decision until the next.

Arrivals: each engine replica reports the generate calls it has received so far (``RECEIVED_METRIC``,
``EngineReplica.record_autoscaling_stats``); Ray samples it every ``look_back_period_s`` x 0.2 (6 s) and
pushes the samples every 10 s, so a replica's counts reach the policy 6-16 s late. The policy takes
differences per replica, spreads each over the time between its two samples, and forecasts from the
time every replica's counts are in (the oldest last sample), over a horizon longer by that lag.

Ray runs a policy in its controller every 0.1 s inside a wrapper (``_apply_autoscaling_config``) that
adds ``upscale_delay_s`` / ``downscale_delay_s`` and the scaling factors of the ``AutoscalingConfig``:
``AutoscalingOptions.autoscaling_config`` sets both delays to 0 for this policy (its own rule holds the
replicas). ``ray_controller`` runs a policy, this one or ``ray_default_policy``, the way Ray's controller
does, on the caller's clock, and ``make_context`` builds its ``AutoscalingContext`` from plain numbers:
a simulator compares both without a cluster. No Ray import at module level.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, Optional, Sequence, Union

from pydantic import (BaseModel, ConfigDict, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt,
                      model_validator)

from apt_serve_ray.scheduler.predictor import Forecast, TrafficPredictor

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

RECEIVED_METRIC = "apt_requests_received"  # an engine replica's generate calls so far (a counter)
FORECAST_POLICY = "deployments.autoscaling:ForecastAutoscalingPolicy"  # Ray's policy_function


def _check(name: str, value: Any, *, allow_zero: bool = False) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{name}: must be a finite number {'>=' if allow_zero else '>'} 0, got {value!r}")


@dataclass(frozen=True)
class ForecastScalingSettings:
    """The forecast policy's parameters (times in seconds); a bad value raises ValueError naming it."""

    # Requests in flight a replica is sized for. Ray's default, 2, suits replicas that serve a request or
    # two at a time; an engine replica batches up to max_num_seqs, so the app sizes for half of that
    # (``AutoscalingOptions.target``): a full batch runs the slowest steps (TBT targets) and leaves no room
    # for a forecast that falls short.
    target_ongoing_requests: float = 2.0
    startup_s: float = 60.0  # from asking for a replica to its first request
    lead_s: float = 15.0  # beyond start-up: the replicas' counts arrive 6-16 s late
    downscale_delay_s: float = 120.0  # the need stays lower this long before a replica goes
    little_window_s: float = 60.0  # the means of ongoing requests and arrivals that give W
    # How often the forecast is refitted (a fit on 600 s of history takes ~0.1 s of the Serve controller's
    # loop, which calls the policy every 0.1 s); each covers the horizon of every tick until the next.
    refresh_s: float = 5.0
    history_s: float = 600.0  # the predictor's history (two periods of a season to detect it)
    season_s: Optional[float] = None  # the traffic's period if known; None: detected

    def __post_init__(self) -> None:
        for name in ("target_ongoing_requests", "little_window_s", "refresh_s", "history_s"):
            _check(name, getattr(self, name))
        for name in ("startup_s", "lead_s", "downscale_delay_s"):
            _check(name, getattr(self, name), allow_zero=True)
        if not self.horizon_s > 0:
            raise ValueError(f"lead_s: startup_s + lead_s must be > 0, got {self.startup_s!r} + {self.lead_s!r}")
        self.predictor()  # raises naming season_s

    @property
    def horizon_s(self) -> float:
        return self.startup_s + self.lead_s

    def predictor(self) -> TrafficPredictor:
        return TrafficPredictor(self.history_s, season_s=self.season_s)


class ForecastScaler:
    """The policy's decision without Ray, on the caller's clock. Feed it arrivals (``decide``'s
    ``num_arrivals`` or ``observe_span``) and ask it each tick how many replicas to run."""

    def __init__(self, settings: ForecastScalingSettings | None = None) -> None:
        self.settings = settings or ForecastScalingSettings()
        self.predictor = self.settings.predictor()
        self.forecast: Forecast | None = None  # the last one, from the time arrivals are complete
        self.time_in_system_s = 0.0  # W, Little's law (kept while nothing arrives)
        self.need = 0.0  # the requests in flight the last decision sized for
        self._ongoing: deque[tuple[float, float]] = deque()  # (time, ongoing), over little_window_s
        self._ongoing_sum = 0.0
        self._refreshed_at: float | None = None  # when the forecast was last fitted
        self._asked: deque[tuple[float, int]] = deque()  # (time, replicas asked for) over downscale_delay_s,
        # the replicas decreasing: the front is the most asked for in that window
        self._since: float | None = None  # the first decision's time

    def observe_span(self, start: float, end: float, count: float) -> None:
        """``count`` requests arrived over ``[start, end)`` (a counter between two samples): spread evenly
        over the predictor's bins (at ``start`` when the span is empty)."""
        if count <= 0:
            return
        if end <= start:
            self.predictor.observe(start, count)
            return
        bin_s, t = self.predictor.bin_s, start
        while t < end:
            edge = min(end, (math.floor(t / bin_s + 1e-9) + 1) * bin_s)
            self.predictor.observe(t, count * (edge - t) / (end - start))
            t = edge

    def decide(self, now: float, num_arrivals: float, ongoing_requests: float, current_replicas: int,
               min_replicas: int, max_replicas: int, *, known_until: float | None = None) -> int:
        """The replicas to run from ``now``. ``num_arrivals``: requests arrived since the last call (0 where
        they come through ``observe_span``); ``ongoing_requests``: in flight over the deployment, queued
        ones included; ``current_replicas``: the target so far (replicas running or starting); arrivals
        are complete up to ``known_until`` (None: ``now``)."""
        known = now if known_until is None else min(known_until, now)
        if num_arrivals:
            self.predictor.observe(now, num_arrivals)
        self.predictor.observe(known, 0)  # time passes even when nothing arrives
        self._note_ongoing(now, ongoing_requests)
        self._refresh(now, known)
        self.need = max(ongoing_requests, self.forecast.peak_arrival_rate * self.time_in_system_s)
        desired = math.ceil(self.need / self.settings.target_ongoing_requests - 1e-9)
        return max(min_replicas, min(max_replicas, self._hold(now, desired, current_replicas)))

    def _note_ongoing(self, now: float, ongoing: float) -> None:
        self._ongoing.append((now, ongoing))
        self._ongoing_sum += ongoing
        while self._ongoing[0][0] < now - self.settings.little_window_s:
            self._ongoing_sum -= self._ongoing.popleft()[1]

    def _refresh(self, now: float, known: float) -> None:
        """The forecast and W, every ``refresh_s``: the forecast from ``known`` over the lag, the horizon
        and the time to the next refresh."""
        s = self.settings
        if self._refreshed_at is not None and now - self._refreshed_at < s.refresh_s:
            return
        self._refreshed_at = now
        self.forecast = self.predictor.forecast(now - known + s.horizon_s + s.refresh_s, known)
        bin_s = self.predictor.bin_s
        arrivals, _ = self.predictor.history(known)
        arrivals = arrivals[-max(1, round(s.little_window_s / bin_s)):]
        rate = arrivals.sum() / (len(arrivals) * bin_s) if len(arrivals) else 0.0
        if rate > 0:
            self.time_in_system_s = self._ongoing_sum / len(self._ongoing) / rate

    def _hold(self, now: float, desired: int, current: int) -> int:
        """Up at once; down to the most asked for over the last downscale_delay_s (the need has stayed at or
        under it that long), and only once that long has been watched."""
        asked, delay = self._asked, self.settings.downscale_delay_s
        while asked and asked[-1][1] <= desired:
            asked.pop()
        asked.append((now, desired))
        while asked[0][0] < now - delay - 1e-9:
            asked.popleft()
        if self._since is None:
            self._since = now
        if desired >= current or now - self._since + 1e-9 < delay:
            return max(desired, current)
        return min(current, asked[0][1])


class ForecastAutoscalingPolicy:
    """What Ray Serve calls: ``AutoscalingPolicy(policy_function=FORECAST_POLICY, policy_kwargs=...)`` with
    ``ForecastScalingSettings``' fields as the keyword arguments. Ray instantiates a policy class once per
    deployment with its ``policy_kwargs`` and calls the instance with an ``AutoscalingContext`` each tick,
    so the scaler and the counters read so far live here (Ray's policy state is a dict it copies)."""

    def __init__(self, **settings: Any) -> None:
        self.scaler = ForecastScaler(ForecastScalingSettings(**settings))
        self._last: dict[Any, tuple[float, float]] = {}  # replica -> (time, count) of its last sample read

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict]:
        now = ctx.current_time
        known = self._read_received((ctx.raw_metrics or {}).get(RECEIVED_METRIC, {}), now)
        return self.scaler.decide(now, 0, ctx.total_num_requests, ctx.target_num_replicas,
                                  ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas,
                                  known_until=known), {}

    def _read_received(self, series: Mapping[Any, Sequence], now: float) -> float:
        """Arrivals from each replica's counter samples newer than those read (a replica's first sample is
        its baseline); returns the time every reporting replica's counts are in up to (``now``: none)."""
        self._last = {replica: last for replica, last in self._last.items() if replica in series}
        for replica, points in series.items():
            for point in points:
                last = self._last.get(replica)
                if last is not None and point.timestamp <= last[0]:
                    continue
                if last is not None:
                    self.scaler.observe_span(last[0], point.timestamp, max(0.0, point.value - last[1]))
                self._last[replica] = (point.timestamp, point.value)
        return min((t for t, _ in self._last.values()), default=now)


def ray_default_policy(ctx: AutoscalingContext) -> tuple[float, dict]:
    """Ray Serve's default policy itself (``ray.serve.autoscaling_policy.default_autoscaling_policy``:
    ``total_num_requests / target_ongoing_requests`` replicas, a float); its delays and factors come from
    Ray's wrapper, as ``ray_controller`` applies them."""
    from ray.serve.autoscaling_policy import default_autoscaling_policy

    return default_autoscaling_policy(ctx)


@contextlib.contextmanager
def _ray_clock(now: float):
    """Ray's delay logic reads ``time.time()`` in ``ray.serve.autoscaling_policy``: ``now`` instead."""
    from ray.serve import autoscaling_policy

    wall = autoscaling_policy.time
    autoscaling_policy.time = types.SimpleNamespace(time=lambda: now)
    try:
        yield
    finally:
        autoscaling_policy.time = wall


def ray_controller(policy: Callable) -> Callable[[AutoscalingContext], tuple[int, dict]]:
    """``policy`` (a policy function or instance) as Ray Serve's controller runs it: inside Ray's own
    wrapper (cold start, the scaling factors, ``upscale_delay_s`` / ``downscale_delay_s`` of ``ctx.config``,
    the delays timed by ``ctx.current_time``), rounded up and clipped to the capacity-adjusted bounds.
    Returns ``(target replicas, policy state)``: pass the state to the next call's ``make_context``."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    wrapped = _apply_autoscaling_config(policy)

    def decide(ctx: AutoscalingContext) -> tuple[int, dict]:
        with _ray_clock(ctx.current_time):
            replicas, state = wrapped(ctx)
        return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas,
                                                            math.ceil(replicas))), state

    return decide


_Received = Union[float, Sequence[tuple[float, float]]]


def make_context(*, now: float, replicas: Union[int, Sequence[str]], ongoing_requests: Union[float, Sequence[float]],
                 config: Union[AutoscalingConfig, Mapping[str, Any]], target_replicas: int | None = None,
                 queued_requests: float = 0.0, requests_received: Mapping[str, _Received] | None = None,
                 policy_state: dict | None = None, deployment: str = "EngineReplica",
                 app: str = "apt-serve") -> AutoscalingContext:
    """A real Ray ``AutoscalingContext`` from plain numbers, for calling policies without a cluster.

    ``now``: the time of the tick, seconds on any clock (``ctx.current_time``; the delays and the forecast
    run on it). ``replicas``: the running replicas, a count (ids ``replica-0``, ...) or their ids.
    ``ongoing_requests``: requests in flight, queued ones included (``total_num_requests``, which Ray
    averages over ``look_back_period_s``), over the deployment or one number per replica (summed).
    ``config``: the deployment's ``AutoscalingConfig`` or a dict of its fields; the app's is
    ``AutoscalingOptions(...).autoscaling_config(max_num_seqs)``, its bounds the context's.
    ``target_replicas``: the controller's current target (running plus starting; None: ``replicas``' count).
    ``queued_requests``: of the ongoing ones, those still queued at the handles.
    ``requests_received``: replica id -> its ``RECEIVED_METRIC`` counter (generate calls received so far),
    a number sampled at ``now`` or ``[(time, count), ...]`` oldest first (as Ray holds the last
    ``look_back_period_s`` of samples); replicas not named have not reported. The forecast policy reads
    arrivals only from these; Ray's default ignores them.
    ``policy_state``: the state the previous call returned (None: a first call).
    """
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = config if isinstance(config, AutoscalingConfig) else AutoscalingConfig(**config)
    deployment_id = DeploymentID(name=deployment, app_name=app)
    names = [f"replica-{i}" for i in range(replicas)] if isinstance(replicas, int) else list(replicas)
    ids = {name: ReplicaID(unique_id=name, deployment_id=deployment_id) for name in names}
    unknown = sorted(set(requests_received or {}) - set(ids))
    if unknown:
        raise ValueError(f"requests_received: {unknown[0]!r} is not one of the running replicas {names}")
    received = {ids[name]: [TimeStampedValue(now, float(value))] if isinstance(value, (int, float))
                else [TimeStampedValue(float(t), float(count)) for t, count in value]
                for name, value in (requests_received or {}).items()}
    ongoing = ongoing_requests if isinstance(ongoing_requests, (int, float)) else sum(ongoing_requests)
    return AutoscalingContext(
        deployment_id=deployment_id, deployment_name=deployment, app_name=app, current_num_replicas=len(ids),
        target_num_replicas=len(ids) if target_replicas is None else target_replicas,
        running_replicas=list(ids.values()), total_num_requests=float(ongoing),
        total_queued_requests=float(queued_requests),
        aggregated_metrics={RECEIVED_METRIC: {r: s[-1].value for r, s in received.items()}} if received else {},
        raw_metrics={RECEIVED_METRIC: received} if received else {},
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=dict(policy_state or {}), last_scale_up_time=None, last_scale_down_time=None,
        current_time=now, config=config)


_DEFAULTS = ForecastScalingSettings()


class AutoscalingOptions(BaseModel):
    """The app's ``autoscaling`` argument: the engine replicas scale between ``min_replicas`` and
    ``max_replicas`` under ``policy``, "forecast" (this module) or "default" (Ray Serve's own, with
    ``downscale_delay_s`` and Ray's other defaults). ``target_ongoing_requests``: None, half the engine's
    ``max_num_seqs`` (``ForecastScalingSettings``). The other fields are the forecast's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: Literal["forecast", "default"] = "forecast"
    min_replicas: NonNegativeInt = 1
    max_replicas: PositiveInt
    target_ongoing_requests: Optional[PositiveFloat] = None
    startup_s: NonNegativeFloat = _DEFAULTS.startup_s
    lead_s: NonNegativeFloat = _DEFAULTS.lead_s
    downscale_delay_s: NonNegativeFloat = _DEFAULTS.downscale_delay_s
    little_window_s: PositiveFloat = _DEFAULTS.little_window_s
    refresh_s: PositiveFloat = _DEFAULTS.refresh_s
    history_s: PositiveFloat = _DEFAULTS.history_s
    season_s: Optional[PositiveFloat] = _DEFAULTS.season_s

    @model_validator(mode="after")
    def _validate(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas: must be >= min_replicas ({self.min_replicas}), got {self.max_replicas}")
        self.settings(max_num_seqs=2)  # raises naming the field (any batch: the target is checked above)
        return self

    def target(self, max_num_seqs: int) -> float:
        return self.target_ongoing_requests or max(1.0, max_num_seqs / 2)

    def settings(self, max_num_seqs: int) -> ForecastScalingSettings:
        fields = self.model_dump(exclude={"policy", "min_replicas", "max_replicas", "target_ongoing_requests"})
        return ForecastScalingSettings(target_ongoing_requests=self.target(max_num_seqs), **fields)

    def autoscaling_config(self, max_num_seqs: int) -> AutoscalingConfig:
        """The engine replicas' ``AutoscalingConfig`` (``max_num_seqs``: the engine's batch)."""
        from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

        bounds = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                  "target_ongoing_requests": self.target(max_num_seqs)}
        if self.policy == "default":
            return AutoscalingConfig(**bounds, downscale_delay_s=self.downscale_delay_s)
        # Ray's wrapper would add its own delays on top of the policy's: none.
        policy = AutoscalingPolicy(policy_function=FORECAST_POLICY,
                                   policy_kwargs=asdict(self.settings(max_num_seqs)))
        return AutoscalingConfig(**bounds, upscale_delay_s=0.0, downscale_delay_s=0.0, policy=policy)
