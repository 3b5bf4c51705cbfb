"""Metrics for the Serve app: Ray's ``ray.util.metrics`` behind the engine's metrics-backend shape.

``RayMetricsBackend`` has the ``counter`` / ``histogram`` / ``gauge`` factories that
``apt_serve_ray.observability.metrics`` records into, so the engine's ``EngineMetrics`` and the
router's and controller's metrics below all land on Ray's Prometheus endpoint (there prefixed
``ray_``). With ``mirror`` (an ``InMemoryMetrics``) every value is also kept in the process, which
the deployments hand out through ``metrics_snapshot()`` for tests.
"""

from __future__ import annotations

from ray.util import metrics as ray_metrics

from apt_serve_ray.observability.metrics import LATENCY_BUCKETS, NO_SERVICE_CLASS, InMemoryMetrics


class _Recorder:
    """One Ray metric plus its optional in-memory twin; ``record`` is inc / observe / set."""

    def __init__(self, ray_metric, record_ray, mirror_metric, record_mirror, default_tags: dict) -> None:
        self._ray, self._mirror, self._default_tags = ray_metric, mirror_metric, default_tags
        self._record_ray, self._record_mirror = record_ray, record_mirror

    def _record(self, value, tags) -> None:
        tags = {k: str(v) for k, v in (tags or {}).items()}
        getattr(self._ray, self._record_ray)(value, tags=tags or None)
        if self._mirror is not None:
            getattr(self._mirror, self._record_mirror)(value, tags={**self._default_tags, **tags})

    def inc(self, value=1.0, tags=None) -> None:
        self._record(value, tags)

    def observe(self, value, tags=None) -> None:
        self._record(value, tags)

    def set(self, value, tags=None) -> None:
        self._record(value, tags)


class RayMetricsBackend:
    def __init__(self, default_tags: dict | None = None, mirror: InMemoryMetrics | None = None) -> None:
        self.default_tags = {k: str(v) for k, v in (default_tags or {}).items()}
        self.mirror = mirror

    def _tag_keys(self, tag_keys) -> tuple:
        return tuple(dict.fromkeys((*self.default_tags, *tag_keys)))

    def _wrap(self, ray_metric, method: str, mirror_metric) -> _Recorder:
        if self.default_tags:
            ray_metric.set_default_tags(self.default_tags)
        return _Recorder(ray_metric, method, mirror_metric, method, self.default_tags)

    def counter(self, name, description="", tag_keys=()):
        metric = ray_metrics.Counter(name, description=description, tag_keys=self._tag_keys(tag_keys))
        return self._wrap(metric, "inc", self.mirror and self.mirror.counter(name, description, tag_keys))

    def histogram(self, name, description="", boundaries=(), tag_keys=()):
        metric = ray_metrics.Histogram(name, description=description, boundaries=list(boundaries or LATENCY_BUCKETS),
                                       tag_keys=self._tag_keys(tag_keys))
        return self._wrap(metric, "observe", self.mirror and self.mirror.histogram(name, description, boundaries, tag_keys))

    def gauge(self, name, description="", tag_keys=()):
        metric = ray_metrics.Gauge(name, description=description, tag_keys=self._tag_keys(tag_keys))
        return self._wrap(metric, "set", self.mirror and self.mirror.gauge(name, description, tag_keys))


def make_backend(default_tags: dict, mirror: bool) -> RayMetricsBackend:
    return RayMetricsBackend(default_tags, InMemoryMetrics() if mirror else None)


def snapshot(backend: RayMetricsBackend) -> dict:
    """``{name: [{"tags": {...}, "value": float | [floats]}]}`` of a mirrored backend ({} without one)."""
    if backend.mirror is None:
        return {}
    return {name: [{"tags": dict(key), "value": value} for key, value in series.items()]
            for name, series in backend.mirror.values.items()}


