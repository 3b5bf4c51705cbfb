"""The model-free core of the adaptive scheduler: pick who runs with which cache kind, given their values.

Each request i may be skipped or run with one of K options (cache kinds): option j takes
``pages[i, j]`` pages and is worth ``values[i, j]``, where ``allowed[i, j]``. Maximising the total value
under ``capacity`` pages is a multiple-choice knapsack; ``greedy_choice`` is an O(n K^2 + nK log nK)
greedy with a proven bound, ``brute_force_choice`` the exact oracle for tests. Some options may be
``compressed``; their pages together may be capped by ``compressed_limit`` (the ``cache_ratio`` ceiling).
``greedy_select`` / ``brute_force_select`` are the two-option form (KV and hidden) kept for old callers.

How the greedy is built (Sinha and Zoltners' LP relaxation; why it needs one sort and no loop over items):

* Options that cannot be in any good solution are dropped first: not allowed, more pages than
  ``capacity`` alone, or a negative value (skipping is worth 0). Per request, the rest are points
  (pages, value) next to the origin 0 = (0, 0). The greedy walks their *upper convex hull* from the
  origin as incremental items: a request whose hull is 0 -> A -> B yields the item A and the upgrade
  A -> B (B's extra pages for B's extra value). The hull is walked by gift wrapping, vectorised over
  requests (at most K rounds over K columns; one pass for K = 2): from the current vertex the next
  is the option of densest increment (value / pages**memory_weight, the value model's density) among
  those with more pages and no less value, so along each chain the item densities never increase
  (for memory_weight 1; for other weights the sort key is clamped to the running minimum, the same
  thing). Dominated points (more pages, no more value) never become vertices; a step that adds pages
  for no value (an upgrade when recompute is free) is kept with density 0, so the greedy still
  upgrades when memory allows. Collinear points are kept as separate vertices (ties go to fewer pages).
* Items are laid out level by level ([every first item | every second item | ...]) and sorted once by
  density, stably: every upgrade sorts after the items it builds on (ties included), and since the
  scan stops at the first misfit, the taken items are a *prefix* of the sorted order. So "an upgrade
  only after its base" holds by construction and the prefix is a cumulative sum and one searchsorted.
* Bound (memory_weight = 1): the hull walk in density order, with the first misfit taken fractionally,
  is the optimum of the LP relaxation (Sinha-Zoltners), so OPT <= LP <= prefix + misfit item. The
  misfit's item value is at most its whole option's value (values >= 0), and every option fits alone,
  so the better of "prefix" and "the misfit's whole option alone" is >= OPT / 2. Where the LP optimum
  is integral (no misfit, or the prefix fills ``capacity`` exactly) the greedy is exact.

The compressed limit is a second constraint; it is handled simply and soundly:

* If the greedy's choice keeps the compressed pages within the limit, it is returned: it is feasible,
  and OPT under both constraints <= OPT under ``capacity`` alone <= 2 x its value, so the bound holds.
* Otherwise three feasible candidates are built and the best returned: (a) the greedy's choice with its
  compressed options kept in the order they entered while they fit the limit, the others falling back
  to their best uncompressed option while the pages allow (else skipped); (b) the greedy on the
  uncompressed options alone; (c) the greedy on the compressed options alone, under
  ``min(capacity, limit)``. The constrained optimum splits into its uncompressed part (a solution of
  (b)'s instance) and its compressed part (a solution of (c)'s), so it is <= 2 (b) + 2 (c): the best of
  the three is >= OPT / 4. No candidate exceeds the limit (tests hold every choice to it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from apt_serve_ray.scheduler.value import density

SKIP = -1  # ``Choice.option`` of a request left out


@dataclass(frozen=True)
class Choice:
    """The option (column) each request runs with, ``SKIP`` where it does not run."""

    option: np.ndarray  # int64 per request
    value: float  # total value of the chosen options
    pages: int  # their total pages
    compressed_pages: int  # of which in compressed options


@dataclass(frozen=True)
class Selection:
    """Two-option form: which requests run (``chosen``) and which of them use the hidden kind (``hidden``)."""

    chosen: np.ndarray  # bool per request
    hidden: np.ndarray  # bool per request; True only where chosen and run with the hidden kind
    value: float  # total value of the chosen options
    pages: int  # total pages of the chosen options


# Validation ---------------------------------------------------------------------------------------
def _as_matrix(name: str, x, shape: tuple[int, int] | None) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim == 1 and shape is None:
        arr = arr[:, None]
    if arr.ndim != 2 or (shape is not None and arr.shape != shape):
        raise ValueError(f"{name}: must be an [n, K] array{f' of shape {shape}' if shape else ''}, got {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name}: must be finite")
    return arr


def _as_count(name: str, x, *, allow_none: bool = False) -> int | None:
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
        raise ValueError(f"{name}: must be an int >= 0, got {x!r}")
    return int(x)


def _check_weight(name: str, w: float) -> None:
    if not (np.isfinite(w) and w >= 0):
        raise ValueError(f"{name}: must be a finite number >= 0, got {w!r}")


def _validate(values, pages, allowed, capacity, compressed, compressed_limit):
    v = _as_matrix("values", values, None)
    n, k = v.shape
    p = np.asarray(pages)
    if p.dtype.kind not in "iu" or p.shape != (n, k):  # integer pages (the scheduler's) need no float check
        p = _as_matrix("pages", p, (n, k))
        if not np.all(p == np.floor(p)):
            raise ValueError("pages: must hold whole page counts >= 0")
    if p.size and p.min() < 0:
        raise ValueError("pages: must hold whole page counts >= 0")
    ok = np.asarray(True if allowed is None else allowed, dtype=bool)
    try:
        ok = np.broadcast_to(ok, (n, k))
    except ValueError:
        raise ValueError(f"allowed: must be an [n, K] mask of shape {(n, k)}, got {ok.shape}") from None
    comp = np.zeros(k, dtype=bool) if compressed is None else np.asarray(compressed, dtype=bool)
    if comp.shape != (k,):
        raise ValueError(f"compressed: must be one flag per option ({k}), got shape {comp.shape}")
    return (v, p.astype(np.int64), ok, _as_count("capacity", capacity), comp,
            _as_count("compressed_limit", compressed_limit, allow_none=True))


def _result(option: np.ndarray, v: np.ndarray, p: np.ndarray, comp: np.ndarray) -> Choice:
    # Recomputed from the final choice (not from running sums) so value and pages are exact.
    rows = np.flatnonzero(option >= 0)
    cols = option[rows]
    flat = rows * v.shape[1] + cols
    pages = p.ravel()[flat]
    return Choice(option, float(v.ravel()[flat].sum()), int(pages.sum()), int(pages[comp[cols]].sum()))


# The greedy ---------------------------------------------------------------------------------------
def _dens(dv: np.ndarray, dp: np.ndarray, w: float) -> np.ndarray:
    """The value model's density of an item; zero-page items get +inf so they sort first."""
    return np.where(dp > 0, density(dv, dp, w), np.inf)


