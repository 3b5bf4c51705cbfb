"""The cache manager: block tables per request over the shared page pool, for every cache kind.

Mechanism only: ``can_*`` methods check, their twins mutate, and allocation returns ``False``
instead of failing. The scheduler decides what to do when memory runs out.

A facade over four parts, one job each: ``block_tables.py`` (allocate, free), ``prefix_cache.py``
(names, lookups, attaching a cached prefix), ``tier.py`` (the tier below memory: swap-out / swap-in,
demoted prefix pages) and ``conversions.py`` (upgrades and compressions in place).
"""

from __future__ import annotations

from apt_serve_ray.cache.block_tables import BlockTables
from apt_serve_ray.cache.conversions import CONVERSIONS, ConversionPlan, Conversions, can_convert
from apt_serve_ray.cache.kinds import CacheKind
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.cache.prefix_cache import PrefixCache, PrefixMatch, PrefixStats, cross_kind_prefix
from apt_serve_ray.cache.swap import SwapSpace
from apt_serve_ray.cache.tier import TIER_OWNER, SwapPlan, Tier
from apt_serve_ray.request import Request

__all__ = ["CONVERSIONS", "TIER_OWNER", "CacheManager", "ConversionPlan", "PrefixMatch", "PrefixStats", "SwapPlan",
           "can_convert", "cross_kind_prefix"]


class CacheManager:
    """``enable_prefix_caching``: a request's full pages are named by a hash chain over its tokens
    once computed, and a new request (or one recomputed after preemption) starts from the longest
    named prefix of its tokens in the kind it is admitted in (``attach_prefix``), computing only the
    rest. Shared pages are full and never written: a request writes from the page after its hit on.

    Demote, don't drop: with a tier below memory, a cached page evicted during a scheduling decision
    keeps its content there, named as before, until the tier needs the slot; a request whose prefix
    continues there gets fresh pages that the step fills from the slots before it runs (``tier.py``)."""

    def __init__(self, pool: PagePool, layout: CacheLayout, swap: SwapSpace | None = None,
                 enable_prefix_caching: bool = False) -> None:
        self.pool = pool
        self.layout = layout
        self.swap = swap  # the tier below memory; None: preempted requests are recomputed
        self.prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixStats()
        self.tables = BlockTables(pool, layout)
        self.tier = Tier(pool, layout, swap, enable_prefix_caching, self.prefix_stats)
        self.prefix = PrefixCache(pool, layout, self.tier, enable_prefix_caching, self.prefix_stats)
        self.conversions = Conversions(self.tables)

    # Block tables ---------------------------------------------------------------------------------
    def num_new_pages(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> int:
        return self.tables.num_new_pages(request, num_total_tokens, kind)

    def num_pages_for(self, request: Request, num_tokens: int, kind: CacheKind) -> int:
        return self.tables.num_pages_for(request, num_tokens, kind)

    def can_allocate(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> bool:
        return self.tables.can_allocate(request, num_total_tokens, kind)

    def allocate(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> bool:
        return self.tables.allocate(request, num_total_tokens, kind)

    def free(self, request: Request) -> None:
        """Return its pages and its swap slots (whichever it holds)."""
        self.tier.free(request)
        self.tables.free(request)

    def num_cached_tokens(self, requests) -> dict[str, int]:
        return self.tables.num_cached_tokens(requests)

    # Prefix caching -------------------------------------------------------------------------------
    def block_hashes(self, request: Request, kind: CacheKind, num_blocks: int) -> list[bytes]:
        return self.prefix.block_hashes(request, kind, num_blocks)

    def segment_hashes(self, request: Request, prefix_kind: CacheKind, num_prefix_pages: int, kind: CacheKind,
                       num_blocks: int) -> list[bytes]:
        return self.prefix.segment_hashes(request, prefix_kind, num_prefix_pages, kind, num_blocks)

    def find_prefix(self, request: Request, kind: CacheKind) -> PrefixMatch | None:
        return self.prefix.find_prefix(request, kind)

    def attach_prefix(self, request: Request, kind: CacheKind) -> int:
        return self.prefix.attach_prefix(request, kind)

    def detach_prefix(self, request: Request) -> None:
        """Undo ``attach_prefix`` (its chunk did not get the rest of its pages)."""
        self.free(request)
        request.num_computed_tokens = 0

    def count_prefix_lookup(self, request: Request, num_hit: int) -> None:
        self.prefix.count_prefix_lookup(request, num_hit)

    def name_computed_pages(self, request: Request) -> None:
        self.prefix.name_computed_pages(request)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix nobody uses, in memory and in the tier (pages in use keep their
        content and names). Returns how many pages were forgotten."""
        return self.tier.reset() + self.pool.reset_prefix_cache()

    # The tier below memory ------------------------------------------------------------------------
    def begin_decision(self) -> None:
        self.tier.begin_decision()

    def abandon_decision(self) -> None:
        self.tier.abandon_decision()

    def take_tier_plans(self) -> tuple[list[SwapPlan], list[SwapPlan]]:
        return self.tier.take_tier_plans()

    @property
    def num_tier_pages(self) -> int:
        return self.tier.num_tier_pages

    def holds_request_copies(self) -> bool:
        return self.tier.holds_request_copies()

    @property
    def num_free_slots(self) -> int:
        return self.tier.num_free_slots

    def forget_tier_slots(self, slots) -> None:
        self.tier.forget_tier_slots(slots)

    def num_swap_pages(self, request: Request) -> int:
        return self.tier.num_swap_pages(request)

    def can_swap_out(self, request: Request) -> bool:
        return self.tier.can_swap_out(request)

    def swap_out(self, request: Request) -> SwapPlan | None:
        return self.tier.swap_out(request)

    def swap_in(self, request: Request, num_total_tokens: int, kind: CacheKind | None = None) -> SwapPlan | None:
        return self.tier.swap_in(request, num_total_tokens, kind)

    def undo_swap_in(self, request: Request, plan: SwapPlan) -> None:
        self.tier.undo_swap_in(request, plan)

    def drop_swapped(self, request: Request) -> None:
        self.tier.drop_swapped(request)

    # Changes of kind in place ---------------------------------------------------------------------
    def upgrade(self, request: Request, num_total_tokens: int) -> ConversionPlan | None:
        return self.conversions.upgrade(request, num_total_tokens)

    def num_private_pages(self, request: Request) -> int:
        return self.conversions.num_private_pages(request)

    def compress_gain(self, request: Request, kind: CacheKind) -> tuple[int, int]:
        return self.conversions.compress_gain(request, kind)

    def can_compress(self, request: Request, kind: CacheKind) -> bool:
        return self.conversions.can_compress(request, kind)

    def compress(self, request: Request, kind: CacheKind) -> ConversionPlan | None:
        return self.conversions.compress(request, kind)

    # Between steps --------------------------------------------------------------------------------
    def release_deferred(self) -> None:
        """After a step: the pages and slots it read come back (``BlockTables.defer``, ``Tier.swap_in``)."""
        self.tables.release_deferred()
        self.tier.release_deferred()

    def check_integrity(self, requests) -> None:
        """Both tiers, between steps: each allocator's own invariants, every page and slot of ``requests``
        referenced by it (as often as the pool counts), a request in pages or in slots but not both,
        shared pages named (only full, computed pages are shared), and nothing held by anyone else."""
        self.tier.check_integrity(self.tables.check_integrity(requests, self.swap))
