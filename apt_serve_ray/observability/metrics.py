"""The engine's metrics, named ``apt_serve_*`` and tagged by model and replica; the per-request ones
(counted or observed when a request finishes, preempted or upgraded) also by the request's service
class (``NO_SERVICE_CLASS`` for a request that came without one), so SLO attainment
(``apt_serve_slo_total{result="met"}`` over all results), TTFT and queue time read per class.

Definitions only: they record into a backend with ``ray.util.metrics``' shape (``counter``,
``histogram``, ``gauge`` factories whose objects have ``inc`` / ``observe`` / ``set`` with ``tags``).
``InMemoryMetrics`` serves tests and offline runs; the Ray Serve replica plugs in Ray's.
"""

from __future__ import annotations

from collections import defaultdict

from apt_serve_ray.observability.observer import EngineObserver, RequestEvent, request_record

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
FAST_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25]
NO_SERVICE_CLASS = "none"  # the label of a request that names no service class (offline, direct engine calls)


class InMemoryMetrics:
    """A metrics backend that keeps every value: ``values[name][tags] -> float | list``."""

    def __init__(self) -> None:
        self.values: dict[str, dict[tuple, object]] = defaultdict(dict)

    def _key(self, tags):
        return tuple(sorted((tags or {}).items()))

    def counter(self, name, description="", tag_keys=()):
        backend = self

        class _Counter:
            def inc(self, value=1.0, tags=None):
                d = backend.values[name]
                d[backend._key(tags)] = d.get(backend._key(tags), 0.0) + value

        return _Counter()

    def histogram(self, name, description="", boundaries=(), tag_keys=()):
        backend = self

        class _Histogram:
            def observe(self, value, tags=None):
                backend.values[name].setdefault(backend._key(tags), []).append(value)

        return _Histogram()

    def gauge(self, name, description="", tag_keys=()):
        backend = self

        class _Gauge:
            def set(self, value, tags=None):
                backend.values[name][backend._key(tags)] = value

        return _Gauge()

    def get(self, name, **tags):
        return self.values.get(name, {}).get(self._key(tags))


