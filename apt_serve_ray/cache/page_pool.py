"""One pool of fixed-size pages shared by every cache kind, with prefix caching.

The pool knows nothing about models or policy: it hands out page ids (from the slot allocator the
swap tier also stands on, ``slots.py``), counts who references each page and of which kind it is,
and says "no" (returns ``None``) when there are not enough free pages. Whom to preempt is the
scheduler's decision, never the pool's.

A page is in one of three states::

    free        on the free list: no reference, no content anyone can find
    referenced  held by one or more requests (``refs`` > 0); shared pages are full and never written
    cached      no reference, but named by a hash (``register``) and findable (``lookup``): it counts
                as free capacity and is evicted when the free list runs dry, least valuable first

A full page's name is a hash chain over its tokens (``CacheManager`` computes it; the kind is part
of it), so a request whose prompt starts with the same tokens can take the page instead of computing
it again. Requests release their pages tail first, so a chain's last pages are evicted before its
head, which other requests are likelier to share.

Which cached page goes first (``retention``): ``"lru"``, the least recently released (vLLM's rule);
``"value"`` (the default), LRU with a head start for pages worth more: a page released into the cache
ranks as if released ``RETENTION_SPAN * num_pages * log2(worth)`` page releases later, where ``worth``
is the prefill a page of its kind saves over a KV page's (a hidden page holds twice the tokens:
worth 2) times the weight of the most important request that released it (``retention_weight``:
1 at priority 0, halved every 10 points of priority value). So a gold tenant's system prompt
(priority -10) outlives a batch job's (priority 10) by a whole pool's turnover, and still ages out
once enough newer pages have been released after it. Recency stays the signal within a class:
measured on the conversation trace (``benchmarks/prefix_reuse.py sim``), ranking by how often a page
was taken (GreedyDual-Size-Frequency) kept finished conversations' histories and lost hits.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict

from apt_serve_ray.cache.slots import SlotAllocator
from apt_serve_ray.request import CacheKind


RETENTIONS = ("value", "lru")
PRIORITY_HALVING = 10  # every this many points of priority value (less important) halve a page's weight
RETENTION_SPAN = 0.5  # head start of a page worth 2x, in pool turnovers (page releases / num_pages)


def retention_weight(priority: int) -> float:
    """How much a request's importance counts in what its cached pages are worth: 1 at priority 0,
    halved every ``PRIORITY_HALVING`` points of priority value (lower is more important, as in vLLM)."""
    return 2.0 ** (-max(-100, min(100, priority)) / PRIORITY_HALVING)


class PagePool:
    def __init__(self, num_pages: int, retention: str = "value") -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        if retention not in RETENTIONS:
            raise ValueError(f"retention: must be one of {list(RETENTIONS)}, got {retention!r}")
        self.num_pages = num_pages
        self.retention = retention
        self._slots = SlotAllocator(num_pages, what="page")  # free list, references, owners
        self._kind: list[CacheKind | None] = [None] * num_pages
        self._num_used = dict.fromkeys(CacheKind, 0)  # referenced pages by kind
        self._hash: list[bytes | None] = [None] * num_pages
        self._by_hash: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced named pages, LRU first
        self._num_cached = dict.fromkeys(CacheKind, 0)  # those by kind
        self._num_named = dict.fromkeys(CacheKind, 0)  # named pages (referenced or not) by kind
        # "value" retention: per named page the largest weight released with it; per cached page its
        # rank (release order plus its head start), in a heap (stale entries skipped when popped).
        self._weight = [0.0] * num_pages
        self._rank = [0.0] * num_pages
        self._heap: list[tuple[float, int, int]] = []
        self._order = itertools.count()  # page releases into the cache
        self.page_value = dict.fromkeys(CacheKind, 1.0)  # prefill a page of each kind saves, KV's = 1 (its owner sets it)
        self.num_evictions = 0
        # Told of every cached page evicted (page, its name, its kind) before it is given out: the cache
        # manager may keep its content in the tier below memory (``CacheManager``: demote, don't drop).
        self.on_evict = None

    @property
    def num_free_pages(self) -> int:
        """Pages a request may be given now: the free list and the cached pages nobody references."""
        return self._slots.num_free + len(self._cached)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_free_pages(self) -> int:
        """Unreferenced pages kept for a later hit (part of ``num_free_pages``)."""
        return len(self._cached)

    @property
    def num_hashed_pages(self) -> int:
        """Pages findable by ``lookup``, referenced or not."""
        return len(self._by_hash)

    def num_named(self, kind: CacheKind) -> int:
        """Pages of ``kind`` findable by ``lookup``: none, and no request can find a prefix in it."""
        return self._num_named[kind]

    def num_used(self, kind: CacheKind) -> int:
        return self._num_used[kind]

    def num_cached(self, kind: CacheKind) -> int:
        """Unreferenced cached pages of ``kind``."""
        return self._num_cached[kind]

    def owner(self, page: int) -> str | None:
        """One owner of ``page`` (None if nobody references it); ``owners`` for all of them."""
        return self._slots.owner(page)

    def owners(self, page: int) -> dict[str, int]:
        return self._slots.owners(page)

    def refs(self, page: int) -> int:
        return self._slots.refs(page)

    def kind(self, page: int) -> CacheKind | None:
        return self._kind[page]

    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    def can_allocate(self, num: int) -> bool:
        return num <= self.num_free_pages

    def allocate(self, num: int, kind: CacheKind, owner: str) -> list[int] | None:
        """``num`` fresh pages (free ones first, then the least recently released cached ones, which
        lose their name)."""
        if num < 0:
            raise ValueError(f"num: must be >= 0, got {num}")
        if num > self.num_free_pages:
            return None
        from_free = min(num, self._slots.num_free)
        pages = self._slots.allocate(from_free, owner)
        for _ in range(num - from_free):
            page = self._victim()
            self._num_cached[self._kind[page]] -= 1
            if self.on_evict is not None:
                self.on_evict(page, self._hash[page], self._kind[page])
            self._forget(page)
            self.num_evictions += 1
            self._slots.claim(page, owner)
            pages.append(page)
        for page in pages:
            self._kind[page] = kind
        self._num_used[kind] += num
        return pages

    def take(self, pages: list[int], owner: str) -> None:
        """``owner`` references named pages it found (``lookup``): a prefix cache hit."""
        for page in pages:
            if self._hash[page] is None:
                raise RuntimeError(f"page {page} is not a cached page")
            if self._slots.refs(page) == 0:
                del self._cached[page]
                self._num_cached[self._kind[page]] -= 1
                self._num_used[self._kind[page]] += 1
            self._slots.add_ref(page, owner)

    def retag(self, pages: list[int], kind: CacheKind, owner: str) -> None:
        """Pages only ``owner`` references change kind (a request compressed in place rewrites them):
        they lose their name, their content changes."""
        for page in pages:
            if owner not in self._slots.owners(page):
                raise RuntimeError(f"page {page} is owned by {self._slots.owner(page)!r}, not {owner!r}")
            if self._slots.refs(page) != 1:
                raise RuntimeError(f"page {page} is shared ({self._slots.refs(page)} references): it cannot be rewritten")
            self._forget(page)
            self._num_used[self._kind[page]] -= 1
            self._kind[page] = kind
            self._num_used[kind] += 1

    def free(self, pages: list[int], owner: str, weight: float = 1.0) -> None:
        """``owner`` drops one reference to each page. A page nobody references any more goes back to
        the free list, or, if it is named, stays findable as a cached page (most recently released
        last: pass a request's pages tail first). ``weight``: the owner's importance to what its
        named pages are worth (``retention_weight``)."""
        for page in pages:
            if self._hash[page] is not None and weight > self._weight[page]:
                self._weight[page] = weight
            if not self._slots.release(page, owner):
                continue
            self._num_used[self._kind[page]] -= 1
            if self._hash[page] is not None:
                self._cached[page] = None
                self._num_cached[self._kind[page]] += 1
                if self.retention == "value":
                    self._push(page)
            else:
                self._kind[page] = None
                self._slots.put_free(page)

    # Names ----------------------------------------------------------------------------------------
    def register(self, page: int, block_hash: bytes) -> bool:
        """Name a referenced, full page by ``block_hash`` so later requests can find it. False (and
        nothing changes) if another page already has that name or this page has one."""
        if self._slots.refs(page) == 0:
            raise RuntimeError(f"page {page} is not referenced: only a request's own pages are named")
        if block_hash in self._by_hash or self._hash[page] is not None:
            return False
        self._hash[page] = block_hash
        self._by_hash[block_hash] = page
        self._num_named[self._kind[page]] += 1
        return True

    def lookup(self, block_hashes) -> list[int]:
        """The pages named by the longest prefix of ``block_hashes`` found."""
        pages = []
        get = self._by_hash.get
        for block_hash in block_hashes:
            page = get(block_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def uncache(self, page: int) -> None:
        """``page`` loses its name (its content is about to change); unreferenced, it becomes free."""
        if self._hash[page] is None:
            return
        self._forget(page)
        if self._slots.refs(page) == 0:
            del self._cached[page]
            self._num_cached[self._kind[page]] -= 1
            self._kind[page] = None
            self._slots.put_free(page)

    def is_named(self, page: int) -> bool:
        return self._hash[page] is not None

    def _forget(self, page: int) -> None:
        block_hash = self._hash[page]
        if block_hash is not None:
            del self._by_hash[block_hash]
            self._hash[page] = None
            self._weight[page] = 0.0
            self._num_named[self._kind[page]] -= 1

    # Retention ------------------------------------------------------------------------------------
    def worth(self, page: int) -> float:
        """What a named page is worth (``retention`` "value"): the prefill it saves over a KV page's,
        times the weight of the most important request that released it."""
        return max(self._weight[page], 1e-6) * self.page_value[self._kind[page]]

    def _push(self, page: int) -> None:
        order = next(self._order)
        rank = self._rank[page] = order + RETENTION_SPAN * self.num_pages * math.log2(self.worth(page))
        heapq.heappush(self._heap, (rank, order, page))
        if len(self._heap) > 4 * len(self._cached) + 64:  # mostly stale entries: rebuild
            self._heap = [(self._rank[p], i, p) for i, p in enumerate(self._cached)]
            heapq.heapify(self._heap)

    def _victim(self) -> int:
        """The cached page to evict next (taken out of ``_cached``)."""
        if self.retention == "lru":
            page, _ = self._cached.popitem(last=False)
            return page
        heap, cached, rank = self._heap, self._cached, self._rank
        while True:
            value, _, page = heapq.heappop(heap)
            if page in cached and rank[page] == value:
                break
        del cached[page]
        return page

    def reset_prefix_cache(self) -> int:
        """Forget the cached pages nobody references (they become free). Pages in use keep their
        names until released. Returns how many were forgotten."""
        pages = list(self._cached)
        for page in pages:
            self.uncache(page)
        return len(pages)

    def check_integrity(self) -> None:
        """Every page in exactly one state; counters, owners and names consistent."""
        cached = set(self._cached)
        self._slots.check_integrity(aside=cached)
        referenced = self._slots.held()
        for page in range(self.num_pages):
            if page not in referenced and page not in cached and (self._kind[page] is not None
                                                                   or self._hash[page] is not None):
                raise AssertionError(f"free page {page} keeps a kind or a name")
        for page in cached:
            if self._hash[page] is None or self._kind[page] is None:
                raise AssertionError(f"cached page {page} has no name or no kind")
        for page in range(self.num_pages):
            if self._hash[page] is None and self._weight[page]:
                raise AssertionError(f"page {page} has no name but keeps its weight")
        if len(self._by_hash) != sum(h is not None for h in self._hash):
            raise AssertionError("names and named pages disagree")
        for block_hash, page in self._by_hash.items():
            if self._hash[page] != block_hash:
                raise AssertionError(f"page {page} is found under a name it does not have")
        for kind in CacheKind:
            named = sum(1 for p in self._by_hash.values() if self._kind[p] is kind)
            if named != self._num_named[kind]:
                raise AssertionError(f"{kind.value}: {named} named pages, counted {self._num_named[kind]}")
        for kind in CacheKind:
            counted = sum(1 for p in referenced if self._kind[p] is kind)
            if counted != self._num_used[kind]:
                raise AssertionError(f"{kind.value} pages: counter {self._num_used[kind]} != referenced {counted}")
            counted = sum(1 for p in cached if self._kind[p] is kind)
            if counted != self._num_cached[kind]:
                raise AssertionError(f"cached {kind.value} pages: counter {self._num_cached[kind]} != {counted}")
