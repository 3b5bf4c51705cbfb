"""Prefix caching over the page pool: a request's full pages are named by a hash chain over its tokens
once computed, and a new request (or one recomputed after preemption) starts from the longest named
prefix of its tokens in the kind it is admitted in (``attach_prefix``), computing only the rest.
Shared pages are full and never written: a request writes from the page after its hit on.

Each kind's chain starts from its own seed (a page's name says what it holds). A request admitted
in one kind may take a prefix held in another (a *prefix segment*, ``cross_kind_prefix``); the pages
it computes after it are named by a chain that goes on from the segment's last name. Pages demoted
to the tier below memory (``tier.py``) are found by the same names and come back into fresh pages.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from apt_serve_ray.cache.kinds import KINDS, CacheKind
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.cache.tier import Tier
from apt_serve_ray.request import Request


def cross_kind_prefix(prefix_kind: CacheKind, kind: CacheKind) -> bool:
    """Whether a request admitted in ``kind`` may take a cached prefix held in ``prefix_kind`` as its
    prefix segment: where the segment stores K/V (read as it is), or the request stores x anyway (it
    pays the projection for its whole context either way). A hidden prefix in front of K/V pages
    would add a projection per step that the step-time model does not price."""
    return not prefix_kind.stores_hidden or kind.stores_hidden


@dataclass(frozen=True)
class PrefixMatch:
    """What ``CacheManager.find_prefix`` found for a request admitted in ``kind``: ``pages`` in memory,
    in order (the first ``num_prefix_pages`` of them in ``prefix_kind``, a prefix segment, where that
    is not None), then ``slots`` of the tier holding the ``kind`` pages that follow."""

    kind: CacheKind
    pages: list[int]
    slots: list[int]
    num_tokens: int
    prefix_kind: CacheKind | None = None
    num_prefix_pages: int = 0


# The hash chain of each kind starts from its own seed: a page's name says what it holds.
_SEEDS = {kind: hashlib.blake2b(f"apt-serve-ray/{kind.value}".encode(), digest_size=16).digest() for kind in CacheKind}


def _seed(kind: CacheKind, salt: str | None, lora=None) -> bytes:
    """Where a request's chain starts: its kind's seed, salted by its ``cache_salt`` if it has one, and by
    its LoRA adapter's key if it has one (in a hash of its own, so that no salt reads as an adapter)."""
    seed = _SEEDS[kind] if salt is None else hashlib.blake2b(_SEEDS[kind] + salt.encode(), digest_size=16).digest()
    if lora is None:
        return seed
    return hashlib.blake2b(seed + lora.key.encode(), digest_size=16, person=b"apt-lora").digest()


class PrefixStats:
    """Prefix cache lookups at admission, per kind: tokens asked for and tokens found (in memory or
    brought back from the tier: ``tier_hits`` of them), pages demoted to the tier."""

    def __init__(self) -> None:
        self.queries = dict.fromkeys((k.value for k in CacheKind), 0)
        self.hits = dict.fromkeys((k.value for k in CacheKind), 0)
        self.tier_hits = dict.fromkeys((k.value for k in CacheKind), 0)
        self.num_demoted = 0

    def hit_rate(self) -> float:
        queries = sum(self.queries.values())
        return sum(self.hits.values()) / queries if queries else 0.0


