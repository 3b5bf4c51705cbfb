"""How long a request's next inter-token gap may be while the P99 of its gaps can still meet its target.

The SLO metric (SPEC section 3, ``bench/slo_metrics``) is the P99 of a request's gaps with linear
interpolation (``numpy.percentile``). Over N gaps in descending order D[0] >= D[1] >= ...::

    P99 = (1 - f) * D[j] + f * D[j - 1],   j = N - 1 - floor(0.99 (N - 1)),   f = 0.99 (N - 1) - floor(...)

so only the j + 1 largest gaps matter: with 127 gaps (a 128-token answer) j = 2 and one long gap
costs nothing; with 31, j = 1 and the largest gap counts 0.7. A request that has had one gap over its
target has therefore not necessarily failed, and a scheduler that gives up on it (stops protecting
its gaps) turns a passing request into a failing one. ``GapBudget`` keeps the j + 1 largest gaps
seen and, for the best case where every later gap is short (taken as 0), the longest next gap that
keeps the P99 under the target: its ``allowance`` (inf: any gap; < 0: the request can no longer pass).
N is the request's gaps if it runs to ``max_tokens``; one that stops earlier has fewer, so the
allowance is optimistic for it, the right side to err on for "can it still pass".
"""

from __future__ import annotations

import bisect
import math

LOST = -1.0  # allowance of a request that can no longer meet its gap target


def p99_rank(num_gaps: int) -> tuple[int, float]:
    """(j, f) of the P99 over ``num_gaps`` gaps, as above (num_gaps >= 1)."""
    pos = 0.99 * (num_gaps - 1)
    lo = math.floor(pos)
    return num_gaps - 1 - lo, pos - lo


def p99_best_case(top: list[float], j: int, f: float) -> float:
    """P99 when the gaps not in ``top`` (descending, the largest seen) are 0."""
    d_j = top[j] if j < len(top) else 0.0
    if j == 0:
        return d_j
    d_prev = top[j - 1] if j - 1 < len(top) else 0.0
    return (1.0 - f) * d_j + f * d_prev


class GapBudget:
    """The largest gaps of one request and the allowance of its next one (see the module docstring)."""

    __slots__ = ("target_s", "j", "f", "top", "allowance")

    def __init__(self, target_s: float, max_gaps: int) -> None:
        self.target_s = float(target_s)
        self.j, self.f = p99_rank(max(1, max_gaps))
        self.top: list[float] = []  # descending, at most j + 1
        self.allowance = self._allowance()

    def add(self, gap_s: float) -> None:
        """Record a gap; the allowance changes only when it is among the j + 1 largest."""
        top = self.top
        if len(top) > self.j and gap_s <= top[-1]:
            return
        bisect.insort(top, gap_s, key=lambda g: -g)
        del top[self.j + 1:]
        self.allowance = self._allowance()

    @property
    def is_lost(self) -> bool:
        return self.allowance < 0

    def _allowance(self) -> float:
        """In closed form. With D the largest gaps (0 beyond those seen), a next gap g lands at rank p
        among them; the P99 after it, ``(1 - f) D'[j] + f D'[j - 1]``, is D's own while p > j, rises as
        ``(1 - f) g + f D[j - 1]`` at p = j, as ``(1 - f) D[j - 1] + f g`` at p = j - 1, and stays at
        ``(1 - f) D[j - 1] + f D[j - 2]`` above: the allowance is where it reaches the target."""
        target, j, f = self.target_s, self.j, self.f
        d = self.top + [0.0] * (j + 1 - len(self.top))
        if p99_best_case(d, j, f) >= target:
            return LOST
        if j == 0:
            return target  # the P99 is the largest gap
        g = (target - f * d[j - 1]) / (1.0 - f)  # p = j: between D[j] and D[j - 1]
        if g <= d[j - 1]:
            return g
        if f == 0.0:  # the gap above D[j - 1] does not count: the P99 stays at D[j - 1] < target
            return math.inf
        g = (target - (1.0 - f) * d[j - 1]) / f  # p = j - 1: between D[j - 1] and D[j - 2]
        return g if j == 1 or g <= d[j - 2] else math.inf
