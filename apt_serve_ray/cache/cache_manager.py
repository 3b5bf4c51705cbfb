"""Block tables per request over the shared page pool, for every cache kind.

Mechanism only: ``can_*`` methods check, their twins mutate, and allocation returns ``False``
instead of failing. The scheduler decides what to do when memory runs out.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from apt_serve_ray.cache.kinds import KINDS
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool, retention_weight
from apt_serve_ray.cache.swap import SwapSpace
from apt_serve_ray.request import CacheKind, Request


@dataclass(frozen=True)
class ConversionPlan:
    """A running request changes kind in place: the ``num_tokens`` tokens from position ``start_token``
    held in ``src_pages`` (of ``from_kind``) are written into ``dst_pages`` (of ``to_kind``). An upgrade (to KV: K/V projected
    from x, dequantised, or both) or a compression (``can_convert``: quantised to the int8 kind of the
    same content). The source pages are released after the step has read them."""

    request_id: str
    num_tokens: int
    src_pages: list[int]
    dst_pages: list[int]
    from_kind: CacheKind = CacheKind.HIDDEN
    to_kind: CacheKind = CacheKind.KV
    start_token: int = 0  # position of the first token converted (after a shared prefix kept as it is)

    @property
    def is_upgrade(self) -> bool:
        return not self.to_kind.is_compressed


# Kinds a copy in the tier can be turned into on its way back, without recomputing: quantised as it
# is read (the int8 kind of the same content). The other way (int8 -> full precision) keeps the error,
# and KV -> hidden is impossible (x is gone): those come back in their own kind, or are recomputed.
CONVERSIONS = frozenset((kind, kind.compresses_to) for kind in KINDS if kind.compresses_to is not None)


def can_convert(from_kind: CacheKind | None, to_kind: CacheKind | None) -> bool:
    """Whether a copy of ``from_kind`` in the tier can come back as ``to_kind`` pages (same kind: yes)."""
    return from_kind is to_kind or (from_kind, to_kind) in CONVERSIONS


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


# The hash chain of each kind starts from its own seed: a page's name says what it holds.
_SEEDS = {kind: hashlib.blake2b(f"apt-serve-ray/{kind.value}".encode(), digest_size=16).digest() for kind in CacheKind}


def _seed(kind: CacheKind, salt: str | None) -> bytes:
    """Where a request's chain starts: its kind's seed, salted by its ``cache_salt`` if it has one."""
    if salt is None:
        return _SEEDS[kind]
    return hashlib.blake2b(_SEEDS[kind] + salt.encode(), digest_size=16).digest()


TIER_OWNER = "<prefix-cache>"  # owns the tier's slots that hold demoted prefix pages


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


class CacheManager:
    """``enable_prefix_caching``: a request's full pages are named by a hash chain over its tokens
    once computed, and a new request (or one recomputed after preemption) starts from the longest
    named prefix of its tokens in the kind it is admitted in (``attach_prefix``), computing only the
    rest. Shared pages are full and never written: a request writes from the page after its hit on.

    Demote, don't drop: with a tier below memory, a cached page evicted during a scheduling decision
    keeps its content there (one slot, ``TIER_OWNER``'s), named as before, until the tier needs the slot
    (least recently used first; a preempted request's pages always win over it). A request whose prefix
    continues there gets fresh pages that the step fills from the slots before it runs (a restore: a
    ``SwapPlan`` in the step's swap-ins), at the cost of a copy instead of a prefill. The copies go
    with the decision's other transfers (``take_tier_plans``): demotions with the swap-outs, restores
    with the swap-ins; slots written or read this step are not reused before it has run."""

    def __init__(self, pool: PagePool, layout: CacheLayout, swap: SwapSpace | None = None,
                 enable_prefix_caching: bool = False) -> None:
        self.pool = pool
        self.layout = layout
        self.swap = swap  # the tier below memory; None: preempted requests are recomputed
        self.prefix_caching = enable_prefix_caching
        pool.page_value = {kind: max(layout.tokens_per_page(kind), 1) / layout.block_size for kind in CacheKind}
        self.prefix_stats = PrefixStats()
        self._tier: OrderedDict[bytes, int] = OrderedDict()  # name -> slot of a demoted page, LRU first
        self._tier_kinds: set[CacheKind] = set()  # kinds demoted to the tier since it was last empty
        self._tier_pinned: set[int] = set()  # slots written or read this step
        self._demotions: list[tuple[int, int]] = []  # (page, slot) to copy this step
        self._restores: dict[str, SwapPlan] = {}  # request id -> its restore this step
        self._in_decision = False
        if enable_prefix_caching and swap is not None:
            pool.on_evict = self._demote
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
        """Return its pages and its swap slots (whichever it holds)."""
        self._restores.pop(request.request_id, None)  # pages coming back this step: they hold nothing
        if request.page_ids:
            self.pool.free(request.page_ids[::-1], request.request_id, retention_weight(request.priority))  # tail first: evicted first
        if request.swap_slots:
            self.swap.free(request.swap_slots, request.request_id)
        request.page_ids = []
        request.swap_slots = []
        request.kind = None
        request.num_named_pages = 0
        _clear_prefix_segment(request)

    # Prefix caching -------------------------------------------------------------------------------
    def block_hashes(self, request: Request, kind: CacheKind, num_blocks: int) -> list[bytes]:
        """The names of ``request``'s first ``num_blocks`` full pages of ``kind``: each hashes its
        parent's name and its tokens. Computed once per request and kind (its known tokens only grow);
        the list returned may hold more names than asked for."""
        chain = request.block_hashes.setdefault(kind, [])
        if len(chain) < num_blocks:
            tpp, tokens = self.layout.tokens_per_page(kind), request.all_token_ids
            parent = chain[-1] if chain else _seed(kind, request.cache_salt)
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
        if not self.prefix_caching or not (self.pool.num_hashed_pages or self._tier):
            return None
        if not self._tier:
            self._tier_kinds.clear()
        named = self.pool.num_named
        # A kind with no named page in memory and none demoted to the tier holds nothing to find: no
        # hashing, no lookups (most of a decision's lookups, with 1,600 waiting, found nothing that way).
        best = self._find_in(request, kind) if named(kind) or kind in self._tier_kinds else None
        for prefix_kind in CacheKind:
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
        slots = self._tier_slots(names[len(pages):])
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
            slots = self._tier_slots(names[len(pages):])
        return PrefixMatch(kind, head + pages, slots, start + (len(pages) + len(slots)) * tpp, prefix_kind, len(head))

    def _tier_slots(self, names) -> list[int]:
        """The tier's slots holding the pages ``names`` name, as far as they go on unbroken."""
        slots = []
        if self._tier:
            for name in names:
                slot = self._tier.get(name)
                if slot is None:
                    break
                slots.append(slot)
        return slots

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
        pages, slots = match.pages, match.slots if self._in_decision else []
        if not pages and not slots:
            return 0
        self.pool.take(pages, request.request_id)  # first: allocating below may evict unreferenced pages
        restored: list[int] = []
        slots = slots[:self.pool.num_free_pages]  # as much of it as memory takes now (the rest is computed)
        if slots:
            pinned = set(slots) - self._tier_pinned  # not reused by a demotion the allocation makes
            self._tier_pinned.update(pinned)
            restored = self.pool.allocate(len(slots), kind, request.request_id) or []
            if restored:
                self._restores[request.request_id] = SwapPlan(request.request_id, restored, list(slots), kind)
                for name in self._tier_names(request, match, len(slots)):
                    self._tier.move_to_end(name)
            else:
                self._tier_pinned.difference_update(pinned)
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

    def detach_prefix(self, request: Request) -> None:
        """Undo ``attach_prefix`` (its chunk did not get the rest of its pages)."""
        self.free(request)
        request.num_computed_tokens = 0

    # The tier below memory, for prefixes -----------------------------------------------------------
    def begin_decision(self) -> None:
        self._in_decision = True

    def abandon_decision(self) -> None:
        """The decision failed before its output: its demotions will not be copied (forget them); its
        restores' requests are recomputed by whoever handles the failure."""
        outs, _ = self.take_tier_plans()
        for plan in outs:
            self.forget_tier_slots(plan.slots)

    def take_tier_plans(self) -> tuple[list[SwapPlan], list[SwapPlan]]:
        """End of a decision: the demotions (one plan, pages -> slots) and restores it made."""
        self._in_decision = False
        outs = []
        if self._demotions:
            pages, slots = zip(*self._demotions)
            outs.append(SwapPlan(TIER_OWNER, list(pages), list(slots), CacheKind.KV))
            self._demotions = []
        restores, self._restores = list(self._restores.values()), {}
        return outs, restores

    def _demote(self, page: int, name: bytes, kind: CacheKind) -> None:
        """The pool evicts a cached page: keep its content in the tier (during a decision only: the copy
        runs with the step)."""
        if not self._in_decision:
            return
        if name in self._tier:
            self._tier.move_to_end(name)
            return
        slot = self._tier_slot()
        if slot is None:
            return
        self._tier[name] = slot
        self._tier_kinds.add(kind)
        self._tier_pinned.add(slot)
        self._demotions.append((page, slot))
        self.prefix_stats.num_demoted += 1

    def _tier_slot(self) -> int | None:
        """A slot for a demoted page: a free one, else the least recently used demoted page's."""
        if self.swap.num_free_slots:
            return self.swap.allocate(1, TIER_OWNER)[0]
        for name, slot in self._tier.items():
            if slot not in self._tier_pinned:
                del self._tier[name]
                return slot
        return None

    def _drop_tier(self, num: int) -> None:
        """Give ``num`` slots of demoted pages back to the tier (least recently used first)."""
        for name, slot in list(self._tier.items()):
            if num <= 0:
                return
            if slot not in self._tier_pinned:
                del self._tier[name]
                self.swap.free([slot], TIER_OWNER)
                num -= 1

    @property
    def num_tier_pages(self) -> int:
        """Demoted prefix pages held in the tier."""
        return len(self._tier)

    def holds_request_copies(self) -> bool:
        """Whether any request's computed tokens wait in the tier below memory (slots in use beyond
        those of demoted prefix pages): when none do, no waiting request need be asked."""
        return self.swap is not None and self.swap.num_used_slots > len(self._tier)

    @property
    def num_free_slots(self) -> int:
        """Slots a preempted request may take: the free ones and those demoted pages hold."""
        if self.swap is None:
            return 0
        return self.swap.num_free_slots + len(self._tier) - len(self._tier_pinned)  # pinned: tier slots only

    def forget_tier_slots(self, slots) -> None:
        """Their copies did not happen (the step failed): the names must not be found there."""
        lost = set(slots)
        self._tier_pinned -= lost  # pinned slots are always demoted pages' (num_free_slots counts on it)
        for name, slot in list(self._tier.items()):
            if slot in lost:
                del self._tier[name]
                self.swap.free([slot], TIER_OWNER)

    def count_prefix_lookup(self, request: Request, num_hit: int) -> None:
        """``request`` was admitted (in its kind) having found ``num_hit`` tokens (``attach_prefix``)."""
        kind = request.kind.value
        self.prefix_stats.queries[kind] += request.num_tokens
        head = request.num_prefix_tokens if num_hit else 0  # a prefix segment in another kind
        if head:
            self.prefix_stats.hits[request.prefix_kind.value] += head
        self.prefix_stats.hits[kind] += num_hit - head
        plan = self._restores.get(request.request_id)
        if plan is not None:
            self.prefix_stats.tier_hits[kind] += len(plan.pages) * self.layout.tokens_per_page(request.kind)

    def name_computed_pages(self, request: Request) -> None:
        """After a step: name ``request``'s pages that are full of computed tokens, so that later
        requests find them: what the forward pass, a same-kind copy back from the tier, a compression
        in place or an exact upgrade (x projected to K/V) wrote. After a lossy change (int8 dequantised
        to KV, or a copy converted on its way back from the tier) the content is not what the chain
        names, and the request names nothing more (``num_named_pages`` -1)."""
        kind, done = request.kind, request.num_named_pages
        if not self.prefix_caching or kind is None or done < 0:
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

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix nobody uses, in memory and in the tier (pages in use keep their
        content and names). Returns how many pages were forgotten."""
        num = len(self._tier)
        self._drop_tier(num)
        return num - len(self._tier) + self.pool.reset_prefix_cache()

    # The tier below memory ------------------------------------------------------------------------
    def num_swap_pages(self, request: Request) -> int:
        """Pages that hold its computed tokens (what a swap-out moves)."""
        return self.layout.num_pages_for(request.num_computed_tokens, request.kind) if request.kind else 0

    def can_swap_out(self, request: Request) -> bool:
        """Whether ``swap_out`` would move it. Not a request that holds a shared prefix in another kind:
        it is recomputed instead (its prefix is found again in the prefix cache)."""
        num = self.num_swap_pages(request)
        return (self.swap is not None and 0 < num <= self.num_free_slots and not request.num_prefix_pages
                and request.request_id not in self._restores)

    def swap_out(self, request: Request) -> SwapPlan | None:
        """Move the pages holding ``request``'s computed tokens to slots and free all its pages; it keeps
        ``num_computed_tokens`` and its kind. None (nothing changed) if the tier has too few free slots,
        or it holds a shared prefix in another kind (``can_swap_out``)."""
        if request.num_prefix_pages:
            return None
        num = self.num_swap_pages(request)
        if self.swap is not None and num > self.swap.num_free_slots:
            self._drop_tier(num - self.swap.num_free_slots)  # a request's pages win over cached ones
        slots = self.swap.allocate(num, request.request_id) if self.swap is not None and num else None
        if slots is None:
            return None
        plan = SwapPlan(request.request_id, request.page_ids[:num], slots, request.kind)
        # Pages beyond num: grown this step, empty. Named ones stay findable (tail first, as in free).
        self.pool.free(request.page_ids[::-1], request.request_id, retention_weight(request.priority))
        request.page_ids = []
        request.num_named_pages = 0
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
        request.num_named_pages = 0 if kind is from_kind else -1  # a byte copy holds what the chain names
        return plan

    def undo_swap_in(self, request: Request, plan: SwapPlan) -> None:
        """Preempted in the step that swapped it in: its bytes are still in the slots (released only
        after the step), so it goes back to them and no copy runs either way."""
        self._deferred_slots.remove((plan.slots, request.request_id))
        self.pool.free(request.page_ids[::-1], request.request_id, retention_weight(request.priority))
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
        runner fills them from the old pages, which come back after the step. A shared prefix it keeps
        in another kind (``prefix_kind``) stays as it is: only its own tokens change kind. Returns None
        if there is not enough memory."""
        if request.kind is None or not request.kind.is_compressed:
            raise ValueError(f"request {request.request_id} holds no compressed pages")
        to_kind = request.kind.upgrades_to
        head, start = request.num_prefix_pages, request.num_prefix_tokens
        pages = self.pool.allocate(self.layout.num_pages_for(max(0, num_total_tokens - start), to_kind),
                                   to_kind, request.request_id)
        if pages is None:
            return None
        own = request.page_ids[head:]
        plan = ConversionPlan(request.request_id, request.num_computed_tokens - start, own, pages,
                              request.kind, to_kind, start)
        self._deferred.append((own[::-1], request.request_id))
        exact = not request.kind.is_int8  # K/V projected from x: what a forward pass writes
        request.kind = request.last_kind = to_kind
        request.page_ids = request.page_ids[:head] + pages
        # Named again after the step has written them (``name_computed_pages``), where exact; dequantised
        # K/V are not what a KV request would compute, and must not be found as such.
        request.num_named_pages = head if exact else -1
        request.num_upgrades += 1
        _merge_prefix_segment(request)
        return plan

    def num_private_pages(self, request: Request) -> int:
        """Its pages no other request references (what it frees by leaving, or compressing)."""
        refs = self.pool.refs
        return sum(1 for p in request.page_ids if refs(p) == 1)

    def _shared_head(self, request: Request) -> tuple[int, int]:
        """The pages at the head of ``request``'s that a change of kind keeps as they are, and the
        tokens they hold: its prefix in another kind, or else the leading pages other requests share
        with it (sharing is a prefix: whoever shares a page shares the ones before it)."""
        if request.num_prefix_pages:
            return request.num_prefix_pages, request.num_prefix_tokens
        refs, pages, head = self.pool.refs, request.page_ids, 0
        while head < len(pages) and refs(pages[head]) > 1:
            head += 1
        return head, head * self.layout.tokens_per_page(request.kind)

    def _compress_targets(self, request: Request, kind: CacheKind) -> tuple[list[int], int, int, int]:
        """A compression to ``kind``: the pages of its own that it writes, how many free ones more it
        needs, and the pages and tokens of the shared head it keeps."""
        head, start = self._shared_head(request)
        num = self.layout.num_pages_for(max(0, request.num_computed_tokens - start), kind)
        refs = self.pool.refs
        private = [p for p in request.page_ids[head:] if refs(p) == 1][:num]
        return private, num - len(private), head, start

    def compress_gain(self, request: Request, kind: CacheKind) -> tuple[int, int]:
        """(pages of ``kind`` a compression writes, pages it frees): its own pages come free, less those
        its tokens take in ``kind``; a shared head stays (and costs nothing more)."""
        private, short, head, _ = self._compress_targets(request, kind)
        num = len(private) + short
        return num, len(request.page_ids) - head - num

    def can_compress(self, request: Request, kind: CacheKind) -> bool:
        """Whether ``compress`` would find the pages: its own, plus free ones where it has too few."""
        if request.kind is None or request.kind is kind or not can_convert(request.kind, kind):
            return False
        return self.pool.can_allocate(self._compress_targets(request, kind)[1])

    def compress(self, request: Request, kind: CacheKind) -> ConversionPlan | None:
        """Switch a running request's pages to ``kind`` in place, quantising them (kv -> kv-int8,
        hidden -> hidden-int8: ``can_convert``). Its tokens go into the first of the pages only it
        references (the runner reads a layer's tokens before it writes that layer), and the rest come
        back after the step (``release_deferred``)::

            before   [p0 p1 p2 p3 p4 p5 p6]  kv, 16 tokens a page
            after    [p0 p1 p2 p3]           kv-int8, 30 tokens a page; p4-p6 freed after the step

        Pages it shares (a cached prefix) are not rewritten: they stay at its head, in their kind, as
        its prefix segment (``prefix_kind``; the kernels attend over both segments), and only the tokens
        after them change kind. None (nothing changed) where it has too few pages of its own and the
        pool no free ones.
        """
        if request.kind is None or request.kind is kind or not can_convert(request.kind, kind):
            raise ValueError(f"kind: request {request.request_id}'s {getattr(request.kind, 'value', None)} "
                             f"pages cannot be compressed to {kind.value}")
        rid = request.request_id
        private, short, head, start = self._compress_targets(request, kind)
        extra = self.pool.allocate(short, kind, rid) if short > 0 else []
        if extra is None:
            return None
        own = request.page_ids[head:]
        dst = private + extra
        plan = ConversionPlan(rid, request.num_computed_tokens - start, own, dst, request.kind, kind, start)
        self.pool.retag(private, kind, rid)  # they lose their names: their content changes
        kept = set(private)
        rest = [p for p in own if p not in kept]
        if rest:
            self._deferred.append((rest[::-1], rid))
        if head and not request.num_prefix_pages:
            request.prefix_kind, request.num_prefix_pages, request.num_prefix_tokens = request.kind, head, start
        request.kind = request.last_kind = kind
        request.page_ids = request.page_ids[:head] + dst
        # Its pages of ``kind`` are named after the step has written them (``name_computed_pages``): the
        # conversation's next turn finds its history there. They hold its exact K/V (or x) quantised,
        # at least as close to exact as what a request computing in ``kind`` would write itself.
        request.num_named_pages = head
        request.num_compressions += 1
        _merge_prefix_segment(request)
        return plan

    def release_deferred(self) -> None:
        self._tier_pinned.clear()
        for pages, owner in self._deferred:
            self.pool.free(pages, owner)
        self._deferred.clear()
        for slots, owner in self._deferred_slots:
            self.swap.free(slots, owner)
        self._deferred_slots.clear()

    def check_integrity(self, requests) -> None:
        """Both tiers, between steps: each allocator's own invariants, every page and slot of ``requests``
        referenced by it (as often as the pool counts), a request in pages or in slots but not both,
        shared pages named (only full, computed pages are shared), and nothing held by anyone else."""
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
                if self.swap is None or self.swap.owner(slot) != r.request_id:
                    raise AssertionError(f"swap slot {slot} of {r.request_id} is not owned by it")
            num_slots += len(r.swap_slots)
        for page, count in held.items():
            if self.pool.refs(page) != count:
                raise AssertionError(f"page {page}: {self.pool.refs(page)} references, {count} requests hold it")
            if count > 1 and not self.pool.is_named(page):
                raise AssertionError(f"page {page} is shared by {count} requests but not named (not full)")
        if len(held) != self.pool.num_used_pages:
            raise AssertionError(f"{self.pool.num_used_pages - len(held)} pages used by no request (leaked)")
        if self.swap is not None:
            self.swap.check_integrity()
            tier = list(self._tier.values())
            if len(set(tier)) != len(tier) or any(self.swap.owner(slot) != TIER_OWNER for slot in tier):
                raise AssertionError("a demoted page's slot is shared, or not the prefix cache's")
            if num_slots + len(tier) != self.swap.num_used_slots:
                raise AssertionError(f"{self.swap.num_used_slots - num_slots - len(tier)} swap slots used by no "
                                     f"request and no demoted page (leaked)")

    def num_cached_tokens(self, requests) -> dict[str, int]:
        tokens = dict.fromkeys((k.value for k in CacheKind), 0)
        for request in requests:
            if request.kind is not None:
                head = request.num_prefix_tokens if request.num_prefix_pages else 0
                tokens[request.kind.value] += request.num_computed_tokens - head
                if head:
                    tokens[request.prefix_kind.value] += head
        return tokens


def _clear_prefix_segment(request: Request) -> None:
    request.prefix_kind, request.num_prefix_pages, request.num_prefix_tokens = None, 0, 0


def _merge_prefix_segment(request: Request) -> None:
    """After a change of kind: a prefix segment in the request's own kind is one kind again (its
    tokens fill whole pages, so the later ones start on a page of their own either way)."""
    if request.num_prefix_pages and request.prefix_kind is request.kind:
        _clear_prefix_segment(request)
