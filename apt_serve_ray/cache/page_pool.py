"""One pool of fixed-size pages shared by every cache kind.

The pool knows nothing about models or policy: it hands out page ids from one free list, records
which request owns each page and of which kind it is, and says "no" (returns ``None``) when there
are not enough free pages. Whom to preempt is the scheduler's decision, never the pool's.
"""

from __future__ import annotations

from collections import deque

from apt_serve_ray.request import CacheKind


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owner: list[str | None] = [None] * num_pages
        self._kind: list[CacheKind | None] = [None] * num_pages
        self._num_used = dict.fromkeys(CacheKind, 0)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def num_used(self, kind: CacheKind) -> int:
        return self._num_used[kind]

    def owner(self, page: int) -> str | None:
        return self._owner[page]

    def usage(self) -> float:
        return self.num_used_pages / self.num_pages

    def can_allocate(self, num: int) -> bool:
        return num <= len(self._free)

    def allocate(self, num: int, kind: CacheKind, owner: str) -> list[int] | None:
        if num < 0:
            raise ValueError(f"num: must be >= 0, got {num}")
        if num > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(num)]
        for page in pages:
            self._owner[page] = owner
            self._kind[page] = kind
        self._num_used[kind] += num
        return pages

    def retag(self, pages: list[int], kind: CacheKind, owner: str) -> None:
        """Owned pages change kind (a request compressed in place keeps some of its pages)."""
        for page in pages:
            if self._owner[page] != owner:
                raise RuntimeError(f"page {page} is owned by {self._owner[page]!r}, not {owner!r}")
            self._num_used[self._kind[page]] -= 1
            self._kind[page] = kind
            self._num_used[kind] += 1

    def free(self, pages: list[int], owner: str) -> None:
        for page in pages:
            if self._owner[page] != owner:
                raise RuntimeError(f"page {page} is owned by {self._owner[page]!r}, not {owner!r}")
            self._num_used[self._kind[page]] -= 1
            self._owner[page] = None
            self._kind[page] = None
            self._free.append(page)

    def check_integrity(self) -> None:
        """free + used == total, no page free twice, no free page owned, per-kind counts consistent."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a page is on the free list twice")
        owned = [p for p in range(self.num_pages) if self._owner[p] is not None]
        if len(free) + len(owned) != self.num_pages:
            raise AssertionError(f"free {len(free)} + used {len(owned)} != total {self.num_pages}")
        if free & set(owned):
            raise AssertionError("a page is both free and owned")
        for kind in CacheKind:
            counted = sum(1 for p in owned if self._kind[p] is kind)
            if counted != self._num_used[kind]:
                raise AssertionError(f"{kind.value} pages: counter {self._num_used[kind]} != owned {counted}")
