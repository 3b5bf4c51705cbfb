"""Block tables per request over the shared page pool, for every cache kind.

Mechanism only: ``can_*`` methods check, their twins mutate, and allocation returns ``False``
instead of failing. The scheduler decides what to do when memory runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.cache.swap import SwapSpace
from apt_serve_ray.request import CacheKind, Request


@dataclass(frozen=True)
class ConversionPlan:
    """A running request changes kind in place: the ``num_tokens`` tokens held in ``src_pages`` (of
    ``from_kind``) are written into ``dst_pages`` (of ``to_kind``). An upgrade (to KV: K/V projected
    from x, dequantised, or both) or a compression (``can_convert``: quantised to the int8 kind of the
    same content). The source pages are released after the step has read them."""

    request_id: str
    num_tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    from_kind: CacheKind = CacheKind.HIDDEN
    to_kind: CacheKind = CacheKind.KV

    @property
    def is_upgrade(self) -> bool:
        return self.to_kind is CacheKind.KV


# Kinds a copy in the tier can be turned into on its way back, without recomputing: quantised as it
# is read (the int8 kind of the same content). The other way (int8 -> full precision) keeps the error,
# and KV -> hidden is impossible (x is gone): those come back in their own kind, or are recomputed.
CONVERSIONS = frozenset({(CacheKind.KV, CacheKind.KV_INT8), (CacheKind.HIDDEN, CacheKind.HIDDEN_INT8)})


def can_convert(from_kind: CacheKind | None, to_kind: CacheKind | None) -> bool:
    """Whether a copy of ``from_kind`` in the tier can come back as ``to_kind`` pages (same kind: yes)."""
    return from_kind is to_kind or (from_kind, to_kind) in CONVERSIONS


@dataclass(frozen=True)
class SwapPlan:
    """Copy a request's pages to or from the tier below memory: ``pages[i]`` <-> ``slots[i]``, every
    layer, raw bytes of ``kind``. The runner runs swap-outs before swap-ins, and both before the
    upgrades and the forward pass (pages a swap-out frees may be given out in the same step).

    A swap-in may convert (``to_kind``, see ``CONVERSIONS``): the ``num_tokens`` tokens held in
    ``slots`` (of ``kind``) are quantised into ``pages`` (of ``to_kind``, a different page count)."""

    request_id: str
    pages: list[int]
    slots: list[int]
    kind: CacheKind
    to_kind: CacheKind | None = None  # None: same kind, a byte copy
    num_tokens: int = 0  # tokens converted (conversions only)

    @property
    def is_conversion(self) -> bool:
        return self.to_kind is not None and self.to_kind is not self.kind


class CacheManager:
    def __init__(self, pool: PagePool, layout: CacheLayout, swap: SwapSpace | None = None) -> None:
        self.pool = pool
        self.layout = layout
        self.swap = swap  # the tier below memory; None: preempted requests are recomputed
        # Hidden pages of upgraded requests stay owned until the runner has read them this step:
        # otherwise another upgrade in the same step could receive them as KV pages and overwrite
        # them before they are read.
        self._deferred: list[tuple[list[int], str]] = []
        # Slots of requests swapped in this step, likewise: a swap-out in the same step runs first and
        # must not receive them and overwrite them before the swap-in reads them.
        self._deferred_slots: list[tuple[list[int], str]] = []

    def num_new_pages(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> int:
        kind = kind or request.kind or CacheKind.KV
        if request.page_ids and kind is not request.kind:  # (a copy in the tier may change kind: ``swap_in``)
            raise ValueError(f"kind: request {request.request_id} holds {request.kind.value} pages, asked {kind.value}")
        return max(0, self.layout.num_pages_for(num_total_tokens, kind) - len(request.page_ids))

    def can_allocate(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> bool:
        return self.pool.can_allocate(self.num_new_pages(request, num_total_tokens, kind))

    def allocate(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> bool:
        """Grow ``request``'s pages to hold ``num_total_tokens``. Returns False (and changes nothing)
        if the pool has too few free pages."""
        kind = kind or request.kind or CacheKind.KV
        num = self.num_new_pages(request, num_total_tokens, kind)
        if num:  # most decode steps fit in the pages held: no trip to the pool
            pages = self.pool.allocate(num, kind, request.request_id)
            if pages is None:
                return False
            request.page_ids.extend(pages)
        request.kind = request.last_kind = kind
        return True

    def free(self, request: Request) -> None:
        """Return its pages and its swap slots (whichever it holds)."""
        if request.page_ids:
            self.pool.free(request.page_ids, request.request_id)
        if request.swap_slots:
            self.swap.free(request.swap_slots, request.request_id)
        request.page_ids = []
        request.swap_slots = []
        request.kind = None

    # The tier below memory ------------------------------------------------------------------------
    def num_swap_pages(self, request: Request) -> int:
        """Pages that hold its computed tokens (what a swap-out moves)."""
        return self.layout.num_pages_for(request.num_computed_tokens, request.kind) if request.kind else 0

    def can_swap_out(self, request: Request) -> bool:
        num = self.num_swap_pages(request)
        return self.swap is not None and num > 0 and self.swap.can_allocate(num)

    def swap_out(self, request: Request) -> SwapPlan | None:
        """Move the pages holding ``request``'s computed tokens to slots and free all its pages; it keeps
        ``num_computed_tokens`` and its kind. None (nothing changed) if the tier has too few free slots."""
        num = self.num_swap_pages(request)
        slots = self.swap.allocate(num, request.request_id) if self.swap is not None and num else None
        if slots is None:
            return None
        plan = SwapPlan(request.request_id, request.page_ids[:num], slots, request.kind)
        self.pool.free(request.page_ids, request.request_id)  # pages beyond num: grown this step, empty
        request.page_ids = []
        request.swap_slots = slots
        request.num_swaps += 1
        return plan

    def swap_in(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> SwapPlan | None:
        """Pages of its kind (or of ``kind``, a conversion: ``can_convert``) for ``num_total_tokens``
        tokens; the first ones receive its slots' content. The slots are released after the step
        (``release_deferred``). None (nothing changed) without the pages."""
        from_kind, kind = request.kind, kind or request.kind
        if not can_convert(from_kind, kind):
            raise ValueError(f"kind: a {from_kind.value} copy in the tier cannot come back as {kind.value}")
        slots = request.swap_slots
        num = self.layout.num_pages_for(num_total_tokens, kind)
        if kind is from_kind:
            num = max(num, len(slots))
        pages = self.pool.allocate(num, kind, request.request_id)
        if pages is None:
            return None
        if kind is from_kind:
            plan = SwapPlan(request.request_id, pages[: len(slots)], slots, kind)
        else:
            n = request.num_computed_tokens
            plan = SwapPlan(request.request_id, pages[: self.layout.num_pages_for(n, kind)], slots, from_kind, kind, n)
        self._deferred_slots.append((plan.slots, request.request_id))
        request.page_ids = pages
        request.swap_slots = []
        request.kind = request.last_kind = kind
        return plan

    def undo_swap_in(self, request: Request, plan: SwapPlan) -> None:
        """Preempted in the step that swapped it in: its bytes are still in the slots (released only
        after the step), so it goes back to them and no copy runs either way."""
        self._deferred_slots.remove((plan.slots, request.request_id))
        self.pool.free(request.page_ids, request.request_id)
        request.page_ids = []
        request.swap_slots = plan.slots
        request.kind = request.last_kind = plan.kind

    def drop_swapped(self, request: Request) -> None:
        """Its slots cannot be trusted (the step that filled them failed): recompute it instead."""
        if request.swap_slots:
            self.swap.free(request.swap_slots, request.request_id)
            request.swap_slots = []
            request.kind = None
            request.num_computed_tokens = 0

    def upgrade(self, request: Request, num_total_tokens: int) -> ConversionPlan | None:
        """Switch a request in a compressed kind to KV pages big enough for ``num_total_tokens``; the
        runner fills them from the old pages, which come back after the step. Returns None if there is
        not enough memory."""
        if request.kind is None or not request.kind.is_compressed:
            raise ValueError(f"request {request.request_id} holds no compressed pages")
        pages = self.pool.allocate(self.layout.num_pages_for(num_total_tokens, CacheKind.KV), CacheKind.KV,
                                   request.request_id)
        if pages is None:
            return None
        plan = ConversionPlan(request.request_id, request.num_computed_tokens, list(request.page_ids), pages,
                              request.kind, CacheKind.KV)
        self._deferred.append((plan.src_pages, request.request_id))
        request.kind = request.last_kind = CacheKind.KV
        request.page_ids = pages
        request.num_upgrades += 1
        return plan

    def compress(self, request: Request, kind: CacheKind) -> ConversionPlan:
        """Switch a running request's pages to ``kind`` in place, quantising them (kv -> kv-int8,
        hidden -> hidden-int8: ``can_convert``). It needs no free page: its tokens go into the first of
        its own pages (the runner reads a layer's tokens before it writes that layer), and the rest come
        back after the step (``release_deferred``)::

            before   [p0 p1 p2 p3 p4 p5 p6]  kv, 16 tokens a page
            after    [p0 p1 p2 p3]           kv-int8, 30 tokens a page; p4-p6 freed after the step
        """
        if request.kind is None or request.kind is kind or not can_convert(request.kind, kind):
            raise ValueError(f"kind: request {request.request_id}'s {getattr(request.kind, 'value', None)} "
                             f"pages cannot be compressed to {kind.value}")
        pages, rid = list(request.page_ids), request.request_id
        num = self.layout.num_pages_for(request.num_computed_tokens, kind)
        plan = ConversionPlan(rid, request.num_computed_tokens, pages, pages[:num], request.kind, kind)
        self.pool.retag(plan.dst_pages, kind, rid)
        if pages[num:]:
            self._deferred.append((pages[num:], rid))
        request.kind = request.last_kind = kind
        request.page_ids = pages[:num]
        request.num_compressions += 1
        return plan

    def release_deferred(self) -> None:
        for pages, owner in self._deferred:
            self.pool.free(pages, owner)
        self._deferred.clear()
        for slots, owner in self._deferred_slots:
            self.swap.free(slots, owner)
        self._deferred_slots.clear()

    def check_integrity(self, requests) -> None:
        """Both tiers, between steps: each allocator's own invariants, every page and slot of ``requests``
        owned by it, a request in pages or in slots but not both, and nothing owned by anyone else."""
        self.pool.check_integrity()
        num_pages = num_slots = 0
        for r in requests:
            if r.page_ids and r.swap_slots:
                raise AssertionError(f"request {r.request_id} holds both pages and swap slots")
            for page in r.page_ids:
                if self.pool.owner(page) != r.request_id:
                    raise AssertionError(f"page {page} of {r.request_id} is owned by {self.pool.owner(page)!r}")
            for slot in r.swap_slots:
                if self.swap is None or self.swap.owner(slot) != r.request_id:
                    raise AssertionError(f"swap slot {slot} of {r.request_id} is not owned by it")
            num_pages += len(r.page_ids)
            num_slots += len(r.swap_slots)
        if num_pages != self.pool.num_used_pages:
            raise AssertionError(f"{self.pool.num_used_pages - num_pages} pages used by no request (leaked)")
        if self.swap is not None:
            self.swap.check_integrity()
            if num_slots != self.swap.num_used_slots:
                raise AssertionError(f"{self.swap.num_used_slots - num_slots} swap slots used by no request (leaked)")

    def num_cached_tokens(self, requests) -> dict[str, int]:
        tokens = dict.fromkeys((k.value for k in CacheKind), 0)
        for request in requests:
            if request.kind is not None:
                tokens[request.kind.value] += request.num_computed_tokens
        return tokens
