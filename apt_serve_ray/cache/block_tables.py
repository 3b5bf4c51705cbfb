"""Block tables per request over the shared page pool, for every cache kind: how many pages a request
needs, growing its table (``allocate``) and giving it back (``free``).

A request's table may start with a *prefix segment*: pages of another kind (``prefix_kind``) it shares
with others, kept as they are when its own tokens change kind. Pages a change of kind gives up are
released after the step has read them (``defer``, ``release_deferred``).
"""

from __future__ import annotations

from apt_serve_ray.cache.kinds import CacheKind
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool, retention_weight
from apt_serve_ray.request import Request


class BlockTables:
    def __init__(self, pool: PagePool, layout: CacheLayout) -> None:
        self.pool = pool
        self.layout = layout
        # Hidden pages of upgraded requests stay owned until the runner has read them this step:
        # otherwise another upgrade in the same step could receive them as KV pages and overwrite
        # them before they are read.
        self._deferred: list[tuple[list[int], str]] = []

    def num_new_pages(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> int:
        kind = kind or request.kind or CacheKind.KV
        if request.page_ids and kind is not request.kind:  # (a copy in the tier may change kind: ``swap_in``)
            raise ValueError(f"kind: request {request.request_id} holds {request.kind.value} pages, asked {kind.value}")
        return max(0, self.num_pages_for(request, num_total_tokens, kind) - len(request.page_ids))

    def num_pages_for(self, request: Request, num_tokens: int, kind: CacheKind) -> int:
        """Pages ``request`` holds for its first ``num_tokens`` tokens with its later ones in ``kind``:
        its shared prefix in another kind (``prefix_kind``), if any, and the rest in ``kind``."""
        if not request.num_prefix_pages:
            return self.layout.num_pages_for(num_tokens, kind)
        rest = max(0, num_tokens - request.num_prefix_tokens)
        return request.num_prefix_pages + self.layout.num_pages_for(rest, kind)

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
        """Return its pages (tail first: evicted first, where they are named); it holds no kind after."""
        if request.page_ids:
            self.pool.free(request.page_ids[::-1], request.request_id, retention_weight(request.priority))
        request.page_ids = []
        request.kind = None
        request.num_named_pages = 0
        clear_prefix_segment(request)

    def defer(self, pages: list[int], owner: str) -> None:
        """``owner``'s ``pages`` come back after the step (``release_deferred``): it reads them first."""
        self._deferred.append((pages, owner))

    def release_deferred(self) -> None:
        for pages, owner in self._deferred:
            self.pool.free(pages, owner)
        self._deferred.clear()

    def num_cached_tokens(self, requests) -> dict[str, int]:
        tokens = dict.fromkeys((k.value for k in CacheKind), 0)
        for request in requests:
            if request.kind is not None:
                head = request.num_prefix_tokens if request.num_prefix_pages else 0
                tokens[request.kind.value] += request.num_computed_tokens - head
                if head:
                    tokens[request.prefix_kind.value] += head
        return tokens

    def check_integrity(self, requests, swap) -> int:
        """The pool's own invariants, every page and slot (of ``swap``, the tier) of ``requests`` referenced
        by it (as often as the pool counts), a request in pages or in slots but not both, shared pages
        named (only full, computed pages are shared), and no page held by anyone else. Returns the
        slots the requests hold."""
        self.pool.check_integrity()
        num_slots = 0
        held: dict[int, int] = {}
        for r in requests:
            if r.page_ids and r.swap_slots:
                raise AssertionError(f"request {r.request_id} holds both pages and swap slots")
            if len(set(r.page_ids)) != len(r.page_ids):
                raise AssertionError(f"request {r.request_id} holds a page twice")
            if r.num_prefix_pages:
                tpp = self.layout.tokens_per_page(r.prefix_kind)
                if (r.prefix_kind is r.kind or r.num_prefix_tokens != r.num_prefix_pages * tpp
                        or not r.page_ids or r.num_prefix_tokens > r.num_computed_tokens):
                    raise AssertionError(f"request {r.request_id}: its prefix segment ({r.num_prefix_pages} "
                                         f"{r.prefix_kind} pages, {r.num_prefix_tokens} tokens) is not sound")
            for i, page in enumerate(r.page_ids):
                if r.request_id not in self.pool.owners(page):
                    raise AssertionError(f"page {page} of {r.request_id} is owned by {self.pool.owners(page)!r}")
                kind = r.prefix_kind if i < r.num_prefix_pages else r.kind
                if self.pool.kind(page) is not kind:
                    raise AssertionError(f"page {page} of {r.request_id} is {self.pool.kind(page)}, not {kind}")
                held[page] = held.get(page, 0) + 1
            for slot in r.swap_slots:
                if swap is None or swap.owner(slot) != r.request_id:
                    raise AssertionError(f"swap slot {slot} of {r.request_id} is not owned by it")
            num_slots += len(r.swap_slots)
        for page, count in held.items():
            if self.pool.refs(page) != count:
                raise AssertionError(f"page {page}: {self.pool.refs(page)} references, {count} requests hold it")
            if count > 1 and not self.pool.is_named(page):
                raise AssertionError(f"page {page} is shared by {count} requests but not named (not full)")
        if len(held) != self.pool.num_used_pages:
            raise AssertionError(f"{self.pool.num_used_pages - len(held)} pages used by no request (leaked)")
        return num_slots


def clear_prefix_segment(request: Request) -> None:
    request.prefix_kind, request.num_prefix_pages, request.num_prefix_tokens = None, 0, 0


def merge_prefix_segment(request: Request) -> None:
    """After a change of kind: a prefix segment in the request's own kind is one kind again (its
    tokens fill whole pages, so the later ones start on a page of their own either way)."""
    if request.num_prefix_pages and request.prefix_kind is request.kind:
        clear_prefix_segment(request)
