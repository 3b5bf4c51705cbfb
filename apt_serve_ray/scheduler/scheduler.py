"""The scheduling mechanism: queues, the per-step context the policies act through (``context.py``), and upkeep.

Policies decide *who* runs, in which order, with which cache kind, and whom to preempt; they do it
only through ``SchedulingContext``'s primitives, which enforce the token budget, the sequence limit
and the page pool. The mechanism never knows which policy runs.
"""

from __future__ import annotations

import time
from collections import deque

from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.cache.kinds import STORE_HIDDEN
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.scheduler.context import SchedulingContext
from apt_serve_ray.scheduler.costs import predict_step, recompute_seconds
from apt_serve_ray.scheduler.output import SchedulerOutput


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CacheManager, policy, hidden_allowed: bool,
                 max_model_len: int, compressed_kinds: tuple[CacheKind, ...] | None = None) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.cache = cache
        self.policy = policy
        # hidden_allowed gates both hidden kinds (tests flip it); compressed_kinds: the engine's offer,
        # cheapest per step first (``EngineConfig.compressed_kinds``); None: the hidden kind alone.
        self.hidden_allowed = hidden_allowed
        self._compressed = (CacheKind.HIDDEN,) if compressed_kinds is None else tuple(compressed_kinds)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cache_ratio = config.cache_ratio if self.compressed_kinds else 0.0
        self.admission_open = True  # set by the operator / cluster controller
        self.pressure_admit = True  # set by the in-engine heavy watermark
        self.num_preemptions = 0
        self.num_swap_outs = 0  # preemptions that kept the pages in the tier below memory

    # Queue upkeep ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and return its pages and swap slots. Idempotent."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.cache.free(request)
        if not request.is_finished:
            request.status = status

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def compressed_kinds(self) -> tuple[CacheKind, ...]:
        """The compressed kinds a request may get now, cheapest per step first."""
        if self.hidden_allowed:
            return self._compressed
        return tuple(k for k in self._compressed if not k.stores_hidden)

    def num_compressed_pages(self) -> int:
        pool = self.cache.pool
        return pool.num_used_pages - pool.num_used(CacheKind.KV)

    def compressed_share(self) -> float:
        """Share of the used pages held in compressed kinds (what the non-adaptive policies track)."""
        used = self.cache.pool.num_used_pages
        return self.num_compressed_pages() / used if used else 0.0

    def hidden_share(self) -> float:
        used = self.cache.pool.num_used_pages
        pool = self.cache.pool
        return sum(pool.num_used(k) for k in STORE_HIDDEN) / used if used else 0.0

    def compressed_page_limit(self) -> int:
        """The ceiling ``cache_ratio`` sets: pages of the pool that compressed kinds may hold."""
        return int(self.cache_ratio * self.cache.pool.num_pages)

    def should_swap(self, request: Request) -> bool:
        """Preempt ``request`` into the tier below memory rather than recompute it: the tier has slots
        for its pages and their round trip (out now, in on resume, at the measured seconds per page)
        costs less than recomputing its computed tokens by the policy's step-time model. Without a
        step-time model or a measured transfer cost: whenever there is room."""
        cache = self.cache
        if not cache.can_swap_out(request):
            return False
        costs = getattr(self.policy, "costs", None)
        step = costs.step_time if costs is not None else None
        transfer = cache.swap.transfer
        if step is None or transfer is None:
            return True
        recompute_s = recompute_seconds(step, request.num_computed_tokens)  # one prefill chunk, as priced
        return transfer.seconds(cache.num_swap_pages(request)) < recompute_s

    def set_cache_ratio(self, ratio: float) -> None:
        """``ratio``: already checked by whoever took it in (``config.check_share``)."""
        self.cache_ratio = ratio if self.compressed_kinds else 0.0

    def predicted_seconds(self, out: SchedulerOutput) -> float | None:
        """What the policy's step-time model predicts for ``out``'s chunks, plus what the policy priced
        its kind changes and transfers at (None: a policy without a model)."""
        costs = getattr(self.policy, "costs", None)
        predicted = predict_step(costs.step_time if costs is not None else None, out.chunks)
        return None if predicted is None else predicted + out.planned_extra_s

    def observe_sampling(self, mask_s_per_row: float, adjust_s_per_row: float) -> None:
        """Tell the policy what the sampler's extra work costs a row (``Sampler.mask_s_per_row``)."""
        observe = getattr(self.policy, "observe_sampling", None)
        if observe is not None:
            observe(mask_s_per_row, adjust_s_per_row)

    def observe_step(self, predicted_s: float | None, measured_s: float) -> None:
        """Tell the policy what a step it predicted took (``SchedulingPolicy.observe_step``)."""
        observe = getattr(self.policy, "observe_step", None)
        if predicted_s is not None and observe is not None:
            observe(predicted_s, measured_s)

    # One decision ---------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        start = time.perf_counter()
        ctx = SchedulingContext(self, time.monotonic() if now is None else now)
        self.cache.begin_decision()
        try:
            self.policy.schedule(ctx)
        except BaseException:
            self.cache.abandon_decision()
            raise
        finally:
            ctx.drop_admitted_from_waiting()
        out = ctx.output()
        out.schedule_time_s = time.perf_counter() - start
        return out
