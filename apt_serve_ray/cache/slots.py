"""The slot allocator under both tiers: ``PagePool``'s pages and ``SwapSpace``'s slots.

Fixed-size slots numbered ``0..num-1``: a free list, and per slot its references and who holds them.
It says "no" (``None``) when there are too few free slots, and never decides whom to evict: a slot
whose last reference is released is handed back to the caller (``release`` returns True), who puts it
on the free list (``put_free``) or keeps it aside (the page pool's cached pages) and later gives it to a
new owner (``claim``). ``check_integrity`` holds the counts and owners consistent.
"""

from __future__ import annotations

from collections import deque


class SlotAllocator:
    def __init__(self, num: int, *, lifo: bool = False, what: str = "slot") -> None:
        """``lifo``: the last freed is the first reused (the swap tier: the slots in use stay the few
        already written); else first freed, first reused (the page pool)."""
        self.num = num
        self.lifo = lifo
        self.what = what
        self._free: deque[int] = deque(reversed(range(num))) if lifo else deque(range(num))
        self._refs: list[int] = [0] * num
        self._owners: list[dict[str, int] | None] = [None] * num  # owner -> references it holds
        self.high_water = 0  # one past the highest slot ever handed out (LIFO: how many were ever used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refs(self, slot: int) -> int:
        return self._refs[slot]

    def owners(self, slot: int) -> dict[str, int]:
        return dict(self._owners[slot] or {})

    def owner(self, slot: int) -> str | None:
        """One holder of ``slot`` (None if nobody holds it)."""
        owners = self._owners[slot]
        return next(iter(owners)) if owners else None

    def allocate(self, num: int, owner: str) -> list[int] | None:
        """``num`` free slots, held once by ``owner``; None (nothing changed) if too few are free."""
        if num < 0:
            raise ValueError(f"num: must be >= 0, got {num}")
        if num > len(self._free):
            return None
        pop = self._free.pop if self.lifo else self._free.popleft
        slots = [pop() for _ in range(num)]
        for slot in slots:
            self.claim(slot, owner)
        if slots:
            self.high_water = max(self.high_water, max(slots) + 1)
        return slots

    def peek(self) -> int | None:
        """The slot ``allocate`` would hand out next (None: none free)."""
        if not self._free:
            return None
        return self._free[-1] if self.lifo else self._free[0]

    def claim(self, slot: int, owner: str) -> None:
        """``owner`` holds ``slot``, which nobody held and is not on the free list."""
        self._refs[slot] = 1
        self._owners[slot] = {owner: 1}

    def add_ref(self, slot: int, owner: str) -> None:
        """One more reference to a held slot, or the first to one kept aside (not free)."""
        owners = self._owners[slot]
        if owners is None:
            owners = self._owners[slot] = {}
        owners[owner] = owners.get(owner, 0) + 1
        self._refs[slot] += 1

    def release(self, slot: int, owner: str) -> bool:
        """``owner`` drops one reference. True when nobody holds the slot any more: the caller puts it
        on the free list or keeps it aside."""
        owners = self._owners[slot]
        if not owners or owner not in owners:
            held_by = None if not owners else next(iter(owners)) if len(owners) == 1 else sorted(owners)
            raise RuntimeError(f"{self.what} {slot} is owned by {held_by!r}, not {owner!r}")
        if owners[owner] == 1:
            del owners[owner]
        else:
            owners[owner] -= 1
        self._refs[slot] -= 1
        if self._refs[slot]:
            return False
        self._owners[slot] = None
        return True

    def put_free(self, slot: int) -> None:
        self._free.append(slot)

    def free(self, slots: list[int], owner: str) -> None:
        """``owner`` lets go of ``slots``; the ones nobody holds any more go back on the free list."""
        for slot in slots:
            if self.release(slot, owner):
                self._free.append(slot)

    def held(self) -> set[int]:
        return {s for s in range(self.num) if self._refs[s] > 0}

    def check_integrity(self, aside: set[int] = frozenset()) -> None:
        """Every slot free, held or ``aside`` (kept by the caller, held by nobody), exactly one of them;
        references and owners agree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"a {self.what} is on the free list twice")
        held = self.held()
        if free & held or free & aside or held & aside:
            raise AssertionError(f"a {self.what} is in two states (free / held / kept aside)")
        if len(free) + len(held) + len(aside) != self.num:
            raise AssertionError(f"{self.what}s: free {len(free)} + held {len(held)} + aside {len(aside)} "
                                 f"!= total {self.num}")
        for slot in range(self.num):
            owners, refs = self._owners[slot], self._refs[slot]
            if refs < 0 or (refs > 0) != bool(owners) or (owners and sum(owners.values()) != refs):
                raise AssertionError(f"{self.what} {slot}: {refs} references, owners {owners!r}")
