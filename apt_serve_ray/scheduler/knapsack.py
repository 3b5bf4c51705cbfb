"""The model-free core of the adaptive scheduler: pick who runs with which cache, given their values.

Each request i can be skipped, run with a KV cache (``mem_kv[i]`` pages, value ``value[i]``) or, where
allowed, with the hidden-state cache (``mem_hidden[i]`` pages, value ``value[i] - recompute_cost[i]``).
Maximising total value under ``capacity`` pages is a multiple-choice knapsack; ``greedy_select`` is the
SPEC's O(n log n) 2-approximation, ``brute_force_select`` the exact oracle for tests.

How the greedy is built (why it needs one sort and no loop):

* Per request the options are points (pages, value): 0=(0,0), H=(mh, v-c), K=(mk, v). The greedy walks
  the upper convex hull of these points, as incremental items. If H lies on or above the chord 0->K,
  i.e. density(H) >= density(K), the request yields a "hidden" item H and an "upgrade" item K-H whose
  density is then <= density(H). For MHA (mk == 2*mh) that condition is exactly the SPEC's
  "v - c >= v/2". If H lies below the chord, the upgrade would sort before its hidden item: the two
  are merged into the single KV item (H is never worth taking in the LP relaxation then).
* So every upgrade sorts after its own hidden item (ties keep that order: the sort is stable and all
  upgrade items sit after all primary items in the item array), and since the scan stops at the
  first misfit, the taken items are a *prefix* of the sorted order: "upgrade only after its hidden
  item" holds by construction, and the prefix comes from a cumulative sum and one searchsorted.
* Options that do not fit in ``capacity`` on their own are dropped before building the items (a
  request whose KV need exceeds the capacity is offered as hidden alone, if allowed). Then the prefix
  plus the first misfit is an upper bound on the LP optimum, and the better of "prefix" and "misfit
  alone" (for an upgrade, alone = the whole KV item) is at least half the exact optimum.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apt_serve_ray.scheduler.value import density


@dataclass(frozen=True)
class Selection:
    """Which requests run (``chosen``) and which of them use the hidden-state cache (``hidden``)."""

    chosen: np.ndarray  # bool per request
    hidden: np.ndarray  # bool per request; True only where chosen and run with the hidden kind
    value: float  # total value of the chosen options
    pages: int  # total pages of the chosen options


def _as_vector(name: str, x, n: int | None, *, dtype=np.float64) -> np.ndarray:
    arr = np.asarray(x, dtype=dtype)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {n} (same as the first array)")
    if dtype is np.float64 and not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    return arr


def _as_pages(name: str, x, n: int) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        arr = _as_vector(name, arr, n)
        if not np.all(arr == np.floor(arr)):
            raise ValueError(f"{name} must hold whole page counts")
    arr = _as_vector(name, arr, n, dtype=np.int64)
    if np.any(arr < 0):
        raise ValueError(f"{name} must be >= 0")
    return arr


def _check_weight(name: str, w: float) -> None:
    if not (np.isfinite(w) and w >= 0):
        raise ValueError(f"{name}: must be a finite number >= 0, got {w!r}")


def _validate(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity):
    v = _as_vector("value", value, None)
    n = v.shape[0]
    c = _as_vector("recompute_cost", recompute_cost, n)
    if np.any(v < 0):
        raise ValueError("value must be >= 0")
    if np.any(c < 0):
        raise ValueError("recompute_cost must be >= 0")
    mk = _as_pages("mem_kv", mem_kv, n)
    mh = _as_pages("mem_hidden", mem_hidden, n)
    ok = np.asarray(hidden_ok, dtype=bool)
    if ok.ndim == 0:  # one flag for all requests (e.g. the model is MHA or it is not)
        ok = np.full(n, bool(ok))
    ok = _as_vector("hidden_ok", ok, n, dtype=bool)
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, (int, np.integer)):
        raise ValueError(f"capacity must be an int, got {capacity!r}")
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    return v, c, mk, mh, ok, int(capacity)


def _density(val: np.ndarray, mem: np.ndarray, memory_weight: float) -> np.ndarray:
    """The value model's density; zero-page items get +inf so they sort first."""
    return np.where(mem > 0, density(val, mem, memory_weight), np.inf)


def _result(chosen, hidden, v, c, mk, mh) -> Selection:
    # Recomputed from the final choice (not from the running sums) so value/pages are exact.
    taken_value = np.where(hidden, v - c, v)
    taken_pages = np.where(hidden, mh, mk)
    return Selection(chosen, hidden, float(taken_value[chosen].sum()), int(taken_pages[chosen].sum()))


