"""Block tables per request over the shared page pool, for every cache kind.

Mechanism only: ``can_*`` methods check, their twins mutate, and allocation returns ``False``
instead of failing. The scheduler decides what to do when memory runs out.
"""

from __future__ import annotations

from dataclasses import dataclass

from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.request import CacheKind, Request


@dataclass(frozen=True)
class UpgradePlan:
    """Compressed -> KV in place: K/V of ``num_tokens`` tokens held in ``hidden_pages`` (of kind
    ``from_kind``: projected from x, dequantised, or both) written into ``kv_pages``."""

    request_id: str
    num_tokens: int
    hidden_pages: list[int]  # the source pages, whatever their kind
    kv_pages: list[int]
    from_kind: CacheKind = CacheKind.HIDDEN


class CacheManager:
    def __init__(self, pool: PagePool, layout: CacheLayout) -> None:
        self.pool = pool
        self.layout = layout
        # Hidden pages of upgraded requests stay owned until the runner has read them this step:
        # otherwise another upgrade in the same step could receive them as KV pages and overwrite
        # them before they are read.
        self._deferred: list[tuple[list[int], str]] = []

    def num_new_pages(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> int:
        kind = kind or request.kind or CacheKind.KV
        if request.kind is not None and kind is not request.kind:
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
        if request.page_ids:
            self.pool.free(request.page_ids, request.request_id)
        request.page_ids = []
        request.kind = None

    def upgrade(self, request: Request, num_total_tokens: int) -> UpgradePlan | None:
        """Switch a request in a compressed kind to KV pages big enough for ``num_total_tokens``; the
        runner fills them from the old pages. Returns None if there is not enough memory."""
        if request.kind is None or not request.kind.is_compressed:
            raise ValueError(f"request {request.request_id} holds no compressed pages")
        num = self.layout.num_pages_for(num_total_tokens, CacheKind.KV)
        kv_pages = self.pool.allocate(num, CacheKind.KV, request.request_id)
        if kv_pages is None:
            return None
        plan = UpgradePlan(request.request_id, request.num_computed_tokens, list(request.page_ids), kv_pages,
                           request.kind)
        self._deferred.append((plan.hidden_pages, request.request_id))
        request.kind = request.last_kind = CacheKind.KV
        request.page_ids = kv_pages
        request.num_upgrades += 1
        return plan

    def release_deferred(self) -> None:
        for pages, owner in self._deferred:
            self.pool.free(pages, owner)
        self._deferred.clear()

    def num_cached_tokens(self, requests) -> dict[str, int]:
        tokens = dict.fromkeys((k.value for k in CacheKind), 0)
        for request in requests:
            if request.kind is not None:
                tokens[request.kind.value] += request.num_computed_tokens
        return tokens