def _chains(vs: list[np.ndarray], ps: list[np.ndarray], us: list[np.ndarray], w: float):
    """Each request's hull chain from the origin, level by level (gift wrapping over K columns).

    From the current vertex, the next is the option of most dense increment among those with more
    pages and no less value (at the origin, zero-page options too); ties go to the fewer pages, then
    to the lower column. Returns per level t = 1.. the arrays ``col`` (SKIP past a request's last
    vertex), ``val``, ``mem`` and ``key``, the item's density clamped to the running minimum along
    the chain (for memory_weight = 1 the densities of a hull never increase and the clamp changes
    nothing; for other weights it keeps every upgrade from sorting before its base)."""
    n = vs[0].shape[0]
    cur_val, cur_mem = np.zeros(n), np.zeros(n, dtype=np.int64)
    prev_key = np.full(n, np.inf)
    alive = np.ones(n, dtype=bool)
    levels = []
    for t in range(len(vs)):
        best_d = np.full(n, -np.inf)
        best_col = np.full(n, SKIP, dtype=np.int64)
        best_val, best_mem = cur_val, cur_mem
        for j, (v, p, u) in enumerate(zip(vs, ps, us)):
            cand = u & alive & (v >= cur_val) & ((p > cur_mem) if t else True)
            d = np.where(cand, _dens(v - cur_val, p - cur_mem, w), -np.inf)
            better = cand & ((d > best_d) | ((d == best_d) & (p < best_mem)))
            if t == 0 and j == 0:
                better = cand  # the first candidate at the origin: best_mem is 0 there, not a bound
            best_d = np.where(better, d, best_d)
            best_col = np.where(better, j, best_col)
            best_val, best_mem = np.where(better, v, best_val), np.where(better, p, best_mem)
        alive = best_col != SKIP
        if not alive.any():
            break
        key = np.minimum(prev_key, best_d)
        levels.append((best_col, best_val, best_mem, key))
        cur_val, cur_mem, prev_key = best_val, best_mem, key
    return levels


