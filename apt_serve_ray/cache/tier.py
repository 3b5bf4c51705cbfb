"""The tier below memory (``swap.py``'s slots), as the cache manager uses it: preempted requests'
pages swapped out and in (``SwapPlan``s), and cached prefix pages demoted there instead of dropped.

Demote, don't drop: with prefix caching, a cached page the pool evicts during a scheduling decision
keeps its content in the tier (one slot, ``TIER_OWNER``'s), named as before, until the tier needs the
slot (least recently used first; a preempted request's pages always win over it). A request whose
prefix continues there gets fresh pages that the step fills from the slots before it runs (a restore:
a ``SwapPlan`` in the step's swap-ins). The copies go with the decision's other transfers
(``take_tier_plans``): demotions with the swap-outs, restores with the swap-ins; slots written or read
this step are not reused before it has run.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from apt_serve_ray.cache.conversions import can_convert
from apt_serve_ray.cache.kinds import CacheKind
from apt_serve_ray.cache.layout import CacheLayout
from apt_serve_ray.cache.page_pool import PagePool, retention_weight
from apt_serve_ray.cache.swap import SwapSpace
from apt_serve_ray.request import Request

TIER_OWNER = "<prefix-cache>"  # owns the tier's slots that hold demoted prefix pages


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


class Tier:
    def __init__(self, pool: PagePool, layout: CacheLayout, swap: SwapSpace | None, enable_prefix_caching: bool,
                 stats) -> None:
        self.pool = pool
        self.layout = layout
        self.swap = swap  # None: preempted requests are recomputed, and nothing is demoted
        self.stats = stats  # the prefix cache's ``PrefixStats``: counts the pages demoted
        self.names: OrderedDict[bytes, int] = OrderedDict()  # name -> slot of a demoted page, LRU first
        self._kinds: set[CacheKind] = set()  # kinds demoted to the tier since it was last empty
        self._pinned: set[int] = set()  # slots written or read this step
        self._demotions: list[tuple[int, int]] = []  # (page, slot) to copy this step
        self._restores: dict[str, SwapPlan] = {}  # request id -> its restore this step
        self.in_decision = False  # between begin_decision and take_tier_plans: pages are demoted, restored
        if enable_prefix_caching and swap is not None:
            pool.on_evict = self._demote
        # Slots of requests swapped in this step stay owned until the runner has read them: a swap-out
        # in the same step runs first and must not receive them and overwrite them before.
        self._deferred_slots: list[tuple[list[int], str]] = []

    # Demoted prefix pages -------------------------------------------------------------------------
    def kinds(self) -> set[CacheKind]:
        """The kinds demoted to the tier since it was last empty (where a lookup may find something)."""
        if not self.names:
            self._kinds.clear()
        return self._kinds

    def slots_for(self, names) -> list[int]:
        """The tier's slots holding the pages ``names`` name, as far as they go on unbroken."""
        slots = []
        if self.names:
            for name in names:
                slot = self.names.get(name)
                if slot is None:
                    break
                slots.append(slot)
        return slots

    def restore(self, request_id: str, slots: list[int], kind: CacheKind) -> list[int]:
        """Fresh pages of ``kind`` that the step fills from the demoted pages in ``slots`` before it runs
        (a restore, among the decision's swap-ins); [] (nothing changed) without the pages."""
        pinned = set(slots) - self._pinned  # not reused by a demotion the allocation makes
        self._pinned.update(pinned)
        pages = self.pool.allocate(len(slots), kind, request_id) or []
        if pages:
            self._restores[request_id] = SwapPlan(request_id, pages, list(slots), kind)
        else:
            self._pinned.difference_update(pinned)
        return pages

    def touch(self, names) -> None:
        """The demoted pages ``names`` name were used: the last to be given up."""
        for name in names:
            self.names.move_to_end(name)

    def restored_pages(self, request_id: str) -> int:
        """Pages the request gets back from the tier this step (0: none)."""
        plan = self._restores.get(request_id)
        return 0 if plan is None else len(plan.pages)

    def begin_decision(self) -> None:
        self.in_decision = True

    def abandon_decision(self) -> None:
        """The decision failed before its output: its demotions will not be copied (forget them); its
        restores' requests are recomputed by whoever handles the failure."""
        outs, _ = self.take_tier_plans()
        for plan in outs:
            self.forget_tier_slots(plan.slots)

    def take_tier_plans(self) -> tuple[list[SwapPlan], list[SwapPlan]]:
        """End of a decision: the demotions (one plan, pages -> slots) and restores it made."""
        self.in_decision = False
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
        if not self.in_decision:
            return
        if name in self.names:
            self.names.move_to_end(name)
            return
        slot = self._tier_slot()
        if slot is None:
            return
        self.names[name] = slot
        self._kinds.add(kind)
        self._pinned.add(slot)
        self._demotions.append((page, slot))
        self.stats.num_demoted += 1

    def _tier_slot(self) -> int | None:
        """A slot for a demoted page: a free one already faulted in (``SwapSpace.warm_slots``: a cold one
        costs a demotion 4.65 ms instead of 0.025 ms where the host backs memory lazily), else the least
        recently used demoted page's."""
        if self.swap.num_free_slots and self.swap.next_slot_is_warm():
            return self.swap.allocate(1, TIER_OWNER)[0]
        for name, slot in self.names.items():
            if slot not in self._pinned:
                del self.names[name]
                return slot
        return None

    def drop(self, num: int) -> None:
        """Give ``num`` slots of demoted pages back to the tier (least recently used first)."""
        for name, slot in list(self.names.items()):
            if num <= 0:
                return
            if slot not in self._pinned:
                del self.names[name]
                self.swap.free([slot], TIER_OWNER)
                num -= 1

    def reset(self) -> int:
        """Forget every demoted page not in use this step. Returns how many were forgotten."""
        num = len(self.names)
        self.drop(num)
        return num - len(self.names)

    @property
    def num_tier_pages(self) -> int:
        """Demoted prefix pages held in the tier."""
        return len(self.names)

    def holds_request_copies(self) -> bool:
        """Whether any request's computed tokens wait in the tier below memory (slots in use beyond
        those of demoted prefix pages): when none do, no waiting request need be asked."""
        return self.swap is not None and self.swap.num_used_slots > len(self.names)

    @property
    def num_free_slots(self) -> int:
        """Slots a preempted request may take: the free ones and those demoted pages hold."""
        if self.swap is None:
            return 0
        return self.swap.num_free_slots + len(self.names) - len(self._pinned)  # pinned: tier slots only

    def forget_tier_slots(self, slots) -> None:
        """Their copies did not happen (the step failed): the names must not be found there."""
        lost = set(slots)
        self._pinned -= lost  # pinned slots are always demoted pages' (num_free_slots counts on it)
        for name, slot in list(self.names.items()):
            if slot in lost:
                del self.names[name]
                self.swap.free([slot], TIER_OWNER)

    # Requests' pages ------------------------------------------------------------------------------
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
        if self.swap is not None and num > self.swap.num_warm_free_slots:
            # A request's pages win over cached ones, and warm slots over cold ones (``_tier_slot``).
            self.drop(num - self.swap.num_warm_free_slots)
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

    def free(self, request: Request) -> None:
        """Return its slots (and forget its restore this step: its pages hold nothing yet)."""
        self._restores.pop(request.request_id, None)
        if request.swap_slots:
            self.swap.free(request.swap_slots, request.request_id)
        request.swap_slots = []

    def release_deferred(self) -> None:
        self._pinned.clear()
        for slots, owner in self._deferred_slots:
            self.swap.free(slots, owner)
        self._deferred_slots.clear()

    def check_integrity(self, num_request_slots: int) -> None:
        """The slot allocator's own invariants, each demoted page in a slot of its own, and no slot held
        by anyone but the requests (``num_request_slots`` of them) and the demoted pages."""
        if self.swap is None:
            return
        self.swap.check_integrity()
        tier = list(self.names.values())
        if len(set(tier)) != len(tier) or any(self.swap.owner(slot) != TIER_OWNER for slot in tier):
            raise AssertionError("a demoted page's slot is shared, or not the prefix cache's")
        if num_request_slots + len(tier) != self.swap.num_used_slots:
            raise AssertionError(f"{self.swap.num_used_slots - num_request_slots - len(tier)} swap slots used by no "
                                 f"request and no demoted page (leaked)")
