"""EngineReplica: one ``AsyncLLMEngine`` per Serve replica (one per GPU, or per CPU slot).

The engine's loop thread steps continuously; ``generate`` takes an ``EngineRequest`` and streams
each new token back to the caller as a ``StreamItem`` (``handle.options(stream=True).generate.remote(
request)``); a request the engine refuses gets one ``InvalidRequest`` instead (see ``deployments/wire.py``).
Tokens that pile up while Ray is still sending the previous item travel together (``coalesced``).

The replica's ``LoadReport`` goes to the request router through ``record_routing_stats`` (Serve polls
it) and to the cluster controller through a heartbeat whose reply (``Knobs``) carries this replica's
knobs: Serve has no way to call every replica of a deployment, so the replicas report in and the
controller answers. Whether the controller marked it pressured goes back out in the next load report,
so the request router steers around it without a call of its own.

The replica also keeps the engine's metrics (``EngineMetrics`` into Ray's metrics) and its memory
timeline (``CacheTracker``; ``memory_timeline()`` draws it).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import io
import logging
import time
from typing import Literal, Optional

import ray
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, PositiveFloat
from ray import serve
from ray.serve import context as serve_context

from apt_serve_ray import AsyncLLMEngine, EngineConfig
from apt_serve_ray.worker import cpu_affinity
from apt_serve_ray.engine.process import EngineObservers
from apt_serve_ray.observability.tracing import finished_spans
from apt_serve_ray.observability.tracker import plot_memory_timeline
from deployments.autoscaling import RECEIVED_METRIC
from deployments.metrics import make_backend, snapshot
from deployments.streaming import coalesced, stream_interval
from deployments.wire import RECEIVED_WINDOW_S, EngineRequest, InvalidRequest, Knobs, LoadReport, StreamItem

logger = logging.getLogger("ray.serve")


def _route_engine_logs() -> None:
    """The engine library logs to "apt_serve_ray" (what it chose at start-up: dtype, attention backend,
    hybrid cache on/off); in a replica those lines go where Serve writes this replica's log."""
    engine_logger = logging.getLogger("apt_serve_ray")
    if not engine_logger.handlers:
        engine_logger.setLevel(logging.INFO)
        for handler in logger.handlers:
            engine_logger.addHandler(handler)
        engine_logger.propagate = not logger.handlers


def replica_seed(base: int, replica_id: str) -> int:
    """The engine seed of one replica: the configured seed mixed with the replica's id."""
    digest = hashlib.blake2b(f"{base}:{replica_id}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def make_engine_client(path: str | None, config: EngineConfig, **kwargs):
    """The replica's engine client: ``AsyncLLMEngine(config, **kwargs)``, or with ``path`` ("module:callable")
    what that callable returns for the same arguments. Raises ValueError naming ``engine_client`` when the
    path is malformed or does not import."""
    if path is None:
        return AsyncLLMEngine(config, **kwargs)
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"engine_client: expected 'module:callable', got {path!r}")
    try:
        factory = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"engine_client: cannot import {path!r}: {exc}") from exc
    return factory(config, **kwargs)