def _chains2(vs: list[np.ndarray], ps: list[np.ndarray], us: list[np.ndarray], w: float):
    """``_chains`` for two columns (KV and one compressed kind, the usual case) in one pass: the same
    choices, a third of the array operations. ``a`` is the option of fewer pages (ties: more value,
    then the lower column), ``b`` the other."""
    swap = (ps[1] < ps[0]) | ((ps[1] == ps[0]) & (vs[1] > vs[0]))
    ca = swap.astype(np.int64)
    if swap.all() or not swap.any():  # the usual case: one column has fewer pages for every request
        a, b = (1, 0) if swap[0] else (0, 1)
        va, vb, pa, pb, ua, ub = vs[a], vs[b], ps[a], ps[b], us[a], us[b]
    else:
        va, vb = np.where(swap, vs[1], vs[0]), np.where(swap, vs[0], vs[1])
        pa, pb = np.where(swap, ps[1], ps[0]), np.where(swap, ps[0], ps[1])
        ua, ub = np.where(swap, us[1], us[0]), np.where(swap, us[0], us[1])
    da, db = _dens(va, pa, w), _dens(vb, pb, w)
    take_b = ub & ~(ua & (db <= da))  # the denser at the origin; a on ties (fewer pages)
    take_a = ua & ~take_b
    col1 = np.where(take_b, 1 - ca, np.where(take_a, ca, SKIP))
    key1 = np.where(take_b, db, da)
    levels = [(col1, np.where(take_b, vb, np.where(take_a, va, 0.0)), np.where(take_b, pb, np.where(take_a, pa, 0)),
               key1)]
    up = take_a & ub & (pb > pa) & (vb >= va)  # then the upgrade a -> b, where b adds pages and no less value
    if up.any():
        key2 = np.minimum(key1, _dens(vb - va, pb - pa, w))
        levels.append((np.where(up, 1 - ca, SKIP), vb, pb, key2))
    return levels


def _greedy(v, p, ok, cap: int, w: float) -> tuple[np.ndarray, np.ndarray]:
    """The 2-approximation under ``capacity`` alone. Returns the option per request and, for the
    chosen ones, the position in the density order at which each entered (for the compressed limit)."""
    n = v.shape[0]
    option = np.full(n, SKIP, dtype=np.int64)
    entered = np.full(n, np.iinfo(np.int64).max)
    usable = ok & (p <= cap) & (v >= 0)
    if v.shape[1] == 1:  # one option (KV only, the common case): a plain 0/1 knapsack greedy
        return _greedy_one(v[:, 0], p[:, 0], usable[:, 0], cap, w, option, entered)
    live = np.flatnonzero(usable.any(axis=0)) if n else np.zeros(0, dtype=np.int64)
    if live.size == 0:  # no option any request may take
        return option, entered
    if live.size == v.shape[1]:  # one contiguous row per option
        vt, pt, ut = np.ascontiguousarray(v.T), np.ascontiguousarray(p.T), np.ascontiguousarray(usable.T)
    else:
        vt, pt, ut = v.T[live], p.T[live], usable.T[live]
    levels = (_chains2 if live.size == 2 else _chains)(list(vt), list(pt), list(ut), w)
    # Items, level-major: [first item of each request | second items | ...] (see the module docstring).
    rows, mems, vals, keys, sizes = [], [], [], [], []
    prev_val, prev_mem = np.zeros(n), np.zeros(n, dtype=np.int64)
    for col, val, mem, key in levels:
        r = np.flatnonzero(col != SKIP)
        rows.append(r)
        mems.append(mem[r] - prev_mem[r])
        vals.append(val[r] - prev_val[r])
        keys.append(key[r])
        sizes.append(r.size)
        prev_val, prev_mem = val, mem
    item_row, item_mem, item_val = np.concatenate(rows), np.concatenate(mems), np.concatenate(vals)
    order = np.argsort(-np.concatenate(keys), kind="stable")  # one sort; stable: deterministic ties
    cum_mem = np.cumsum(item_mem[order])
    num_taken = int(np.searchsorted(cum_mem, cap, side="right"))  # cum_mem is non-decreasing
    taken = order[:num_taken]
    depth = np.bincount(item_row[taken], minlength=n)  # the prefix takes levels 1..depth of each request
    cols = np.stack([col for col, *_ in levels])  # [levels, n]
    option = np.where(depth > 0, live[cols[np.maximum(depth - 1, 0), np.arange(n)]], SKIP)
    in_first = taken < sizes[0]  # first items: where each request entered
    entered[item_row[taken[in_first]]] = np.flatnonzero(in_first)
    if num_taken < order.shape[0]:
        # First misfit: the prefix against that item's whole option alone (it fits: usable).
        misfit = order[num_taken]
        r = item_row[misfit]
        lvl = int(np.searchsorted(np.cumsum(sizes), misfit, side="right"))
        if levels[lvl][1][r] > float(item_val[taken].sum()):
            option = np.full(n, SKIP, dtype=np.int64)
            option[r] = live[levels[lvl][0][r]]
            entered = np.full(n, np.iinfo(np.int64).max)
            entered[r] = 0
    return option, entered


