"""The scheduler's selection step: greedy is a 2-approximation of the exact optimum and always fits."""

import numpy as np
import pytest

from apt_serve_ray.scheduler.knapsack import Selection, brute_force_select, greedy_select


def _random_instance(rng: np.random.Generator):
    n = int(rng.integers(1, 8))
    style = rng.integers(4)
    if style == 0:  # equal densities everywhere: ties must be handled deterministically
        mem_kv = rng.integers(1, 5, n) * 2
        value = mem_kv * 1.5
    else:
        mem_kv = rng.integers(0 if style == 1 else 1, 13, n)
        value = np.round(rng.uniform(0, 10, n), 1 if style == 2 else 6)
    if rng.random() < 0.5:
        mem_hidden = (mem_kv + 1) // 2  # MHA: half, rounded up to whole pages
    else:
        mem_hidden = rng.integers(0, 15, n)  # anything, including larger than KV (GQA)
    recompute_cost = value * rng.choice([0.0, 0.2, 0.5, 0.8, 1.5], n)
    hidden_ok = rng.random(n) < rng.choice([0.0, 0.5, 1.0])
    total = int(mem_kv.sum())
    roll = rng.random()
    if roll < 0.1:
        capacity = 0
    elif roll < 0.3:
        capacity = int(rng.integers(1, 6))  # smaller than most items
    else:
        capacity = int(rng.integers(1, total + 2))
    return value, recompute_cost, mem_kv, mem_hidden, hidden_ok, capacity


def _check_consistent(sel: Selection, value, cost, mem_kv, mem_hidden, hidden_ok, capacity):
    assert sel.chosen.dtype == bool and sel.hidden.dtype == bool
    assert not np.any(sel.hidden & ~sel.chosen)
    assert not np.any(sel.hidden & ~hidden_ok)
    pages = np.where(sel.hidden, mem_hidden, mem_kv)[sel.chosen].sum()
    val = np.where(sel.hidden, value - cost, value)[sel.chosen].sum()
    assert sel.pages == pages <= capacity
    assert sel.value == pytest.approx(val, abs=1e-9)


def test_greedy_is_half_optimal_and_fits_on_random_instances():
    rng = np.random.default_rng(20250407)
    for _ in range(3000):
        args = _random_instance(rng)
        greedy = greedy_select(*args)
        exact = brute_force_select(*args)
        _check_consistent(greedy, *args)
        _check_consistent(exact, *args)
        assert greedy.value <= exact.value + 1e-9
        assert greedy.value >= 0.5 * exact.value - 1e-9, args