def greedy_select(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity: int, *,
                  memory_weight: float = 1.0) -> Selection:
    """Pick requests and cache kinds by value density: the SPEC's greedy 2-approximation.

    Arguments are per-request arrays of equal length (``hidden_ok`` may also be one bool):
    ``value`` p_i >= 0, ``recompute_cost`` U*rho*m_i >= 0 (value lost with the hidden kind), ``mem_kv``
    and ``mem_hidden`` pages, ``hidden_ok`` whether the hidden kind is allowed; ``capacity`` free pages.
    The hidden kind is only offered where it saves memory (mem_hidden < mem_kv). ``memory_weight``
    sets density = value / pages**memory_weight (1 = the paper; the 2-approximation holds for 1).
    """
    v, c, mk, mh, ok, cap = _validate(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity)
    _check_weight("memory_weight", memory_weight)
    n = v.shape[0]
    vh = v - c
    can_hidden = ok & (mh < mk) & (vh >= 0) & (mh <= cap)
    kv_fits = mk <= cap
    d_hidden = _density(vh, mh, memory_weight)
    d_upgrade = _density(c, mk - mh, memory_weight)
    # Hull test: split into hidden + upgrade only when the upgrade sorts no earlier than its hidden
    # item (same float densities as the sort, so the prefix property cannot break on rounding).
    split = can_hidden & kv_fits & (d_hidden >= d_upgrade)
    hidden_only = can_hidden & ~kv_fits  # the KV kind cannot fit at all: offer hidden alone
    primary_is_hidden = split | hidden_only
    offered = primary_is_hidden | kv_fits

    # Item layout: [primary item of every offered request, in request order | upgrade items].
    prim = np.flatnonzero(offered)
    upg = np.flatnonzero(split)
    p_hidden = primary_is_hidden[prim]
    item_req = np.concatenate((prim, upg))
    item_mem = np.concatenate((np.where(p_hidden, mh[prim], mk[prim]), mk[upg] - mh[upg]))
    item_val = np.concatenate((np.where(p_hidden, vh[prim], v[prim]), c[upg]))
    item_dens = np.concatenate((np.where(p_hidden, d_hidden[prim], _density(v[prim], mk[prim],
                                                                            memory_weight)),
                                d_upgrade[upg]))
    order = np.argsort(-item_dens, kind="stable")  # one sort; stable = deterministic ties

    cum_mem = np.cumsum(item_mem[order])
    num_taken = int(np.searchsorted(cum_mem, cap, side="right"))  # cum_mem is non-decreasing
    taken = order[:num_taken]
    chosen = np.zeros(n, dtype=bool)
    chosen[item_req[taken]] = True
    upgraded = np.zeros(n, dtype=bool)
    upgraded[item_req[taken[taken >= prim.shape[0]]]] = True
    hidden = chosen & primary_is_hidden & ~upgraded

    if num_taken < order.shape[0]:
        # First misfit: compare the prefix with that item alone. Every offered option fits alone,
        # and an upgrade "alone" means its whole KV item.
        misfit = order[num_taken]
        req = item_req[misfit]
        is_upgrade = misfit >= prim.shape[0]
        alone_val = v[req] if is_upgrade else item_val[misfit]
        prefix_val = float(np.where(hidden, vh, v)[chosen].sum())
        if alone_val > prefix_val:
            chosen = np.zeros(n, dtype=bool)
            chosen[req] = True
            hidden = np.zeros(n, dtype=bool)
            hidden[req] = bool(not is_upgrade and primary_is_hidden[req])
    return _result(chosen, hidden, v, c, mk, mh)


def brute_force_select(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity: int, *,
                       memory_weight: float = 1.0) -> Selection:
    """Exact optimum by enumerating {skip, hidden (if hidden_ok), kv} per request. Tests only (n <= ~10).

    ``memory_weight`` is accepted for signature parity and ignored: the optimum does not use density.
    """
    v, c, mk, mh, ok, cap = _validate(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity)
    n = v.shape[0]
    # codes: 0 = skip, 1 = hidden, 2 = kv; all 3**n combinations as rows, then mask illegal ones.
    codes = np.indices((3,) * n).reshape(n, -1).T if n else np.zeros((1, 0), dtype=np.int64)
    legal = ~np.any((codes == 1) & ~ok, axis=1)
    opt_val = np.stack((np.zeros(n), v - c, v))  # (3, n)
    opt_mem = np.stack((np.zeros(n, dtype=np.int64), mh, mk))
    cols = np.arange(n)
    tot_val = opt_val[codes, cols].sum(axis=1)
    tot_mem = opt_mem[codes, cols].sum(axis=1)
    tot_val = np.where(legal & (tot_mem <= cap), tot_val, -np.inf)
    best = codes[int(np.argmax(tot_val))]  # the all-skip row is always feasible
    return _result(best > 0, best == 1, v, c, mk, mh)