class EngineMetrics(EngineObserver):
    def __init__(self, backend, model: str, replica: str) -> None:
        self.base = {"model": model, "replica": replica}
        b, t = backend, ("model", "replica")
        r = t + ("service_class",)  # per request
        self.requests = b.counter("apt_serve_requests_total", "Finished requests by outcome", r + ("outcome",))
        self.ttft = b.histogram("apt_serve_engine_ttft_seconds", "Time to first token inside the engine "
                                "(engine arrival -> first token)", LATENCY_BUCKETS, r)
        self.tpot = b.histogram("apt_serve_time_per_output_token_seconds", "Per request: (e2e - ttft) / (tokens - 1)",
                                LATENCY_BUCKETS, r)
        self.gap = b.histogram("apt_serve_inter_token_gap_seconds", "Every gap between consecutive tokens",
                               LATENCY_BUCKETS, r)
        self.e2e = b.histogram("apt_serve_e2e_latency_seconds", "Engine arrival -> finish", LATENCY_BUCKETS, r)
        self.queue = b.histogram("apt_serve_queue_time_seconds", "Engine arrival -> first scheduled", LATENCY_BUCKETS, r)
        self.slo = b.counter("apt_serve_slo_total", "Finished requests by SLO result (met / missed_ttft / missed_tbt)",
                             r + ("result",))
        self.preemptions = b.counter("apt_serve_preemptions_total", "Preemptions by cause", r + ("cause",))
        self.upgrades = b.counter("apt_serve_upgrades_total", "Compressed -> KV in-place upgrades", r)
        self.compressions = b.counter("apt_serve_compressions_total",
                                      "In-place compressions of running requests to an int8 kind", r)
        self.waiting = b.gauge("apt_serve_requests_waiting", "Requests waiting", t)
        self.running = b.gauge("apt_serve_requests_running", "Requests running", t)
        self.pages = b.gauge("apt_serve_cache_pages", "Cache pages by kind (kv, hidden, kv-int8, hidden-int8, free)",
                             t + ("kind",))
        self.target = b.gauge("apt_serve_hidden_target_ratio",
                              "cache_ratio: the ceiling of the share of pages in compressed kinds", t)
        self.share = b.gauge("apt_serve_hidden_share", "Measured share of hidden pages among used pages", t)
        self.compressed = b.gauge("apt_serve_compressed_share",
                                  "Measured share of compressed pages (hidden, kv-int8, hidden-int8) among used pages", t)
        self.usage = b.gauge("apt_serve_cache_usage", "Share of pages in use", t)
        self.prefix_queries = b.counter("apt_serve_prefix_cache_queries_total",
                                        "Tokens looked up in the prefix cache at admission, by the kind admitted in",
                                        t + ("kind",))
        self.prefix_hits = b.counter("apt_serve_prefix_cache_hits_total",
                                     "Tokens found in the prefix cache at admission (not computed), by kind", t + ("kind",))
        self.cached_pages = b.gauge("apt_serve_prefix_cached_pages",
                                    "Pages kept for prefix hits that no request holds (free capacity), by kind",
                                    t + ("kind",))
        self.prompt_cached = b.counter("apt_serve_prompt_cached_tokens_total",
                                       "Prompt tokens of finished requests served from the prefix cache", r)
        self._prefix_seen: dict[str, tuple[int, int]] = {}
        self.sched = b.histogram("apt_serve_scheduler_seconds", "Scheduler time per iteration", FAST_BUCKETS, t)
        self.step = b.histogram("apt_serve_step_seconds", "Engine step time (schedule + forward + postprocess)",
                                LATENCY_BUCKETS, t)

    def _tags(self, **extra):
        return {**self.base, **extra}

    def _request_tags(self, request, **extra):
        return {**self.base, "service_class": request.service_class or NO_SERVICE_CLASS, **extra}

    def on_request_event(self, request, event, now, attrs) -> None:
        if event is RequestEvent.PREEMPTED:
            self.preemptions.inc(1, self._request_tags(request, cause=attrs.get("cause", "memory")))
        elif event is RequestEvent.UPGRADED:
            self.upgrades.inc(1, self._request_tags(request))
        elif event is RequestEvent.COMPRESSED:
            self.compressions.inc(1, self._request_tags(request))
        elif event is RequestEvent.FINISHED:
            rec = request_record(request)
            tags = self._request_tags(request)
            self.requests.inc(1, self._request_tags(request, outcome=rec["outcome"]))
            for key, hist in (("ttft_s", self.ttft), ("tpot_s", self.tpot), ("e2e_s", self.e2e), ("queue_s", self.queue)):
                if rec[key] is not None:
                    hist.observe(rec[key], tags)
            for gap in rec["gaps_s"]:
                self.gap.observe(gap, tags)
            if request.num_cached_tokens:
                self.prompt_cached.inc(request.num_cached_tokens, tags)
            if rec["outcome"] in ("stop", "length"):
                result = "met" if rec["met_ttft"] and rec["met_tbt"] else "missed_ttft" if not rec["met_ttft"] else "missed_tbt"
                self.slo.inc(1, self._request_tags(request, result=result))

    def on_step(self, engine, stats, now) -> None:
        tags, cache = self._tags(), stats.cache
        self.waiting.set(cache.num_waiting, tags)
        self.running.set(cache.num_running, tags)
        by_kind = cache.pages_by_kind or {"kv": cache.num_kv_pages, "hidden": cache.num_hidden_pages}
        for kind, num in by_kind.items():
            self.pages.set(num, self._tags(kind=kind))
        self.pages.set(cache.num_free_pages, self._tags(kind="free"))
        self.target.set(cache.cache_ratio, tags)
        self.share.set(cache.hidden_share, tags)
        self.compressed.set(cache.compressed_share, tags)
        self.usage.set(cache.usage, tags)
        for kind, num in (getattr(cache, "cached_pages_by_kind", None) or {}).items():
            self.cached_pages.set(num, self._tags(kind=kind))
        hits = getattr(cache, "prefix_hit_tokens", None) or {}
        for kind, queried in (getattr(cache, "prefix_query_tokens", None) or {}).items():  # cumulative: add what is new
            hit = hits.get(kind, 0)
            seen_q, seen_h = self._prefix_seen.get(kind, (0, 0))
            if queried > seen_q:
                self.prefix_queries.inc(queried - seen_q, self._tags(kind=kind))
            if hit > seen_h:
                self.prefix_hits.inc(hit - seen_h, self._tags(kind=kind))
            self._prefix_seen[kind] = (queried, hit)
        self.sched.observe(stats.schedule_s, tags)
        self.step.observe(stats.total_s, tags)