class RouterMetrics:
    """What only the router sees: TTFT from request received to first token delivered, split into the
    Serve path (router, queues, handle call, stream transport) and the engine, both by service class; and
    the requests that never reach or never leave the engine (the engine counts the ones it finishes)."""

    def __init__(self, backend: RayMetricsBackend) -> None:
        self.ttft = backend.histogram("apt_serve_ttft_seconds", "Time to first token as the router sees it "
                                      "(request received -> first token delivered)", LATENCY_BUCKETS,
                                      ("service_class",))
        self.serve_path_ttft = backend.histogram(
            "apt_serve_serve_path_ttft_seconds", "The router's TTFT less the engine's (router, admission queue, "
            "handle call, transport)", LATENCY_BUCKETS, ("service_class",))
        self.requests = backend.counter("apt_serve_requests_total", "Requests by outcome (the router counts "
                                        "rejected / invalid / error)", ("outcome",))

    def first_token(self, ttft_s: float, engine_ttft_s: float | None, service_class: str | None = None) -> None:
        tags = {"service_class": service_class or NO_SERVICE_CLASS}
        self.ttft.observe(ttft_s, tags)
        if engine_ttft_s is not None:
            self.serve_path_ttft.observe(max(0.0, ttft_s - engine_ttft_s), tags)

    def outcome(self, outcome: str) -> None:
        self.requests.inc(1, {"outcome": outcome})


class ControllerMetrics:
    def __init__(self, backend: RayMetricsBackend) -> None:
        self.usage = backend.gauge("apt_serve_cluster_cache_usage", "Share of cache pages in use, cluster-wide")
        self.target = backend.gauge("apt_serve_controller_hidden_target_ratio",
                                    "Hidden-cache target ratio the controller sets on the replicas")
        self.admission = backend.gauge("apt_serve_admission_open", "1 while routers admit new requests")
        self.watermark = backend.gauge("apt_serve_watermark_state", "1 for the watermark band cluster usage is in "
                                       "(below_light, between, above_heavy), else 0", ("state",))
        self.replicas = backend.gauge("apt_serve_engine_replicas_reporting", "Engine replicas reporting")
        self.actions = backend.counter("apt_serve_controller_actions_total", "Controller decisions by action",
                                       ("action",))
        self.replica_ratio = backend.gauge("apt_serve_replica_hidden_target_ratio",
                                           "cache_ratio the controller sets on one replica", ("replica",))
        self.pressured = backend.gauge("apt_serve_replica_pressured", "1 while the request router steers new "
                                       "requests away from the replica", ("replica",))
        self.forecast_rate = backend.gauge("apt_serve_forecast_arrival_rate", "Arrivals per second the traffic "
                                           "predictor expects over its horizon (point, low, high)", ("bound",))
        self.forecast_tokens = backend.gauge("apt_serve_forecast_token_rate", "Prompt + output tokens per second "
                                             "the traffic predictor expects over its horizon (point, low, high)",
                                             ("bound",))
        self.forecast_usage = backend.gauge("apt_serve_forecast_cache_usage", "Cluster cache usage with the "
                                            "pages a forecast rise in demand would add over the horizon")
        self.admission_limit = backend.gauge("apt_serve_admission_limit", "Share of the routers' in-flight "
                                             "slots let through (below 1 while a peak over heavy is forecast)")

    def record(self, control) -> None:
        """The state of a ``ClusterControl`` after its step."""
        usage, cluster = control.usage, control.cluster
        self.replicas.set(len(control.replicas))
        self.usage.set(usage)
        self.target.set(cluster.ratio)
        self.admission.set(1 if cluster.admit else 0)
        self.admission_limit.set(control.admission_limit)
        band = "below_light" if usage <= cluster.light else "between" if usage <= cluster.heavy else "above_heavy"
        for state in ("below_light", "between", "above_heavy"):
            self.watermark.set(1 if state == band else 0, {"state": state})
        for replica_id in control.replicas:
            knobs = control.knobs(replica_id)
            self.replica_ratio.set(knobs.cache_ratio, {"replica": replica_id})
            self.pressured.set(1 if knobs.is_pressured else 0, {"replica": replica_id})
        f = control.forecast
        if f is not None:
            for bound, rate, tokens in (("point", f.arrival_rate, f.token_rate), ("low", f.arrival_rate_low,
                                        f.token_rate_low), ("high", f.arrival_rate_high, f.token_rate_high)):
                self.forecast_rate.set(rate, {"bound": bound})
                self.forecast_tokens.set(tokens, {"bound": bound})
            self.forecast_usage.set(control.forecast_usage or 0.0)