def _greedy_one(v, p, usable, cap: int, w: float, option, entered) -> tuple[np.ndarray, np.ndarray]:
    """``_greedy`` with one option per request: by density, the prefix or the first misfit alone."""
    rows = np.flatnonzero(usable)
    val, mem = v[rows], p[rows]
    order = np.argsort(-_dens(val, mem, w), kind="stable")
    num_taken = int(np.searchsorted(np.cumsum(mem[order]), cap, side="right"))
    taken = rows[order[:num_taken]]
    if num_taken < order.shape[0] and val[order[num_taken]] > float(v[taken].sum()):
        taken = rows[order[num_taken:num_taken + 1]]
    option[taken] = 0
    entered[taken] = np.arange(taken.shape[0])
    return option, entered


def _within_limit(option, entered, v, p, ok, cap: int, comp, limit: int) -> np.ndarray:
    """Candidate (a) of the module docstring: compressed choices kept in the order they entered while
    they fit ``limit``; the rest fall back to their best uncompressed option while pages allow."""
    option = option.copy()
    rows = np.flatnonzero(option >= 0)
    rows = rows[comp[option[rows]]]
    rows = rows[np.argsort(entered[rows], kind="stable")]
    mem = p[rows, option[rows]]
    keep = int(np.searchsorted(np.cumsum(mem), limit, side="right"))
    over = rows[keep:]
    option[over] = SKIP
    spare = cap - int(p[np.flatnonzero(option >= 0), option[option >= 0]].sum())
    plain = ok[over] & ~comp[None, :] & (p[over] <= cap) & (v[over] >= 0)
    if over.size and plain.any():
        best = np.argmax(np.where(plain, v[over], -np.inf), axis=1)
        has = plain[np.arange(over.size), best]
        back, best = over[has], best[has]
        fits = int(np.searchsorted(np.cumsum(p[back, best]), spare, side="right"))
        option[back[:fits]] = best[:fits]
    return option


def greedy_choice(values, pages, allowed=None, capacity: int = 0, *, compressed=None,
                  compressed_limit: int | None = None, memory_weight: float = 1.0) -> Choice:
    """Pick at most one option per request by value density (the module docstring's greedy and bound).

    ``values``, ``pages``: [n, K] (values >= 0 to be worth taking; negative ones are never taken);
    ``allowed``: [n, K] mask (or one broadcastable to it; None: all); ``capacity``: free pages;
    ``compressed``: [K] flags of options whose pages count against ``compressed_limit`` (None: no limit).
    ``memory_weight``: density = value / pages**memory_weight (the bounds are for 1).
    """
    v, p, ok, cap, comp, limit = _validate(values, pages, allowed, capacity, compressed, compressed_limit)
    _check_weight("memory_weight", memory_weight)
    return _solve(v, p, ok, cap, comp, limit, memory_weight)