class PrefixCache:
    def __init__(self, pool: PagePool, layout: CacheLayout, tier: Tier, enabled: bool, stats: PrefixStats) -> None:
        self.pool = pool
        self.layout = layout
        self.tier = tier
        self.enabled = enabled
        self.stats = stats
        # What a cached page of each kind is worth to the pool's retention: the prefill it saves.
        pool.page_value = {kind: max(layout.tokens_per_page(kind), 1) / layout.block_size for kind in CacheKind}

    def block_hashes(self, request: Request, kind: CacheKind, num_blocks: int) -> list[bytes]:
        """The names of ``request``'s first ``num_blocks`` full pages of ``kind``: each hashes its
        parent's name and its tokens. Computed once per request and kind (its known tokens only grow);
        the list returned may hold more names than asked for."""
        chain = request.block_hashes.setdefault(kind, [])
        if len(chain) < num_blocks:
            tpp, tokens = self.layout.tokens_per_page(kind), request.all_token_ids
            parent = chain[-1] if chain else _seed(kind, request.cache_salt, request.lora)
            for i in range(len(chain), num_blocks):
                parent = hashlib.blake2b(parent + array("q", tokens[i * tpp:(i + 1) * tpp]).tobytes(),
                                         digest_size=16).digest()
                chain.append(parent)
        return chain

    def segment_hashes(self, request: Request, prefix_kind: CacheKind, num_prefix_pages: int, kind: CacheKind,
                       num_blocks: int) -> list[bytes]:
        """The names of the first ``num_blocks`` full pages of ``kind`` that ``request`` holds after a
        prefix of ``num_prefix_pages`` pages of ``prefix_kind``: the chain goes on from the prefix's
        last name and ``kind``'s seed (the content of a page depends on the kind the context before it
        was read in, so the names say both the split and the kinds)."""
        key = (prefix_kind, num_prefix_pages, kind)
        chain = request.block_hashes.setdefault(key, [])
        if len(chain) < num_blocks:
            tpp, tokens = self.layout.tokens_per_page(kind), request.all_token_ids
            start = num_prefix_pages * self.layout.tokens_per_page(prefix_kind)
            if chain:
                parent = chain[-1]
            else:
                last = self.block_hashes(request, prefix_kind, num_prefix_pages)[num_prefix_pages - 1]
                parent = hashlib.blake2b(last + _SEEDS[kind], digest_size=16).digest()
            for i in range(len(chain), num_blocks):
                parent = hashlib.blake2b(
                    parent + array("q", tokens[start + i * tpp:start + (i + 1) * tpp]).tobytes(), digest_size=16).digest()
                chain.append(parent)
        return chain

    def find_prefix(self, request: Request, kind: CacheKind) -> PrefixMatch | None:
        """Where the longest cached prefix of ``request``'s tokens is, for a request admitted in ``kind``:
        pages of ``kind`` in memory, then the tier's slots holding the pages that follow; or pages of
        another kind (a prefix segment, ``cross_kind_prefix``) and pages of ``kind`` computed after such
        a segment. At least one token is left to compute (its logits sample the next token). Nothing is
        taken; None: nothing found."""
        if not self.enabled or not (self.pool.num_hashed_pages or self.tier.names):
            return None
        in_tier = self.tier.kinds()
        named = self.pool.num_named
        # A kind with no named page in memory and none demoted to the tier holds nothing to find: no
        # hashing, no lookups (most of a decision's lookups, with 1,600 waiting, found nothing that way).
        best = self._find_in(request, kind) if named(kind) or kind in in_tier else None
        for prefix_kind in KINDS:  # a tuple: iterating the enum costs a generator a call
            if prefix_kind is not kind and named(prefix_kind) and cross_kind_prefix(prefix_kind, kind):
                match = self._find_after(request, prefix_kind, kind)
                if match is not None and (best is None or match.num_tokens > best.num_tokens):
                    best = match
        return best

    def _find_in(self, request: Request, kind: CacheKind) -> PrefixMatch | None:
        tpp = self.layout.tokens_per_page(kind)
        num_blocks = (request.num_tokens - 1) // tpp if tpp else 0
        if num_blocks <= 0:
            return None
        names = self.block_hashes(request, kind, num_blocks)[:num_blocks]
        pages = self.pool.lookup(names)
        slots = self.tier.slots_for(names[len(pages):])
        if not pages and not slots:
            return None
        return PrefixMatch(kind, pages, slots, (len(pages) + len(slots)) * tpp)

    def _find_after(self, request: Request, prefix_kind: CacheKind, kind: CacheKind) -> PrefixMatch | None:
        """A prefix segment in ``prefix_kind`` (in memory), then what follows it in ``kind``."""
        head_tpp, tpp = self.layout.tokens_per_page(prefix_kind), self.layout.tokens_per_page(kind)
        num_head = (request.num_tokens - 1) // head_tpp if head_tpp and tpp else 0
        if num_head <= 0 or not self.pool.num_hashed_pages:
            return None
        head = self.pool.lookup(self.block_hashes(request, prefix_kind, num_head)[:num_head])
        if not head:
            return None
        start = len(head) * head_tpp
        num_blocks = (request.num_tokens - 1 - start) // tpp
        pages, slots = [], []
        if num_blocks > 0:
            names = self.segment_hashes(request, prefix_kind, len(head), kind, num_blocks)[:num_blocks]
            pages = self.pool.lookup(names)
            slots = self.tier.slots_for(names[len(pages):])
        return PrefixMatch(kind, head + pages, slots, start + (len(pages) + len(slots)) * tpp, prefix_kind, len(head))

    def attach_prefix(self, request: Request, kind: CacheKind) -> int:
        """``request``, holding nothing, takes the pages of its longest cached prefix for ``kind``
        (``find_prefix``): they become its first pages and count as computed (a prefix in another kind
        becomes its prefix segment); pages of it in the tier come back into fresh pages (during a
        scheduling decision, where free pages allow). Returns the tokens found (0: nothing changed)."""
        if request.page_ids or request.swap_slots or request.num_computed_tokens:
            raise ValueError(f"request {request.request_id} already holds cache: no prefix to attach")
        match = self.find_prefix(request, kind)
        if match is None:
            return 0
        pages, slots = match.pages, match.slots if self.tier.in_decision else []
        if not pages and not slots:
            return 0
        self.pool.take(pages, request.request_id)  # first: allocating below may evict unreferenced pages
        restored: list[int] = []
        slots = slots[:self.pool.num_free_pages]  # as much of it as memory takes now (the rest is computed)
        if slots:
            restored = self.tier.restore(request.request_id, slots, kind)
            if restored:
                self.tier.touch(self._tier_names(request, match, len(slots)))
            else:
                slots = []
        if not pages and not slots:
            return 0
        request.page_ids = list(pages) + restored
        request.kind = request.last_kind = kind
        request.num_named_pages = len(pages)  # the restored ones are named after the step has filled them
        own = len(request.page_ids) - match.num_prefix_pages
        if match.prefix_kind is not None:
            request.prefix_kind, request.num_prefix_pages = match.prefix_kind, match.num_prefix_pages
            request.num_prefix_tokens = match.num_prefix_pages * self.layout.tokens_per_page(match.prefix_kind)
        request.num_computed_tokens = request.num_prefix_tokens + own * self.layout.tokens_per_page(kind)
        return request.num_computed_tokens

    def _tier_names(self, request: Request, match: PrefixMatch, num: int) -> list[bytes]:
        """The names of the ``num`` pages ``match`` restores from the tier."""
        own = len(match.pages) - match.num_prefix_pages
        if match.prefix_kind is None:
            return self.block_hashes(request, match.kind, own + num)[own:own + num]
        return self.segment_hashes(request, match.prefix_kind, match.num_prefix_pages, match.kind,
                                   own + num)[own:own + num]

    def count_prefix_lookup(self, request: Request, num_hit: int) -> None:
        """``request`` was admitted (in its kind) having found ``num_hit`` tokens (``attach_prefix``)."""
        kind = request.kind.value
        self.stats.queries[kind] += request.num_tokens
        head = request.num_prefix_tokens if num_hit else 0  # a prefix segment in another kind
        if head:
            self.stats.hits[request.prefix_kind.value] += head
        self.stats.hits[kind] += num_hit - head
        restored = self.tier.restored_pages(request.request_id)
        if restored:
            self.stats.tier_hits[kind] += restored * self.layout.tokens_per_page(request.kind)

    def name_computed_pages(self, request: Request) -> None:
        """After a step: name ``request``'s pages that are full of computed tokens, so that later
        requests find them: what the forward pass, a same-kind copy back from the tier, a compression
        in place or an exact upgrade (x projected to K/V) wrote. After a lossy change (int8 dequantised
        to KV, or a copy converted on its way back from the tier) the content is not what the chain
        names, and the request names nothing more (``num_named_pages`` -1)."""
        kind, done = request.kind, request.num_named_pages
        if not self.enabled or kind is None or done < 0:
            return
        tpp = self.layout.tokens_per_page(kind)
        head, start = request.num_prefix_pages, request.num_prefix_tokens  # a prefix segment: named already
        full = min((request.num_computed_tokens - start) // tpp, len(request.page_ids) - head) if tpp else 0
        if head + full <= done:
            return
        if head:
            names = self.segment_hashes(request, request.prefix_kind, head, kind, full)
        else:
            names = self.block_hashes(request, kind, full)
        pages, register = request.page_ids, self.pool.register
        for i in range(done - head, full):
            register(pages[head + i], names[i])
        request.num_named_pages = head + full
