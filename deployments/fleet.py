"""The fleet simulator: engine replicas behind the request router and the controller, on one
simulated clock, where every decision is the server's own code (no copies):

- each replica is an ``LLMEngine`` (``simulator.SimulatedEngine``: the real scheduler, policy, page pool
  and prefix cache) whose model runner takes a cost model's step time (``gpu_cost.GpuCostModel`` for a
  GPU, ``simulator.CostModel`` for the CPU figures) on the replica's own clock;
- the router is ``FitAwareRequestRouter.choose_replicas`` over the replicas' ``LoadReport``s (refreshed
  every ``routing_stats_period_s``, as Serve does) behind the router's ``AdmissionQueue``, with the
  controller's hold and in-flight limit applied the way ``router.py`` applies them;
- the controller is ``ClusterControl``, fed every ``control_interval_s`` with each replica's report and
  the arrivals, its knobs (cache ratio, pressure flag) set on the replicas;
- replica start-up delay, failures (a replica's requests end with an error, Serve starts another) and
  an autoscaling policy (a function of the fleet each ``autoscale_interval_s``: replicas wanted) are
  events on the same clock.

Time: events in time order (arrivals, replica steps, stats refreshes, control ticks). A replica's step
runs when its previous step ends and advances that replica's clock by the cost model's time; a request
routed meanwhile is stamped with its arrival time and waits for the next step. Load reports are read
after a replica's last step, i.e. up to one step ahead of what a real replica reports (its step is
computed whole when it starts). Wall time per routing decision is measured (``router_s``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID

from apt_serve_ray.bench.driver import request_timeline
from apt_serve_ray.bench.simulator import SimulatedClock, SimulatedEngine
from apt_serve_ray.bench.slo_metrics import RequestTimeline
from apt_serve_ray.bench.workloads import TraceRequest
from apt_serve_ray.sampling.params import SamplingParams
from deployments.admission import AdmissionQueue, QueueFull, Ticket
from deployments.admission_gate import steer
from deployments.cluster_control import ClusterControl, ControlSettings
from deployments.prefix_affinity import PrefixIndex
from deployments.request_router import FitAwareRequestRouter, request_pages
from deployments.wire import RECEIVED_WINDOW_S, ArrivalCount, EngineRequest, LoadReport

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="fleet")


@dataclass(frozen=True)
class FleetSettings:
    num_replicas: int = 1  # at the start
    routing_stats_period_s: float = 1.0  # the app's default (``AppArgs.routing_stats_period_s``)
    control_interval_s: float = 0.5
    output_horizon_tokens: int = 256
    max_queued: int = 100_000  # the routers' admission line
    startup_s: float = 60.0  # a replica asked for at t serves from t + startup_s
    failures: tuple[tuple[float, int], ...] = ()  # (time, index of the replica among those up) it dies
    autoscale_interval_s: float = 1.0  # Ray's controller runs the policy every 0.1 s; metrics move every 6-10 s
    min_replicas: int = 1
    max_replicas: int = 256

    def __post_init__(self) -> None:
        if not 1 <= self.num_replicas <= self.max_replicas:
            raise ValueError(f"num_replicas: must be in [1, max_replicas={self.max_replicas}], got {self.num_replicas}")
        for name in ("routing_stats_period_s", "control_interval_s", "autoscale_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0 seconds, got {getattr(self, name)!r}")
        if self.startup_s < 0:
            raise ValueError(f"startup_s: must be >= 0 seconds, got {self.startup_s!r}")


@dataclass
class _Replica:
    rid: ReplicaID
    sim: SimulatedEngine
    view: SimpleNamespace  # what the request router reads: ``replica_id``, ``routing_stats``
    up_at: float
    draining: bool = False
    stepping: bool = False
    received: deque = field(default_factory=deque)  # (time, request id)
    requests: dict = field(default_factory=dict)  # request id -> (TraceRequest, the engine's Request, admitted at)
    pressured: bool = False
    num_received: int = 0  # generate calls so far (``EngineReplica.record_autoscaling_stats``)
    answered: set = field(default_factory=set)  # requests with a first token (the router's TTFT average)

    @property
    def busy(self) -> bool:
        return bool(self.sim.scheduler.num_unfinished)


@dataclass
class FleetResult:
    timelines: list[RequestTimeline]
    duration_s: float
    router_s: list[float]  # wall seconds of each routing decision (admission + replica choice)
    replicas: list[tuple[float, int, int]]  # (time, replicas held, replicas serving) at each change
    replica_seconds: float  # replicas held (starting, serving or draining) integrated over the run
    decisions: int = 0  # the controller's


class FleetSimulator:
    """``make_engine()``: a new replica's engine (a ``SimulatedEngine``, its clock its own)."""

    def __init__(self, make_engine: Callable[[], SimulatedEngine], settings: FleetSettings = FleetSettings(),
                 control: ControlSettings | None = None,
                 autoscaler: Callable[["FleetSimulator"], int] | None = None) -> None:
        self.make_engine, self.settings, self.autoscaler = make_engine, settings, autoscaler
        self.clock = SimulatedClock()
        self.router = FitAwareRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN, get_curr_time_s=self.clock)
        self.router.initialize_state(output_horizon_tokens=settings.output_horizon_tokens)
        self.router.prefixes = PrefixIndex()  # its own, not the process's (simulators share a process)
        self.control = ClusterControl(control, wall_clock=self.clock) if control is not None else None
        self.replicas: dict[str, _Replica] = {}
        self._ids = itertools.count()
        self._events: list = []
        self._seq = itertools.count()
        self.admission: AdmissionQueue | None = None
        self.arrivals = ArrivalCount("fleet", 0, 0, 0)
        self._built: dict[str, EngineRequest] = {}  # admitted or waiting for a slot, not routed yet
        self.num_decisions = 0  # the controller's
        self._replica_log: list[tuple[float, int, int]] = []
        self._unroutable: deque[TraceRequest] = deque()  # admitted while no replica serves: Serve's handle queues them

    # Replicas -------------------------------------------------------------------------------------
    def add_replica(self, delay_s: float = 0.0) -> _Replica:
        n = next(self._ids)
        rid = ReplicaID(unique_id=f"r{n}", deployment_id=DEPLOYMENT)
        r = _Replica(rid, self.make_engine(), SimpleNamespace(replica_id=rid, routing_stats={}),
                     self.clock.now + delay_s)
        self.replicas[rid.unique_id] = r
        self._push(r.up_at, "up", r)
        self._note_replicas()
        return r

    def serving(self) -> list[_Replica]:
        return [r for r in self.replicas.values() if r.up_at <= self.clock.now and not r.draining]

    @property
    def num_held(self) -> int:
        return len(self.replicas)

    def scale_to(self, wanted: int) -> None:
        """Start or drain replicas so ``wanted`` are held (a drained replica leaves once idle)."""
        s = self.settings
        wanted = max(s.min_replicas, min(s.max_replicas, wanted))
        live = [r for r in self.replicas.values() if not r.draining]
        for _ in range(wanted - len(live)):
            self.add_replica(s.startup_s)
        if wanted < len(live):
            starting = [r for r in live if r.up_at > self.clock.now]
            idle_first = sorted(live, key=lambda r: (r.up_at <= self.clock.now, r.sim.scheduler.num_unfinished))
            for r in (starting + [r for r in idle_first if r not in starting])[: len(live) - wanted]:
                r.draining = True
                self._note_replicas()
                self._maybe_leave(r)

    def _maybe_leave(self, r: _Replica) -> None:
        if r.draining and not r.busy:
            del self.replicas[r.rid.unique_id]
            self.router.on_replica_actor_died(r.rid)
            self._note_replicas()

    def _fail(self, index: int) -> None:
        up = self.serving()
        if not up:
            return
        r = up[index % len(up)]
        del self.replicas[r.rid.unique_id]
        self.router.on_replica_actor_died(r.rid)
        for tr, req, _ in r.requests.values():  # their clients see the stream end with an error
            self._finish(tr, None, req, error="replica died")
            self.admission.release()
        self.add_replica(self.settings.startup_s)  # Serve replaces it

    # Events ---------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, data=None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def run(self, trace: list[TraceRequest], until_s: float | None = None) -> FleetResult:
        """Every request of ``trace`` to its end (or ``until_s``, default an hour after the last arrival:
        requests still unfinished then end as "unfinished")."""
        s = self.settings
        self._finals: dict[str, RequestTimeline] = {}
        self._router_s: list[float] = []
        for _ in range(s.num_replicas):
            self.add_replica()
        engine = next(iter(self.replicas.values())).sim
        self._tokens_per_page = engine.cache.layout.block_size
        # The router's in-flight slots, as the app sizes them: every replica's max_num_seqs, for the most replicas.
        self._max_in_flight = engine.config.max_num_seqs * s.max_replicas
        self.admission = AdmissionQueue(self._max_in_flight, s.max_queued, clock=self.clock)
        for tr in trace:
            self._push(tr.arrival_s, "arrive", tr)
        for t, index in s.failures:
            self._push(t, "fail", index)
        end = until_s if until_s is not None else max((tr.arrival_s for tr in trace), default=0.0) + 3600.0
        for kind, period in (("stats", s.routing_stats_period_s), ("control", s.control_interval_s)):
            self._push(0.0, kind, period)
        if self.autoscaler is not None:
            self._push(s.autoscale_interval_s, "scale", s.autoscale_interval_s)
        self._remaining = len(trace)
        while self._events and self._remaining > 0:
            t, _, kind, data = heapq.heappop(self._events)
            if t > end:
                break
            self.clock.advance_to(t)
            getattr(self, f"_on_{kind}")(data)
        last = self._replica_log[-1] if self._replica_log else (0.0, 0, 0)
        held_s = sum((b[0] - a[0]) * a[1] for a, b in zip(self._replica_log, self._replica_log[1:]))
        held_s += (self.clock.now - last[0]) * last[1]
        timelines = [self._finals.get(tr.request_id) or request_timeline(tr, 0.0, None, None, "", None, None)
                     for tr in trace]
        return FleetResult(timelines, self.clock.now, self._router_s, self._replica_log, held_s, self.num_decisions)

    def _note_replicas(self) -> None:
        self._replica_log.append((self.clock.now, self.num_held, len(self.serving())))

    def _on_up(self, r: _Replica) -> None:
        if r.rid.unique_id in self.replicas:
            self._refresh(r)
            self.router._replicas[r.rid] = r.view  # what update_replicas does, without actor handles
            self._note_replicas()
            while self._unroutable:
                self._route(self._unroutable.popleft())

    def _on_stats(self, period: float) -> None:
        for r in self.serving():
            self._refresh(r)
        self._push(self.clock.now + period, "stats", period)

    def _on_control(self, period: float) -> None:
        now = self.clock.now
        if self.control is not None:
            self.control.observe_arrivals(self.arrivals, now)
            self.arrivals = ArrivalCount("fleet", 0, 0, 0)
            reports = []
            for r in self.replicas.values():  # draining ones too: their memory is still in use
                if r.up_at <= now:
                    reports.append(self._report(r))
                    knobs = self.control.report(reports[-1], now)
                    r.sim.llm_engine.adjust_cache_ratio(knobs.cache_ratio)
                    r.pressured = knobs.is_pressured
            self.num_decisions += len(self.control.step(now))
            # What the router's poll does with the controller's state (admission_gate.steer).
            steer(self.admission, self._max_in_flight, self.control.admission_limit, not self.control.cluster.admit,
                  (x.max_running_priority for x in reports))
        self._push(now + period, "control", period)

    def _on_scale(self, period: float) -> None:
        self.scale_to(self.autoscaler(self))
        self._push(self.clock.now + period, "scale", period)

    def _on_fail(self, index: int) -> None:
        self._fail(index)

    # Requests -------------------------------------------------------------------------------------
    def _on_arrive(self, tr: TraceRequest) -> None:
        now = self.clock.now
        self.arrivals = ArrivalCount("fleet", self.arrivals.num_requests + 1, self.arrivals.num_prompt_tokens + tr.prompt_len,
                                     self.arrivals.num_output_tokens + tr.output_len)
        self._built[tr.request_id] = request = _engine_request(tr)  # once: _route takes it from here
        pages = request_pages(request, self._tokens_per_page, self.settings.output_horizon_tokens)
        ticket = Ticket(pages, (tr.ttft_slo_ms or 1e9) / 1000, tr.priority, arrival=now)
        start = time.perf_counter()
        try:
            # A slot granted later is routed as an event of its own: routing inside the grant could end a
            # request (refused), release its slot and grant the next, one inside the other.
            if self.admission.offer(ticket, lambda: self._push(self.clock.now, "route", tr) or True):
                self._route(tr, start)
        except QueueFull:
            self._built.pop(tr.request_id)
            self._finish(tr, None, None, error="queue full")

    def _on_route(self, tr: TraceRequest) -> None:
        self._route(tr)

    def _route(self, tr: TraceRequest, start: float | None = None) -> None:
        start = time.perf_counter() if start is None else start
        candidates = [r.view for r in self.serving()]
        if not candidates:
            self._unroutable.append(tr)  # until a replica is up
            return
        request = self._built.pop(tr.request_id)
        pending = SimpleNamespace(args=(request,), kwargs={}, routing_context=SimpleNamespace(should_backoff=False),
                                  metadata=SimpleNamespace(call_method="generate", internal_request_id=tr.request_id))
        ranked = _run(self.router.choose_replicas(candidates, pending))
        self._router_s.append(time.perf_counter() - start)
        r = self.replicas[ranked[0][0].replica_id.unique_id]
        r.received.append((self.clock.now, tr.request_id))
        r.num_received += 1
        clock, ahead = r.sim.clock, r.sim.clock.now  # ahead: the end of the step it is in
        clock.now = self.clock.now
        try:
            r.requests[tr.request_id] = (tr, r.sim.llm_engine.add_request(
                list(request.prompt), request.sampling, tr.request_id, ttft_slo_ms=tr.ttft_slo_ms,
                tbt_slo_ms=tr.tbt_slo_ms, priority=tr.priority), self.clock.now)
        except ValueError as exc:  # the engine refuses it (too long for its context): a 400 to its client
            self._finish(tr, None, None, error=f"invalid: {exc}")
            self.admission.release()
            return
        finally:
            clock.now = max(ahead, self.clock.now)
        if not r.stepping:
            r.stepping = True
            self._push(self.clock.now, "step", r)

    def _on_step(self, r: _Replica) -> None:
        if r.rid.unique_id not in self.replicas:
            return  # it failed
        r.sim.clock.advance_to(self.clock.now)
        engine = r.sim.llm_engine
        outputs = engine.step()
        for out in outputs:
            entry = r.requests.get(out.request_id)
            if entry is None:
                continue
            tr, req, admitted = entry
            if req.token_times and out.request_id not in r.answered:
                r.answered.add(out.request_id)
                self.admission.observe_ttft(req.token_times[0] - admitted)  # as the router times it
            if out.finished:
                del r.requests[out.request_id]
                r.answered.discard(out.request_id)
                self._finish(tr, out, req)
                self.admission.release()
        if r.busy:
            self._push(r.sim.clock.now, "step", r)
        else:
            r.stepping = False
            self._maybe_leave(r)

    def _finish(self, tr: TraceRequest, out, req, error: str | None = None) -> None:
        if tr.request_id in self._finals:
            return
        t = request_timeline(tr, 0.0, req, out, "", tr.ttft_slo_ms, tr.tbt_slo_ms)
        t.arrival_s = tr.arrival_s  # the client's: a request the admission line held arrived before its engine saw it
        if error is not None:
            t.error = error
        self._finals[tr.request_id] = t
        self._remaining -= 1

    # Reports --------------------------------------------------------------------------------------
    def _report(self, r: _Replica) -> LoadReport:
        engine, now = r.sim.llm_engine, self.clock.now
        while r.received and r.received[0][0] < now - RECEIVED_WINDOW_S:
            r.received.popleft()
        tpp = self._tokens_per_page  # prompts received and not answered yet, as the replica counts them
        pending = sum(-(-len(req.prompt_token_ids) // tpp) + 1 for _, req, _ in r.requests.values() if not req.token_times)
        return LoadReport.from_engine(
            engine.cache_stats(), engine.config, max_model_len=engine.runner.max_model_len, step_time_ms=0.0,
            replica_id=r.rid.unique_id, actor_name=r.rid.unique_id, model="sim", time=now,
            num_pending_pages=pending, num_requests=0, num_aborted=0, is_pressured=r.pressured,
            received=tuple(rid for _, rid in r.received))

    def _refresh(self, r: _Replica) -> None:
        r.view.routing_stats = self._report(r).to_dict()


def _engine_request(tr: TraceRequest) -> EngineRequest:
    return EngineRequest(list(tr.prompt_token_ids or [7] * tr.prompt_len),
                         SamplingParams(max_tokens=tr.output_len, ignore_eos=True), request_id=tr.request_id,
                         priority=tr.priority, ttft_slo_ms=tr.ttft_slo_ms, tbt_slo_ms=tr.tbt_slo_ms)


def _run(coroutine):
    """The value of a coroutine that never awaits (``choose_replicas`` does not), without a loop."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    raise RuntimeError("choose_replicas awaited: the fleet simulator drives it without an event loop")


def replica_hours(result: FleetResult) -> float:
    return result.replica_seconds / 3600.0