def _solve(v, p, ok, cap: int, comp, limit: int | None, memory_weight: float) -> Choice:
    """``greedy_choice`` on validated arrays."""
    if limit is not None and limit == 0:
        ok = ok & ~(comp[None, :] & (p > 0))  # no compressed page at all: the plain greedy on the rest
    option, entered = _greedy(v, p, ok, cap, memory_weight)
    best = _result(option, v, p, comp)
    if limit is None or best.compressed_pages <= limit:
        return best
    candidates = [
        _within_limit(option, entered, v, p, ok, cap, comp, limit),
        _greedy(v, p, ok & ~comp[None, :], cap, memory_weight)[0],
        _greedy(v, p, ok & comp[None, :], min(cap, limit), memory_weight)[0],
    ]
    results = [_result(o, v, p, comp) for o in candidates]
    return max(results, key=lambda c: c.value)  # the first of equals: the fix-up of the greedy's choice


def brute_force_choice(values, pages, allowed=None, capacity: int = 0, *, compressed=None,
                       compressed_limit: int | None = None, memory_weight: float = 1.0) -> Choice:
    """Exact optimum by enumerating every option (or skip) per request. Tests only ((K+1)**n rows).

    ``memory_weight`` is accepted for signature parity and ignored: the optimum does not use density."""
    v, p, ok, cap, comp, limit = _validate(values, pages, allowed, capacity, compressed, compressed_limit)
    n, k = v.shape
    codes = np.indices((k + 1,) * n).reshape(n, -1).T - 1 if n else np.zeros((1, 0), dtype=np.int64)
    cols = np.arange(n)
    safe = np.maximum(codes, 0)
    on = codes >= 0
    legal = ~np.any(on & ~ok[cols, safe], axis=1)
    tot_val = np.where(on, v[cols, safe], 0.0).sum(axis=1)
    tot_mem = np.where(on, p[cols, safe], 0).sum(axis=1)
    tot_comp = np.where(on & comp[safe], p[cols, safe], 0).sum(axis=1)
    feasible = legal & (tot_mem <= cap) & (True if limit is None else tot_comp <= limit)
    best = codes[int(np.argmax(np.where(feasible, tot_val, -np.inf)))]  # the all-skip row is always feasible
    return _result(best.astype(np.int64), v, p, comp)


# The two-option form (KV and hidden) ----------------------------------------------------------------
def _two_options(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity):
    v = _column("value", value, None)
    n = v.shape[0]
    c = _column("recompute_cost", recompute_cost, n)
    mk = _pages("mem_kv", mem_kv, n)
    mh = _pages("mem_hidden", mem_hidden, n)
    ok = np.asarray(hidden_ok, dtype=bool)
    if ok.ndim == 0:  # one flag for all requests (e.g. the model is MHA or it is not)
        ok = np.full(n, bool(ok))
    if ok.shape != (n,):
        raise ValueError(f"hidden_ok: must be one flag per request ({n}), got shape {ok.shape}")
    _as_count("capacity", capacity)
    # Column 0: KV (value v); column 1: hidden (value v - c), only where it saves memory.
    allowed = np.stack((np.ones(n, dtype=bool), ok & (mh < mk)), axis=1)
    return np.stack((v, v - c), axis=1), np.stack((mk, mh), axis=1), allowed


def _column(name: str, x, n: int | None) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or (n is not None and arr.shape[0] != n):
        raise ValueError(f"{name}: must be a 1-D array of length {n if n is not None else 'n'}, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name}: must be finite and >= 0")
    return arr


def _pages(name: str, x, n: int) -> np.ndarray:
    arr = _column(name, x, n)
    if not np.all(arr == np.floor(arr)):
        raise ValueError(f"{name}: must hold whole page counts")
    return arr.astype(np.int64)


def _selection(choice: Choice) -> Selection:
    return Selection(choice.option >= 0, choice.option == 1, choice.value, choice.pages)


def greedy_select(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity: int, *,
                  memory_weight: float = 1.0) -> Selection:
    """The two-option greedy: KV (``mem_kv`` pages, ``value``) or, where ``hidden_ok`` and it saves
    memory, hidden (``mem_hidden`` pages, ``value - recompute_cost``); ``greedy_choice`` with K = 2."""
    values, pages, allowed = _two_options(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity)
    _check_weight("memory_weight", memory_weight)
    return _selection(_solve(values, pages, allowed, int(capacity), np.zeros(2, dtype=bool), None, memory_weight))


def brute_force_select(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity: int, *,
                       memory_weight: float = 1.0) -> Selection:
    """Exact optimum of the two-option form. Tests only (n <= ~10)."""
    values, pages, allowed = _two_options(value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity)
    return _selection(brute_force_choice(values, pages, allowed, capacity))