def test_greedy_is_deterministic_on_ties():
    mem = np.full(6, 4)
    args = (np.full(6, 2.0), np.zeros(6), mem, mem // 2, np.zeros(6, bool), 10)
    first = greedy_select(*args)
    assert first.chosen.tolist() == [True, True, False, False, False, False]
    assert greedy_select(*args).chosen.tolist() == first.chosen.tolist()


def test_hidden_value_below_half_is_offered_only_as_kv():
    # v=10, c=6: hidden value 4 < 5. Capacity fits exactly the hidden kind of both requests
    # (8 points) or the KV kind of one (10): KV-only offer must pick one KV.
    sel = greedy_select([10.0, 10.0], [6.0, 6.0], [4, 4], [2, 2], [True, True], 4)
    assert sel.chosen.sum() == 1 and not sel.hidden.any()
    assert sel.value == 10.0


def test_hidden_value_at_least_half_runs_hidden_under_pressure():
    # c=2: hidden value 8 >= 5, so both run hidden (16) rather than one KV (10).
    sel = greedy_select([10.0, 10.0], [2.0, 2.0], [4, 4], [2, 2], True, 4)
    assert sel.chosen.all() and sel.hidden.all() and sel.value == 16.0 and sel.pages == 4


def test_upgrade_taken_when_memory_allows():
    sel = greedy_select([10.0, 10.0], [2.0, 2.0], [4, 4], [2, 2], True, 8)
    assert sel.chosen.all() and not sel.hidden.any() and sel.value == 20.0 and sel.pages == 8


def test_hidden_not_ok_never_runs_hidden():
    rng = np.random.default_rng(7)
    for _ in range(200):
        value, cost, mem_kv, mem_hidden, _, capacity = _random_instance(rng)
        sel = greedy_select(value, cost, mem_kv, mem_hidden, np.zeros(len(value), bool), capacity)
        assert not sel.hidden.any()


def test_hidden_never_chosen_when_it_saves_no_memory():
    sel = greedy_select([10.0], [0.0], [4], [4], True, 4)
    assert sel.chosen.all() and not sel.hidden.any()


def test_first_misfit_picks_the_single_big_item_when_it_beats_the_prefix():
    # Small item: density 2 (value 2, 1 page). Big item: density 1.9 (value 19, 10 pages).
    # Prefix = small (2); big misfits but alone is worth 19 and fits in 10 pages.
    sel = greedy_select([2.0, 19.0], [0.0, 0.0], [1, 10], [1, 10], False, 10)
    assert sel.chosen.tolist() == [False, True] and sel.value == 19.0


def test_first_misfit_upgrade_alone_means_whole_kv_item():
    # Request 0: hidden (1 page, value 9) then upgrade (1 page, value 1). Request 1: KV, 2 pages,
    # value 9.5 (density 4.75): prefix = hidden0 + kv1 = 18.5 uses 3 of 3 pages; the upgrade
    # misfits, and alone (KV item of request 0, value 10) is worse, so the prefix stays.
    sel = greedy_select([10.0, 9.5], [1.0, 0.0], [2, 2], [1, 2], [True, False], 3)
    assert sel.chosen.tolist() == [True, True] and sel.hidden.tolist() == [True, False]
    assert sel.value == 18.5 and sel.pages == 3


def test_zero_capacity_takes_only_zero_page_requests():
    sel = greedy_select([1.0, 5.0, 0.0], [0.0, 0.0, 0.0], [0, 3, 0], [0, 2, 0], True, 0)
    assert sel.chosen.tolist() == [True, False, True] and sel.pages == 0


def test_kv_larger_than_capacity_is_offered_hidden_alone():
    sel = greedy_select([10.0], [7.0], [8], [4], True, 5)
    assert sel.chosen.all() and sel.hidden.all() and sel.value == pytest.approx(3.0)


def test_memory_weight_zero_ranks_by_value_only():
    args = ([1.0, 5.0], [0.0, 0.0], [1, 10], [1, 10], False, 10)
    assert greedy_select(*args, memory_weight=0.0).chosen.tolist() == [False, True]


def test_empty_input():
    sel = greedy_select([], [], [], [], [], 10)
    assert sel.chosen.shape == (0,) and sel.value == 0.0 and sel.pages == 0


@pytest.mark.parametrize("override, field", [
    (dict(capacity=-1), "capacity"),
    (dict(capacity=2.5), "capacity"),
    (dict(recompute_cost=[1.0]), "recompute_cost"),
    (dict(mem_kv=[1, 2, 3]), "mem_kv"),
    (dict(mem_hidden=[1]), "mem_hidden"),
    (dict(hidden_ok=[True]), "hidden_ok"),
    (dict(value=[-1.0, 1.0]), "value"),
    (dict(mem_kv=[1, -2]), "mem_kv"),
    (dict(mem_hidden=[1.5, 1]), "mem_hidden"),
    (dict(memory_weight=-0.5), "memory_weight"),
])
def test_greedy_errors_name_the_field(override, field):
    args = dict(value=[1.0, 2.0], recompute_cost=[0.0, 0.0], mem_kv=[2, 2], mem_hidden=[1, 1],
                hidden_ok=[True, False], capacity=3)
    args.update(override)
    with pytest.raises(ValueError, match=field):
        greedy_select(**args)


def test_first_misfit_upgrade_alone_can_win_as_kv():
    # Request 0: hidden (1 page, value 6, density 6), upgrade (2 pages, value 4, density 2).
    # Request 1: KV, 1 page, value 3. Prefix = hidden0 + kv1 = 9 in 2 of 3 pages; the upgrade
    # misfits and request 0 alone as KV (10 in 3 pages) is better.
    sel = greedy_select([10.0, 3.0], [4.0, 0.0], [3, 1], [1, 1], [True, False], 3)
    assert sel.chosen.tolist() == [True, False] and not sel.hidden.any()
    assert sel.value == 10.0 and sel.pages == 3


# K options per request (every cache kind), and the compressed-pages ceiling ----------------------------
from apt_serve_ray.scheduler.knapsack import SKIP, Choice, brute_force_choice, greedy_choice  # noqa: E402


def _random_kinds_instance(rng: np.random.Generator):
    """n requests, K options; column 0 is plain (KV), the others compressed (fewer pages, less value)."""
    n, k = int(rng.integers(1, 7)), int(rng.integers(1, 5))
    mem_kv = rng.integers(0 if rng.random() < 0.2 else 1, 13, n)
    value = np.round(rng.uniform(0, 10, n), int(rng.integers(1, 7)))
    pages = np.empty((n, k), dtype=np.int64)
    values = np.empty((n, k))
    pages[:, 0], values[:, 0] = mem_kv, value
    for j in range(1, k):
        ratio = rng.choice([0.5, 0.53, 0.4, 1.0, 1.3])  # hidden, kv-int8, hidden-int8, none, GQA hidden
        pages[:, j] = np.ceil(mem_kv * ratio).astype(np.int64)
        values[:, j] = value - value * rng.choice([0.0, 0.1, 0.5, 0.9, 1.5], n)  # may go negative
    allowed = rng.random((n, k)) < rng.choice([0.5, 0.9, 1.0])
    compressed = np.arange(k) > 0
    total = int(pages.max(axis=1).sum())
    capacity = int(rng.integers(0, total + 2))
    limit = None if rng.random() < 0.3 else int(rng.integers(0, max(1, total // 2) + 1))
    return (values, pages, allowed, capacity), dict(compressed=compressed, compressed_limit=limit)


def _check_choice(choice: Choice, values, pages, allowed, capacity, compressed, compressed_limit):
    rows = np.flatnonzero(choice.option != SKIP)
    cols = choice.option[rows]
    assert np.all(allowed[rows, cols]) and np.all((choice.option >= SKIP) & (choice.option < values.shape[1]))
    assert choice.pages == pages[rows, cols].sum() <= capacity
    assert choice.compressed_pages == pages[rows, cols][compressed[cols]].sum()
    if compressed_limit is not None:
        assert choice.compressed_pages <= compressed_limit
    assert choice.value == pytest.approx(values[rows, cols].sum(), abs=1e-9)


def test_multiple_choice_greedy_is_half_optimal_without_a_ceiling():
    rng = np.random.default_rng(13)
    for _ in range(2000):
        args, kw = _random_kinds_instance(rng)
        kw["compressed_limit"] = None
        greedy, exact = greedy_choice(*args, **kw), brute_force_choice(*args, **kw)
        _check_choice(greedy, *args, **kw)
        _check_choice(exact, *args, **kw)
        assert exact.value * 0.5 - 1e-9 <= greedy.value <= exact.value + 1e-9, (args, kw)


def test_multiple_choice_greedy_never_exceeds_the_ceiling_and_keeps_a_quarter_of_the_optimum():
    rng = np.random.default_rng(14)
    bound_was_half = []
    for _ in range(2000):
        args, kw = _random_kinds_instance(rng)
        greedy, exact = greedy_choice(*args, **kw), brute_force_choice(*args, **kw)
        _check_choice(greedy, *args, **kw)
        assert exact.value * 0.25 - 1e-9 <= greedy.value <= exact.value + 1e-9, (args, kw)
        bound_was_half.append(greedy.value >= 0.5 * exact.value - 1e-9)
    assert np.mean(bound_was_half) > 0.95  # the 1/4 is a worst case; in practice the fix-up rarely loses much


def test_multiple_choice_greedy_is_exact_where_the_lp_is_integral():
    # Every option of every request fits together: no misfit, so the LP optimum is integral and the
    # greedy takes it (each request its most valuable option).
    rng = np.random.default_rng(15)
    for _ in range(500):
        (values, pages, allowed, _), kw = _random_kinds_instance(rng)
        capacity = int(pages.max(axis=1).sum())
        greedy = greedy_choice(values, pages, allowed, capacity, compressed=kw["compressed"])
        exact = brute_force_choice(values, pages, allowed, capacity, compressed=kw["compressed"])
        assert greedy.value == pytest.approx(exact.value, abs=1e-9)
    # And a prefix that fills the capacity exactly: hidden items of both (2 + 2 pages), then nothing fits.
    values, pages = np.array([[10.0, 8.0], [10.0, 8.0]]), np.array([[4, 2], [4, 2]])
    assert greedy_choice(values, pages, None, 4).value == brute_force_choice(values, pages, None, 4).value == 16.0


def test_the_cheapest_sufficient_kind_wins_and_each_request_gets_at_most_one():
    # Options: KV (4 pages, 10), kv-int8 (2 pages, 9.5), hidden (2 pages, 6). Two requests, 4 pages: both kv-int8.
    values = np.array([[10.0, 9.5, 6.0]] * 2)
    pages = np.array([[4, 2, 2]] * 2)
    choice = greedy_choice(values, pages, None, 4, compressed=[False, True, True])
    assert choice.option.tolist() == [1, 1] and choice.value == 19.0
    # With room for both in KV they are upgraded in place of the compressed kinds.
    assert greedy_choice(values, pages, None, 8, compressed=[False, True, True]).option.tolist() == [0, 0]


def test_a_zero_ceiling_means_no_compressed_option_and_a_tight_one_falls_back_to_kv():
    values = np.array([[10.0, 9.0]] * 3)
    pages = np.array([[4, 2]] * 3)
    args = (values, pages, None, 8)
    free = greedy_choice(*args, compressed=[False, True])  # all three compressed, then one upgrade fits
    assert free.option.tolist() == [0, 1, 1] and free.value == 28.0 and free.compressed_pages == 4
    assert greedy_choice(*args, compressed=[False, True], compressed_limit=0).option.tolist() == [0, 0, SKIP]
    tight = greedy_choice(*args, compressed=[False, True], compressed_limit=2)
    assert tight.compressed_pages <= 2 and tight.pages <= 8  # two KV (20) beat one KV and one compressed (19)
    assert tight.value == brute_force_choice(*args, compressed=[False, True], compressed_limit=2).value == 20.0
    # Where KV does not fit, the compressed options kept under the ceiling are the ones that entered first.
    first = greedy_choice(np.array([[10.0, 9.0], [10.0, 8.0]]), np.array([[6, 2], [6, 2]]), None, 4,
                          compressed=[False, True], compressed_limit=2)
    assert first.option.tolist() == [1, SKIP] and first.value == 9.0


@pytest.mark.parametrize("override, field", [
    (dict(values=[[1.0, np.nan]]), "values"),
    (dict(pages=[[1, 2, 3]]), "pages"),
    (dict(pages=[[1, -1]]), "pages"),
    (dict(allowed=[[True, False, True]]), "allowed"),
    (dict(capacity=-1), "capacity"),
    (dict(compressed=[True]), "compressed"),
    (dict(compressed_limit=-2), "compressed_limit"),
    (dict(memory_weight=np.inf), "memory_weight"),
])
def test_choice_errors_name_the_field(override, field):
    args = dict(values=[[1.0, 0.5]], pages=[[2, 1]], allowed=[[True, True]], capacity=3, compressed=[False, True],
                compressed_limit=1)
    args.update(override)
    with pytest.raises(ValueError, match=field):
        greedy_choice(**args)


def test_the_two_option_fast_path_walks_the_same_hull_as_the_general_one():
    from apt_serve_ray.scheduler import knapsack

    rng = np.random.default_rng(16)
    for _ in range(300):
        (values, pages, allowed, _), _ = _random_kinds_instance(rng)
        if values.shape[1] < 2:
            continue
        values, pages, allowed = values[:, :2], pages[:, :2], allowed[:, :2] & (values[:, :2] >= 0)
        if rng.random() < 0.3:  # equal pages and values: ties must resolve the same way
            pages[:, 1], values[:, 1] = pages[:, 0], values[:, 0]
        for w in (1.0, 0.5):
            args = (list(values.T), list(pages.T), list(allowed.T), w)
            general, fast = knapsack._chains(*args), knapsack._chains2(*args)
            none = (np.full(len(values), SKIP),)  # a level no request reaches
            for t in range(2):
                g = general[t] if t < len(general) else none
                f = fast[t] if t < len(fast) else none
                assert np.array_equal(g[0], f[0]), t
                on = g[0] != SKIP
                for a, b in zip(g[1:], f[1:]):
                    assert np.array_equal(a[on], b[on]), t
