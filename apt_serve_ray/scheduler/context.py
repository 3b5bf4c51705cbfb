"""``SchedulingContext``: what a policy may see and do during one scheduling decision. Its primitives
enforce the token budget, the sequence limit and the page pool; ``Scheduler.schedule`` makes one per step."""

from __future__ import annotations

import operator
from collections import deque
from itertools import compress
from typing import TYPE_CHECKING

from apt_serve_ray.cache.cache_manager import CacheManager, can_convert
from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.scheduler.output import ScheduledChunk, SchedulerOutput

if TYPE_CHECKING:
    from apt_serve_ray.scheduler.scheduler import Scheduler


class SchedulingContext:
    """What a policy may see and do during one scheduling decision."""

    def __init__(self, scheduler: Scheduler, now: float) -> None:
        self._s = scheduler
        self.now = now
        self.config = scheduler.config
        self.max_model_len = scheduler.max_model_len
        self.token_budget = scheduler.config.max_num_batched_tokens
        self._chunks: dict[str, ScheduledChunk] = {}
        # Requests admitted this step stay in the waiting deque until the decision ends (or a policy
        # reads ``waiting`` again): removing each from the middle of a long queue cost O(queue) per
        # admission, and the adaptive policy admits by value, not from the head.
        self._admitted: set[int] = set()  # their id()s: dropping them must not touch every waiting request
        self._readmitted = False  # one of them was preempted again: it is in the deque twice
        self._conversions = []  # in place: upgrades and compressions
        self._preempted: list[Request] = []
        self._causes: list[str] = []
        self._swapped: list[bool] = []  # parallel to _preempted
        self._swap_outs = []
        self._swap_ins = {}  # request id -> its SwapPlan, this step
        self.planned_extra_s = 0.0  # what the policy priced kind changes and transfers at (seconds)
        self._shed: list[Request] = []
        self._prefix_found: dict[tuple[int, CacheKind], tuple[int, int, int]] = {}  # prefix_hit, this decision

    # Read-only views
    @property
    def running(self) -> list[Request]:
        return self._s.running

    @property
    def waiting(self) -> deque[Request]:
        self.drop_admitted_from_waiting()
        return self._s.waiting

    @property
    def cache(self) -> CacheManager:
        return self._s.cache

    @property
    def hidden_allowed(self) -> bool:
        return self._s.hidden_allowed

    @property
    def compressed_kinds(self) -> tuple[CacheKind, ...]:
        """The compressed kinds offered now, cheapest per step first (none when ``cache_ratio`` is 0)."""
        return self._s.compressed_kinds if self._s.cache_ratio > 0 else ()

    @property
    def cache_ratio(self) -> float:
        return self._s.cache_ratio

    @property
    def compressed_pages_left(self) -> int:
        """Pages that compressed kinds may still take under the ``cache_ratio`` ceiling."""
        return max(0, self._s.compressed_page_limit() - self._s.num_compressed_pages())

    @property
    def is_admission_open(self) -> bool:
        """Whether new requests may be admitted now (``can_admit`` is then true for every waiting one)."""
        return self._s.admission_open and self._s.pressure_admit

    @property
    def num_free_pages(self) -> int:
        return self._s.cache.pool.num_free_pages

    @property
    def num_free_swap_slots(self) -> int:
        """Slots in the tier below memory a preempted request may take (0 without one): the free ones
        and those holding demoted prefix pages."""
        return self._s.cache.num_free_slots

    def would_swap(self, request: Request) -> bool:
        """Whether preempting the running ``request`` now would keep its pages in the tier (else it
        would be recomputed): the tier has room and the transfer is cheaper (``Scheduler.should_swap``)."""
        return self._s.should_swap(request)

    @property
    def num_seqs_left(self) -> int:
        return self.config.max_num_seqs - len(self._chunks)

    @property
    def num_scheduled(self) -> int:
        return len(self._chunks)

    @property
    def preempted_this_step(self) -> bool:
        return bool(self._preempted)

    def is_scheduled(self, request: Request) -> bool:
        return request.request_id in self._chunks

    def scheduled_tokens(self, request: Request) -> int:
        """Tokens of ``request`` this step so far (0 if not scheduled)."""
        chunk = self._chunks.get(request.request_id)
        return chunk.num_tokens if chunk is not None else 0

    def is_swapping_in(self, request: Request) -> bool:
        """Whether ``request``'s pages come back from the tier below memory this step."""
        return request.request_id in self._swap_ins

    def prefix_hit(self, request: Request, kind: CacheKind | None = None) -> tuple[int, int, int]:
        """What ``request`` (holding nothing) would find in the prefix cache for ``kind`` (by default the
        kind it would be given) if admitted now: the tokens it would not compute, how many of the pages
        holding them other requests use (those cost no free page), and how many more pages than all in
        ``kind`` it would hold for its tokens and the next (a prefix segment of another kind holds them
        at that kind's density; negative where denser). (0, 0, 0) for a request holding pages or a copy
        in the tier, and without prefix caching."""
        cache = self._s.cache
        if not cache.prefix_caching or request.page_ids or request.swap_slots:
            return 0, 0, 0
        kind = kind or request.kind or self.default_kind()
        key = (id(request), kind)
        found = self._prefix_found.get(key)
        if found is None:
            match = cache.find_prefix(request, kind)  # its slots: pages that come back from the tier
            if match is None:
                found = (0, 0, 0)
            else:
                refs, lay, extra = cache.pool.refs, cache.layout, 0
                if match.prefix_kind is not None:
                    need, head = request.num_tokens + 1, match.num_prefix_pages * lay.tokens_per_page(match.prefix_kind)
                    extra = (match.num_prefix_pages + lay.num_pages_for(need - head, kind)
                             - lay.num_pages_for(need, kind))
                found = (match.num_tokens, sum(1 for p in match.pages if refs(p) > 0), extra)
            self._prefix_found[key] = found
        return found

    def tokens_to_compute(self, request: Request, kind: CacheKind | None = None) -> int:
        """``request.num_tokens_to_compute``, less what it would find in the prefix cache (``prefix_hit``)."""
        return request.num_tokens_to_compute - self.prefix_hit(request, kind)[0]

    def can_admit(self, request: Request) -> bool:
        """New requests wait while admission is closed; ones admitted before (preempted) may resume."""
        return request.first_scheduled_time is not None or self.is_admission_open

    def default_kind(self) -> CacheKind:
        """Track the target: the cheapest compressed kind while the compressed share of the used pages
        is below ``cache_ratio`` (so never above it as a share of the pool either)."""
        ratio, kinds = self._s.cache_ratio, self._s.compressed_kinds
        if kinds and ratio > 0 and (ratio >= 1.0 or self._s.compressed_share() < ratio):
            return kinds[0]
        return CacheKind.KV

    # Mutations
    def schedule(self, request: Request, num_tokens: int, kind: CacheKind | None = None) -> bool:
        """Run ``num_tokens`` more of ``request`` this step. False (nothing changed) if the token
        budget, the sequence limit or the free pages do not allow it. A swapped request comes back
        from the tier (pages of its kind, the copy planned); asked for another kind, its copy there is
        dropped and it is recomputed in that kind (that stays so even when False is returned), unless
        the copy can be converted to it on the way in (``can_convert``: quantised to its int8 kind)."""
        # Called for every request of every batch: plain attribute reads, no property chains.
        chunks, request_id = self._chunks, request.request_id
        if request_id in chunks:
            raise ValueError(f"request {request_id} is already scheduled this step")
        num_computed = request.num_computed_tokens
        if not 0 < num_tokens <= request.num_tokens - num_computed:
            raise ValueError(f"num_tokens: {num_tokens} not in [1, {request.num_tokens_to_compute}]")
        if num_tokens > self.token_budget or len(chunks) >= self.config.max_num_seqs:
            return False
        cache = self._s.cache
        swapped = bool(request.swap_slots)
        if swapped and kind is not None and not can_convert(request.kind, kind):
            # Asked for a kind its copy in the tier cannot become: that copy is of no use.
            cache.drop_swapped(request)
            num_computed, swapped = 0, False
        if request.kind is None or (swapped and kind is not None and kind is not request.kind):
            kind = kind or self.default_kind()
            if kind.is_compressed and kind not in self._s.compressed_kinds:
                raise ValueError(f"kind: the {kind.value} cache kind is disabled for this model")
        elif kind is not None and kind is not request.kind:
            raise ValueError(f"kind: request {request_id} already holds {request.kind.value} pages")
        hit = 0
        if swapped:  # back from the tier (converted to ``kind`` if asked): the copy runs before the step
            plan = cache.swap_in(request, num_computed + num_tokens, kind)
            if plan is None:
                return False
            self._swap_ins[request_id] = plan
        else:
            if request.kind is None and cache.prefix_caching:  # holds nothing: start from a cached prefix
                hit = cache.attach_prefix(request, kind)
                if hit:
                    num_computed = hit
                    num_tokens = min(num_tokens, request.num_tokens - hit)
            if not cache.allocate(request, num_computed + num_tokens, kind):
                if hit:
                    cache.detach_prefix(request)
                return False
            if cache.prefix_caching and request.status is RequestStatus.WAITING:
                cache.count_prefix_lookup(request, hit)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = min(hit, request.num_prompt_tokens)
        if request.status is RequestStatus.WAITING:
            self._admitted.add(id(request))
            self._s.running.append(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.now
        chunks[request_id] = ScheduledChunk(request, num_tokens)
        self.token_budget -= num_tokens
        return True

    def shed(self, request: Request) -> None:
        """Turn a waiting request away: it leaves the queue now and the engine ends it with an
        "overloaded" error (the server answers 503 with ``Retry-After``). Only one that holds nothing
        (no tokens computed, no copy in the tier) and was not admitted this decision."""
        if request.num_computed_tokens or request.is_swapped or id(request) in self._admitted:
            raise ValueError(f"shed: {request.request_id} holds computed tokens or was admitted")
        self._s.waiting.remove(request)
        self._shed.append(request)

    def preempt(self, request: Request, cause: str = "memory") -> None:
        """Free all pages of a running request and requeue it at the front; its generated tokens are
        kept. Its computed tokens move to the tier below memory where it has room and that is cheaper
        than recomputing them (``would_swap``), and are recomputed on resume otherwise. ``cause``:
        "memory" (it or another running request could not grow) or "policy" (displaced so that a more
        valuable waiting request gets its pages)."""
        chunk = self._chunks.pop(request.request_id, None)
        if chunk is not None:
            self.token_budget += chunk.num_tokens
        self._s.running.remove(request)
        swapped = self._swap_out_or_free(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self._s.num_preemptions += 1
        self._s.waiting.appendleft(request)
        self._readmitted = self._readmitted or id(request) in self._admitted
        self._preempted.append(request)
        self._causes.append(cause)
        self._swapped.append(swapped)

    def _swap_out_or_free(self, request: Request) -> bool:
        """Free ``request``'s pages, keeping its computed tokens in slots where that pays. True if kept."""
        cache, request_id = self._s.cache, request.request_id
        plan = self._swap_ins.pop(request_id, None)
        if plan is not None:  # swapped in this step, nothing copied yet: back to its slots, no copy
            cache.undo_swap_in(request, plan)
            self._s.num_swap_outs += 1
            return True
        converted = [p for p in self._conversions if p.request_id == request_id]
        if converted:  # its new pages are filled only when the step runs: nothing to swap, no conversion
            self._conversions.remove(converted[0])
        elif self._s.should_swap(request):
            plan = cache.swap_out(request)
            if plan is not None:
                self._swap_outs.append(plan)
                self._s.num_swap_outs += 1
                return True
        cache.free(request)
        request.num_computed_tokens = 0
        return False

    def upgrade(self, request: Request) -> bool:
        """Hidden -> KV in place for a running request (before it is scheduled this step)."""
        if self.is_scheduled(request):
            raise ValueError(f"request {request.request_id}: upgrade before scheduling it")
        if any(p.request_id == request.request_id for p in self._conversions):
            return False  # one kind change a step (its pages were just compressed, or upgraded)
        plan = self.cache.upgrade(request, request.num_computed_tokens)
        if plan is None:
            return False
        self._conversions.append(plan)
        return True

    def can_compress(self, request: Request, kind: CacheKind) -> bool:
        """Whether ``request`` (running, holding pages, not yet scheduled this step) can be compressed
        to ``kind`` in place now: the kind is offered, its pages convert to it, and where it shares
        pages (a cached prefix, not rewritten) the pool has the free ones it needs instead."""
        return (kind in self.compressed_kinds and request.kind is not None and request.kind is not kind
                and can_convert(request.kind, kind) and bool(request.page_ids) and not self.is_scheduled(request)
                and not any(p.request_id == request.request_id for p in self._conversions)
                and self._s.cache.can_compress(request, kind))

    def compress(self, request: Request, kind: CacheKind) -> bool:
        """KV -> kv-int8 (hidden -> hidden-int8) in place for a running request, before it is scheduled
        this step (``CacheManager.compress``: no free page needed; the pages it gives up are free from
        the next step). False (nothing changed) where ``can_compress`` says no."""
        if not self.can_compress(request, kind):
            return False
        plan = self.cache.compress(request, kind)
        if plan is None:
            return False
        self._conversions.append(plan)
        return True

    def drop_admitted_from_waiting(self) -> None:
        """Remove the requests admitted so far from the waiting deque, in one pass."""
        if not self._admitted:
            return
        waiting = self._s.waiting
        if self._readmitted:  # keep its first (front) entry, the one preempt() put there
            seen: set[Request] = set()
            kept = [r for r in waiting if r.status is RequestStatus.WAITING and not (r in seen or seen.add(r))]
        else:  # a long queue of cold objects: compare ids only, in C
            kept = list(compress(waiting, map(operator.not_, map(self._admitted.__contains__, map(id, waiting)))))
        waiting.clear()
        waiting.extend(kept)
        self._admitted.clear()
        self._readmitted = False

    def output(self) -> SchedulerOutput:
        """The decision. Ends it: the cache's demotions of prefix pages join the swap-outs, and its
        restores of prefix pages from the tier the swap-ins."""
        demotions, restores = self._s.cache.take_tier_plans()
        return SchedulerOutput(list(self._chunks.values()), list(self._conversions), list(self._preempted),
                               preempt_causes=list(self._causes), swap_out=list(self._swap_outs) + demotions,
                               swap_in=list(self._swap_ins.values()) + restores, preempt_swapped=list(self._swapped),
                               planned_extra_s=self.planned_extra_s, shed=list(self._shed))