class ReplicaOptions(BaseModel):
    """An engine replica's settings besides its ``EngineConfig``, validated once (``app.py`` builds them
    from the app's arguments, where their defaults are; the replica has none of its own).

    ``report_interval_s``: how often the replica reports its load to the controller. ``pin_cpus``: give
    the engine's compute thread CPUs of its own (``apt_serve_ray.worker.cpu_affinity``) and keep this
    process's other threads off them; needs ``num_threads``. ``stream_interval_s``: after the first
    token, a request's stream sends at most one item per this many seconds (the tokens in between travel
    together), and never more than a quarter of the request's TBT target (``deployments.streaming``).
    ``stream_items_per_s``: the items per second this replica sends over all its streams, once
    ``stream_interval_s`` would send more: with n streams each waits ``n / stream_items_per_s`` (still at
    most a quarter of its TBT target); None: no such bound. ``model_name``, ``tracing_exporter``,
    ``mirror_metrics``: the metric tag, where spans go, whether metric values are kept in memory too.
    ``yield_to_engines``: with the engine in a process of its own, put this node's Ray processes (this
    replica's too) under ``SCHED_BATCH``, so that their wake-ups wait for the tick instead of preempting the
    engine's threads (``cpu_affinity.yield_to_engines``).
    ``engine_client``: "module:callable" that builds the replica's engine client from the engine config,
    ``observers=`` and ``metrics_backend=``, an object with ``AsyncLLMEngine``'s interface (a fake in
    tests, an engine elsewhere); None: ``AsyncLLMEngine`` (``make_engine_client``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model_name: str
    report_interval_s: PositiveFloat
    pin_cpus: bool
    stream_interval_s: NonNegativeFloat
    stream_items_per_s: Optional[PositiveFloat]
    tracing_exporter: Literal["none", "console", "otlp", "memory"]
    mirror_metrics: bool
    engine_client: Optional[str]
    yield_to_engines: bool


@serve.deployment(max_ongoing_requests=256, health_check_period_s=5.0)
class EngineReplica:
    async def __init__(self, engine_config: EngineConfig, controller, options: ReplicaOptions) -> None:
        """``engine_config``: its watermarks are the ones the memory timeline draws (in the app, the
        controller's; the engine's own rule is off there); with ``engine_config.engine_process`` the
        engine, its spans and its timeline live in a process of its own, and its metrics are replayed
        here. ``controller``: the controller's handle (None: no heartbeat)."""
        self._stream_interval_s, self._stream_items_per_s = options.stream_interval_s, options.stream_items_per_s
        self._num_streams = 0  # requests past their first token, streaming
        _route_engine_logs()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        # Unseeded sampling draws from the engine's generator: one seed per replica, or every replica
        # would draw the same numbers. Requests with their own ``seed`` are reproducible on any replica.
        engine_config = engine_config.replace(seed=replica_seed(engine_config.seed, self.replica_id))
        compute_cpus = None
        if options.pin_cpus and engine_config.num_threads and engine_config.cpu_affinity is None:
            rank = getattr(context, "rank", None)
            compute_cpus = cpu_affinity.engine_cpus(getattr(rank, "local_rank", 0) or 0, engine_config.num_threads)
            if compute_cpus is not None:
                engine_config = engine_config.replace(cpu_affinity=tuple(compute_cpus))
        self._metrics = make_backend({}, options.mirror_metrics)
        observers = EngineObservers(
            metric_tags={"model": options.model_name, "replica": self.replica_id},
            tracing_exporter=options.tracing_exporter, tracker=True, tracker_min_interval_s=0.1,
            tracker_max_samples=36_000)
        self.engine = make_engine_client(options.engine_client, engine_config, observers=observers,
                                         metrics_backend=self._metrics)
        self.actor_name = ray.get_runtime_context().get_actor_name()
        self.model = engine_config.model
        self._default_tbt_slo_ms = engine_config.default_tbt_slo_ms
        if engine_config.cpu_affinity:
            # Ray's threads here (and those it starts later, which inherit) go to the other CPUs; the
            # engine's loop thread, started next, pins itself to its own.
            rest = [c for c in cpu_affinity.available_cpus() if c not in engine_config.cpu_affinity]
            if rest:
                cpu_affinity.pin_process_threads(rest)
                moved = cpu_affinity.keep_ray_processes_off(rest)
                logger.info("engine replica %s: compute on CPUs %s, other threads (and %d Ray processes of "
                            "this node) on %s", self.replica_id, list(engine_config.cpu_affinity), moved, rest)
        self.engine.start()
        if options.yield_to_engines and engine_config.engine_process and options.engine_client is None:
            changed = cpu_affinity.yield_to_engines()
            logger.info("engine replica %s: %d Ray processes of this node (this one too) under SCHED_BATCH; the "
                        "engine's process keeps SCHED_OTHER", self.replica_id, changed)
        self.num_requests = 0
        self.num_aborted = 0  # callers that went away (disconnect, cancel) before the end
        # Requests received but not yet prefilled hold no pages yet; the router must still count
        # them, so the load reports their prompt pages (one entry per call in progress).
        self._pending_pages: dict[object, int] = {}
        # (when, Serve's internal request id) of the generate calls received lately, for LoadReport.received.
        self._received: collections.deque[tuple[float, str]] = collections.deque()
        self._tokens_per_page = self.engine.cache_stats().kv_tokens_per_page
        self._applied_ratio: float | None = None
        self._is_pressured = False  # the controller's last word, passed on to the request router
        self._controller = controller
        self._runtime_loras: dict[str, str] = {}  # adapters registered here at run time: {name: path}
        self._lora_lock = asyncio.Lock()
        self._report_interval_s = options.report_interval_s
        self._reporter = asyncio.create_task(self._report_loop()) if controller is not None else None
        logger.info("engine replica %s ready: model %s, %d pages", self.replica_id, self.model,
                    self.engine.cache_stats().num_pages)

    # Requests -------------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest, replica_id: str | None = None):
        """``StreamItem``s of one request, or one ``InvalidRequest`` if the engine refuses it.
        (``replica_id`` pins the call to this replica, for tests and load tools; see ``FitAwareRequestRouter``.)"""
        if not isinstance(request, EngineRequest):
            yield InvalidRequest(f"request: must be a deployments.wire.EngineRequest, got {type(request).__name__}")
            return
        if request.lora_name is not None and request.lora_path is not None:
            error = await self._hold_lora(request.lora_name, request.lora_path)
            if error is not None:
                yield InvalidRequest(error)
                return
        stream = self.engine.generate(request.prompt, request.sampling, request.request_id,
                                      **request.scheduling_kwargs())
        self.num_requests += 1
        self._note_received()
        finished = False
        key = object()  # not the request id: it may be None (then the engine makes one)
        self._pending_pages[key] = -(-(request.num_prompt_tokens or 0) // self._tokens_per_page) + 1
        async with contextlib.aclosing(stream):  # closing it aborts the request and frees its pages
            try:
                first = await anext(stream)
            except ValueError as exc:
                yield InvalidRequest(str(exc))
                return
            finally:
                self._pending_pages.pop(key, None)
            try:
                yield self._item(first, first=True)
                finished = first.finished
                if not finished:
                    merge = lambda outs: StreamItem.merge([self._item(o) for o in outs])  # noqa: E731
                    interval = functools.partial(self._interval_s, request)
                    self._num_streams += 1
                    try:
                        async with contextlib.aclosing(coalesced(stream, merge, interval)) as items:
                            async for item in items:
                                yield item
                                finished = item.is_final
                    finally:
                        self._num_streams -= 1
            finally:
                if not finished:
                    self.num_aborted += 1

    def _note_received(self) -> None:
        var = getattr(serve_context, "_serve_request_context", None)  # Serve's own (private) context
        context = var.get() if var is not None else None
        internal_id = getattr(context, "_internal_request_id", "") if context is not None else ""
        if internal_id:
            self._received.append((time.time(), internal_id))
            self._forget_received()

    def _forget_received(self) -> None:
        horizon = time.time() - RECEIVED_WINDOW_S
        while self._received and self._received[0][0] < horizon:
            self._received.popleft()

    def _interval_s(self, request: EngineRequest) -> float:
        """How long a stream item of this request waits for more tokens: ``stream_interval_s``, or
        longer while this replica's streams would together send more than ``stream_items_per_s``;
        at most a quarter of the request's TBT target (its own or the engine's default), so the pacing
        never costs a request its gap target."""
        tbt_ms = request.tbt_slo_ms if request.tbt_slo_ms is not None else self._default_tbt_slo_ms
        return stream_interval(self._stream_interval_s, self._num_streams, self._stream_items_per_s, tbt_ms)

    def _item(self, out, first: bool = False) -> StreamItem:
        c, m = out.outputs[0], out.metrics
        engine_ttft_s = None
        if (first or out.finished) and m is not None and m.first_token_time is not None:
            engine_ttft_s = m.first_token_time - m.arrival_time
        logprobs = None if c.logprobs is None else tuple(c.logprobs)  # a delta: the new tokens' only
        item = StreamItem(c.delta_text, tuple(c.delta_token_ids), logprobs=logprobs, engine_ttft_s=engine_ttft_s)
        if first:
            item = dataclasses.replace(item, replica_id=self.replica_id, num_prompt_tokens=out.num_prompt_tokens)
        if out.finished:
            e2e = None
            if engine_ttft_s is not None:  # as the engine saw it, for overhead studies
                e2e = (m.finish_time or m.last_token_time) - m.arrival_time
            item = dataclasses.replace(item, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                       num_output_tokens=out.num_output_tokens, error=out.error, engine_e2e_s=e2e,
                                       num_cached_tokens=out.num_cached_tokens)
        return item

    # Control --------------------------------------------------------------------------------------
    def set_cache_ratio(self, ratio: float) -> None:
        self.engine.set_cache_ratio(ratio)
        self._applied_ratio = ratio

    def set_admission(self, open_: bool) -> None:
        self.engine.set_admission(open_)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and replaces it."""
        self.engine.check_health()

    def load(self) -> LoadReport:
        return LoadReport.from_engine(
            self.engine.cache_stats(),  # the engine's snapshot after its last step or command
            self.engine.config, max_model_len=self.engine.max_model_len, step_time_ms=self.engine.step_time_ms,
            replica_id=self.replica_id, actor_name=self.actor_name, model=self.model, time=time.time(),
            num_pending_pages=sum(self._pending_pages.values()), num_requests=self.num_requests,
            num_aborted=self.num_aborted, is_pressured=self._is_pressured, received=self._received_ids())

    def _received_ids(self) -> tuple[str, ...]:
        self._forget_received()
        return tuple(internal_id for _, internal_id in self._received)

    def record_routing_stats(self) -> dict:
        """Serve requires a dict here; ``FitAwareRequestRouter`` reads it back as a ``LoadReport``."""
        return self.load().to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve samples this while the deployment autoscales: the generate calls received so far, a counter
        the forecast policy turns into arrivals (``deployments/autoscaling.py``)."""
        return {RECEIVED_METRIC: float(self.num_requests)}

    # Observability --------------------------------------------------------------------------------
    def memory_timeline(self, format: str = "png", replica_id: str | None = None) -> bytes | dict:
        """This replica's cache-memory timeline: a PNG, or ``format="json"`` for the recorded series.
        (``replica_id`` pins the call to this replica; see ``FitAwareRequestRouter``.)"""
        timeline = self.engine.memory_timeline()
        if format == "json":
            return {"replica_id": self.replica_id, **timeline}
        buf = io.BytesIO()
        plot_memory_timeline(timeline["series"], timeline["crossings"], buf, light=timeline["light_watermark"],
                             heavy=timeline["heavy_watermark"], title=f"cache memory by kind, replica {self.replica_id}")
        return buf.getvalue()

    def metrics_snapshot(self) -> dict:
        """The engine's metric values kept in memory (``mirror_metrics``; {} otherwise), for tests."""
        return snapshot(self._metrics)

    def finished_spans(self) -> list[dict]:
        """Spans of this replica (and of its engine process) under the "memory" tracing exporter, for tests."""
        return finished_spans() + self.engine.engine_process_spans()

    # LoRA adapters loaded at run time ----------------------------------------------------------------
    async def _hold_lora(self, name: str, path: str) -> str | None:
        """Register the run-time adapter ``name`` with the engine if this replica has not yet (the engine
        loads it into a slot, the least recently used idle one making room, or holds the request until
        one is free); None, or why it cannot be."""
        async with self._lora_lock:
            if name in self._runtime_loras:
                return None
            try:
                await self.engine.add_lora(name, path)
            except ValueError as exc:
                if "already loaded" not in str(exc):  # else: loaded at start (lora_modules)
                    return str(exc)
            self._runtime_loras[name] = path
            return None

    async def _drop_loras(self, keep: dict[str, str]) -> None:
        """Unload the run-time adapters the controller no longer lists (or lists at another path)."""
        async with self._lora_lock:
            for name in [n for n, p in self._runtime_loras.items() if keep.get(n) != p]:
                del self._runtime_loras[name]
                try:
                    await self.engine.remove_lora(name)
                except ValueError as exc:
                    logger.warning("engine replica %s: unloading LoRA adapter %s: %s", self.replica_id, name, exc)

    # Heartbeat to the controller ------------------------------------------------------------------
    async def _report_loop(self) -> None:
        while True:
            try:
                knobs: Knobs = await asyncio.wait_for(self._controller.report.remote(self.load()),
                                                      timeout=max(2.0, 4 * self._report_interval_s))
                if knobs.cache_ratio != self._applied_ratio:
                    self.set_cache_ratio(knobs.cache_ratio)
                self._is_pressured = knobs.is_pressured
                if knobs.adapters is not None and self._runtime_loras:
                    await self._drop_loras(knobs.adapters)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the controller may be restarting; keep serving
                logger.warning("engine replica %s: controller report failed: %r", self.replica_id, exc)
            await asyncio.sleep(self._report_interval_s)

    def __del__(self) -> None:
        if getattr(self, "_reporter", None) is not None:
            self._reporter.cancel()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()
