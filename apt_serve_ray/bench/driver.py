"""Replay a request trace in real time against an in-process engine and record what happened.

``replay`` is the offline half of the serving benchmark (SPEC section 3): requests enter the engine
when their arrival time comes, the engine steps continuously in between, and every token's time is
kept. Clock: the engine's own (``time.monotonic``, or the simulator's). Request ``i`` is given
``arrival_time = t0 + trace[i].arrival_s`` -- its *scheduled* arrival, not the moment the loop got
round to adding it -- so time spent waiting for the current step to end counts as queueing, as it
would for a client whose request lands mid-step.

Each run must leave the engine idle with every page free, so one engine (one model load) serves a
whole rate sweep; ``reset`` checks it. A request not finished ``timeout_s`` after the last arrival
is aborted and reported as unfinished (``starved`` if it never got a first token); a correct
scheduler reports zero of both. Memory is recorded by a ``CacheTracker`` for the run.

``replay_simulated`` is the same replay on ``simulator.SimulatedEngine``: the same engine with a
cost-model runner, on a clock that jumps over idle time instead of sleeping.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from apt_serve_ray.bench.slo_metrics import RequestTimeline, p99_gap_ms, summarize, ttft_ms
from apt_serve_ray.bench.workloads import TraceRequest, fill_token_ids
from apt_serve_ray.observability.tracker import CacheTracker, plot_memory_timeline
from apt_serve_ray.sampling.params import SamplingParams

_IDLE_S = 0.001  # after a step that could run nothing (e.g. admission closed), before the next


@dataclass
class RunResult:
    timelines: list[RequestTimeline]
    duration_s: float  # first arrival -> last finish (or the timeout)
    num_pages: int
    num_preemptions: int
    num_unfinished: int
    num_starved: int  # unfinished and never got a first token
    peak_pages: dict[str, int]  # max over steps, per cache kind and "total"
    # CacheTracker.timeline() of the run: a sample after every step ("t" since the first arrival),
    # watermark crossings, the watermarks; the shape a replica's memory_timeline() has.
    memory: dict
    schedule_s: list[float] = field(default_factory=list)  # scheduler time per iteration
    step_s: list[float] = field(default_factory=list)  # whole step time per iteration
    final_kinds: dict[str, int] = field(default_factory=dict)  # cache kind each request ended with
    num_upgrades: int = 0
    preempt_causes: dict[str, int] = field(default_factory=dict)  # "memory" / "policy", as the scheduler says
    # One record per step that ran (``step_record``): when it ended (seconds since the first arrival),
    # how long it took and was predicted to take, and what it held; what explains a long gap.
    steps: list[dict] = field(default_factory=list)
    start_s: float = 0.0  # the clock time of the first arrival (timelines are on the same clock)

    def summary(self) -> dict:
        """``slo_metrics.summarize`` (vLLM's figures + attainment) plus the engine's own figures."""
        s = summarize(self.timelines, self.duration_s)
        sched_ms = np.asarray(self.schedule_s) * 1000.0
        s.update(
            num_requests=len(self.timelines), num_unfinished=self.num_unfinished, num_starved=self.num_starved,
            num_preemptions=self.num_preemptions, num_upgrades=self.num_upgrades, num_steps=len(self.step_s),
            num_pages=self.num_pages, peak_pages=dict(self.peak_pages), final_kinds=dict(self.final_kinds),
            preempt_causes=dict(self.preempt_causes),
            mean_schedule_ms=float(sched_ms.mean()) if sched_ms.size else 0.0,
            p99_schedule_ms=float(np.percentile(sched_ms, 99)) if sched_ms.size else 0.0,
            mean_step_ms=float(np.mean(self.step_s) * 1000.0) if self.step_s else 0.0,
            ttft_misses=sum(1 for t in self.timelines if _misses(t)[0]),
            tbt_misses=sum(1 for t in self.timelines if _misses(t)[1]),
        )
        return s

    def plot_memory_timeline(self, path, title: str | None = None) -> str:
        """The run's pages by kind, usage and hidden target over time (``CacheTracker``'s plot)."""
        m = self.memory
        return plot_memory_timeline(m["series"], m["crossings"], path, light=m["light_watermark"],
                                    heavy=m["heavy_watermark"], title=title or "cache memory by kind")


def step_record(stats, end_s: float) -> dict:
    """A compact record of one step (``StepStats.as_record``) that ended ``end_s`` seconds into the run."""
    return {"end_s": round(end_s, 6), **stats.as_record(), "running": stats.cache.num_running,
            "waiting": stats.cache.num_waiting, "usage": round(stats.cache.usage, 4),
            "cache_ratio": stats.cache.cache_ratio}


def _engine(llm_or_engine):
    return getattr(llm_or_engine, "llm_engine", llm_or_engine)


def _misses(t: RequestTimeline) -> tuple[bool, bool]:
    """(missed TTFT, missed the P99 gap) -- the two ways a finished request fails its SLOs."""
    ttft = ttft_ms(t)
    miss_ttft = ttft is None or (t.ttft_slo_ms is not None and ttft >= t.ttft_slo_ms)
    miss_tbt = t.tbt_slo_ms is not None and t.is_finished and p99_gap_ms(t) >= t.tbt_slo_ms
    return miss_ttft, miss_tbt


def reset(llm_or_engine) -> None:
    """Check the engine is idle with every page free (so the next run starts from the same state)."""
    engine = _engine(llm_or_engine)
    if engine.has_unfinished_requests() or engine.requests:
        raise RuntimeError(f"engine is not idle: {engine.scheduler.num_unfinished} requests unfinished")
    pool = engine.cache.pool
    engine.cache.release_deferred()
    pool.check_integrity()
    if pool.num_free_pages != pool.num_pages:
        raise RuntimeError(f"engine is idle but {pool.num_used_pages} of {pool.num_pages} pages are in use")


def replay(llm_or_engine, trace: list[TraceRequest], *, ttft_slo_ms: float | None = None,
           tbt_slo_ms: float | None = None, progress: bool = True, timeout_s: float = 600.0,
           desc: str = "replay", seed: int = 0, run_id: str | None = None,
           wait_until: Callable[[float], None] | None = None) -> RunResult:
    """Replay ``trace`` in real time. SLOs given here apply to requests that carry none of their own
    (the engine's defaults to those left without either). Request ids are ``run_id/trace id``.
    ``wait_until(t)`` lets idle time pass until clock time ``t``: by default sleeping (at most 50 ms
    at a time), a simulated clock's ``advance_to`` in ``replay_simulated``."""
    engine = _engine(llm_or_engine)
    if not trace:
        raise ValueError("trace: must hold at least one request")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
    reset(engine)
    if any(r.prompt_token_ids is None for r in trace):
        trace = fill_token_ids(trace, engine.vocab_size, seed)
    trace = sorted(trace, key=lambda r: r.arrival_s)
    prefix = f"{run_id}/" if run_id else ""
    pool, sched, clock = engine.cache.pool, engine.scheduler, engine.clock
    if wait_until is None:
        def wait_until(t: float) -> None:
            time.sleep(max(0.0, min(t - clock(), 0.05)))
    preempt0 = sched.num_preemptions

    bar = _progress_bar(len(trace), desc, progress)
    t0 = clock() + 0.01 - trace[0].arrival_s  # the clock time of trace offset 0
    start = t0 + trace[0].arrival_s
    deadline = t0 + trace[-1].arrival_s + timeout_s
    tracker = CacheTracker(engine, start=start)
    requests, finals = {}, {}
    schedule_s, step_s, steps = [], [], []
    causes: dict[str, int] = {}
    next_i = 0
    try:
        while True:
            now = clock()
            while next_i < len(trace) and t0 + trace[next_i].arrival_s <= now:
                tr = trace[next_i]
                params = SamplingParams(max_tokens=tr.output_len, ignore_eos=True, temperature=0.0)
                req = engine.add_request(list(tr.prompt_token_ids), params, prefix + tr.request_id,
                                         arrival_time=t0 + tr.arrival_s, ttft_slo_ms=tr.ttft_slo_ms or ttft_slo_ms,
                                         tbt_slo_ms=tr.tbt_slo_ms or tbt_slo_ms, priority=tr.priority)
                requests[req.request_id] = req
                next_i += 1
            busy = engine.has_unfinished_requests()
            if (next_i == len(trace) and not busy) or now > deadline:
                break
            if not busy:  # idle until the next arrival
                wait_until(t0 + trace[next_i].arrival_s)
                continue
            outputs = engine.step()
            stats = engine.last_step
            if stats is None:
                wait_until(clock() + _IDLE_S)
            else:
                step_s.append(stats.total_s)
                schedule_s.append(stats.schedule_s)
                steps.append(step_record(stats, clock() - start))
                for cause in stats.preempt_causes:
                    causes[cause] = causes.get(cause, 0) + 1
                if len(step_s) % 20 == 0:
                    c = stats.cache
                    bar.set_postfix(run=c.num_running, wait=c.num_waiting, pages=f"{c.usage:.0%}", refresh=False)
            for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
        end = clock()
        for rid, req in requests.items():  # timed out: abort, so the engine is idle again
            if rid not in finals and not req.is_finished:
                engine.abort_request(rid)
    finally:
        tracker.detach()
        bar.close()
    reset(engine)

    timelines = [request_timeline(tr, t0, requests.get(prefix + tr.request_id), finals.get(prefix + tr.request_id),
                           prefix, ttft_slo_ms, tbt_slo_ms) for tr in trace]
    finished = [finals[t.request_id] for t in timelines if t.is_finished]
    kinds: dict[str, int] = {}
    for out in finished:
        kinds[out.metrics.cache_kind] = kinds.get(out.metrics.cache_kind, 0) + 1
    unfinished = [t for t in timelines if not t.is_finished]
    last = max((t.finish_s for t in timelines if t.is_finished), default=start)
    duration = (max(last, end) if unfinished else last) - start
    memory = tracker.timeline()
    series = memory["series"]
    by_kind = {k: series.get(k) or [0] for k in ("kv", "hidden", "kv-int8", "hidden-int8")}
    peak = {k: max(v) for k, v in by_kind.items()}
    peak["total"] = max(map(sum, zip(*(v for v in by_kind.values() if len(v) == len(by_kind["kv"])))))
    return RunResult(
        timelines, max(duration, 1e-9), pool.num_pages, sched.num_preemptions - preempt0, len(unfinished),
        sum(1 for t in unfinished if t.first_token_s is None), peak, memory, schedule_s, step_s, kinds,
        sum(out.metrics.num_upgrades for out in finished), causes, steps, start,
    )


def replay_simulated(sim, trace: list[TraceRequest], *, ttft_slo_ms: float | None = None,
                     tbt_slo_ms: float | None = None) -> RunResult:
    """``replay`` on a ``simulator.SimulatedEngine``: step times come from its cost model and idle
    time is skipped, so a run takes milliseconds and is deterministic. For diagnosis beside real
    runs. No timeout: every request runs to its end."""
    return replay(sim, trace, ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tbt_slo_ms, progress=False, timeout_s=math.inf,
                  wait_until=sim.clock.advance_to)


def request_timeline(tr: TraceRequest, t0: float, req, out, prefix: str, ttft_slo_ms, tbt_slo_ms) -> RequestTimeline:
    """The finished request's timeline from its final output; otherwise what it got before the end."""
    rid = prefix + tr.request_id
    if out is not None and out.error is None:
        m = out.metrics
        return RequestTimeline(rid, m.arrival_time, m.first_token_time, list(m.token_times), m.finish_time,
                               tr.prompt_len, len(out.outputs[0].token_ids), req.ttft_slo_ms, req.tbt_slo_ms,
                               num_preemptions=m.num_preemptions)
    times = list(req.token_times) if req is not None else []
    return RequestTimeline(
        rid, t0 + tr.arrival_s, times[0] if times else None, times, None, tr.prompt_len, len(times),
        req.ttft_slo_ms if req is not None else ttft_slo_ms, req.tbt_slo_ms if req is not None else tbt_slo_ms,
        error=(out.error if out is not None else None) or "unfinished",
        num_preemptions=req.num_preemptions if req is not None else 0)


def measure_unloaded_latency(llm_or_engine, trace_like: list[TraceRequest], *, num_requests: int = 3,
                             output_len: int = 32, quantile: float = 0.9, seed: int = 0) -> dict:
    """TTFT and TPOT of one request at a time on an idle engine: the base of ``--slo-scale``.

    The prompt is as long as the ``quantile`` of the trace's prompt lengths (so a scaled TTFT SLO is
    met unloaded by that share of requests); each of ``num_requests`` runs alone, the medians are
    returned. TPOT is the median gap between tokens after the first. Doubles as a warm-up.
    """
    engine = _engine(llm_or_engine)
    if not trace_like:
        raise ValueError("trace_like: must hold at least one request")
    prompt_len = int(np.quantile([r.prompt_len for r in trace_like], quantile, method="higher"))
    prompt_len = max(1, min(prompt_len, engine.max_model_len - output_len - 1))
    probe = [TraceRequest(f"unloaded-{i}", 0.0, prompt_len, output_len) for i in range(num_requests)]
    ttfts, tpots = [], []
    for i, r in enumerate(fill_token_ids(probe, engine.vocab_size, seed)):
        result = replay(engine, [r], progress=False, run_id=f"unloaded{i}-{time.monotonic_ns()}")
        t = result.timelines[0]
        if not t.is_finished:
            raise RuntimeError(f"unloaded probe did not finish: {t.error}")
        ttfts.append((t.first_token_s - t.arrival_s) * 1000.0)
        tpots.append(float(np.median(np.diff(t.token_times_s))) * 1000.0)
    return {"ttft_ms": float(np.median(ttfts)), "tpot_ms": float(np.median(tpots)),
            "prompt_len": prompt_len, "output_len": output_len, "num_requests": num_requests}


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False, dynamic_ncols=True,
                mininterval=0.5)
