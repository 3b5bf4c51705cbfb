"""Prefix caching over the shared pool: pages named by a hash chain, shared by reference, kept as free
capacity when nobody holds them, evicted tail first; greedy output identical with and without it; the
bookkeeping sound through arrivals, aborts, preemptions, swaps and compressions."""

from __future__ import annotations

import random

import pytest

from apt_serve_ray import LLM, EngineConfig, SamplingParams
from apt_serve_ray.bench.simulator import MHA_LAYOUT, CostModel, SimulatedEngine
from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.request import CacheKind, Request, RequestStatus

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
H = [bytes([i]) * 16 for i in range(32)]  # stand-in names


def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(10, 49000) for _ in range(n)]


# The pool ---------------------------------------------------------------------------------------
def test_a_named_page_outlives_its_request_as_free_capacity_and_is_found_again():
    pool = PagePool(4)
    a = pool.allocate(3, CacheKind.KV, "a")
    assert pool.register(a[0], H[0]) and pool.register(a[1], H[1])
    assert not pool.register(a[2], H[0])  # another page already has that name
    pool.free(a[::-1], "a")
    assert pool.num_free_pages == 4 and pool.num_cached_free_pages == 2 and pool.num_used_pages == 0
    assert pool.lookup([H[0], H[1], H[2]]) == a[:2] and pool.lookup([H[1]]) == [a[1]]
    pool.take(a[:2], "b")
    assert pool.num_free_pages == 2 and pool.num_used(CacheKind.KV) == 2 and pool.refs(a[0]) == 1
    pool.take(a[:1], "c")  # shared
    assert pool.refs(a[0]) == 2 and set(pool.owners(a[0])) == {"b", "c"}
    with pytest.raises(RuntimeError, match="shared"):
        pool.retag(a[:1], CacheKind.KV_INT8, "b")
    with pytest.raises(RuntimeError, match="not 'd'"):
        pool.free(a[:1], "d")
    pool.free(a[:1], "c")
    pool.free(a[1::-1], "b")
    pool.check_integrity()


def test_the_free_list_goes_first_then_the_least_recently_released_tail_pages():
    pool = PagePool(4)
    a = pool.allocate(2, CacheKind.KV, "a")
    b = pool.allocate(2, CacheKind.KV, "b")
    for page, name in zip(a + b, H):
        pool.register(page, name)
    pool.free(a[::-1], "a")  # tail first: a[1] is evicted before a[0]
    pool.free(b[::-1], "b")
    got = pool.allocate(1, CacheKind.KV, "c")
    assert got == [a[1]] and pool.num_evictions == 1
    assert pool.lookup([H[0], H[1]]) == [a[0]]  # the chain is cut where its page went
    assert pool.allocate(4, CacheKind.KV, "d") is None
    assert pool.allocate(3, CacheKind.KV, "d") == [a[0], b[1], b[0]]
    assert pool.num_hashed_pages == 0
    pool.check_integrity()


def test_value_retention_gives_pages_worth_more_a_head_start_that_ages_out():
    from apt_serve_ray.cache.page_pool import RETENTION_SPAN, retention_weight

    pool = PagePool(8)
    pool.page_value = {**pool.page_value, CacheKind.HIDDEN: 2.0}  # a hidden page saves 2x a KV page's prefill
    gold, hidden, plain, batch = (pool.allocate(1, CacheKind.HIDDEN if o == "h" else CacheKind.KV, o)[0]
                                  for o in ("g", "h", "p", "b"))
    for page, name in zip((gold, hidden, plain, batch), H):
        pool.register(page, name)
    pool.free([gold], "g", retention_weight(-10))  # released first, worth 2
    pool.free([hidden], "h")  # worth 2 (its kind)
    pool.free([plain], "p")  # worth 1
    pool.free([batch], "b", retention_weight(10))  # released last, worth 0.5
    assert retention_weight(0) == 1.0 and retention_weight(10) == 0.5 and retention_weight(-10) == 2.0
    # Least worth first, whatever the order they were released in; equal worth: the older first.
    assert pool.allocate(6, CacheKind.KV, "new") == [4, 5, 6, 7, batch, plain]
    assert pool.allocate(1, CacheKind.KV, "new") == [gold]
    pool.free([0], "new")
    pool.check_integrity()
    # The head start is bounded: a gold page goes before plain pages released long enough after it.
    pool = PagePool(4)
    first = pool.allocate(1, CacheKind.KV, "g")[0]
    pool.register(first, H[0])
    pool.free([first], "g", retention_weight(-10))
    later = []
    for i in range(int(RETENTION_SPAN * pool.num_pages) + 2):
        page = pool.allocate(1, CacheKind.KV, f"r{i}")[0]
        pool.register(page, H[i + 1])
        pool.free([page], f"r{i}")
        later.append(page)
    assert first in pool._cached and pool.allocate(3, CacheKind.KV, "x")[0] == first
    lru = PagePool(3, retention="lru")
    a, b = lru.allocate(2, CacheKind.KV, "a")
    lru.register(a, H[0]), lru.register(b, H[1])
    lru.free([a], "a", retention_weight(-50))
    lru.free([b], "a")
    assert lru.allocate(2, CacheKind.KV, "c") == [2, a]  # least recently released, whatever its worth
    with pytest.raises(ValueError, match="retention"):
        PagePool(3, retention="mru")


def test_one_slot_allocator_under_both_tiers():
    from apt_serve_ray.cache.slots import SlotAllocator
    from apt_serve_ray.cache.swap import SwapSpace

    pages, slots = SlotAllocator(4), SlotAllocator(4, lifo=True)
    assert pages.allocate(2, "a") == [0, 1] and slots.allocate(2, "a") == [0, 1]
    pages.free([0], "a")
    slots.free([0], "a")
    assert pages.allocate(3, "b") == [2, 3, 0]  # the pool: first freed, first reused
    assert slots.allocate(1, "b") == [0]  # the tier: last freed, first reused
    slots.add_ref(0, "c")
    assert not slots.release(0, "b") and slots.owners(0) == {"c": 1} and slots.release(0, "c")
    slots.put_free(0)
    assert pages.allocate(1, "c") is None
    pages.check_integrity()
    slots.check_integrity()
    assert isinstance(PagePool(2)._slots, SlotAllocator) and isinstance(SwapSpace(MHA_LAYOUT, 2)._slots, SlotAllocator)


def test_integrity_catches_a_reference_count_out_of_step():
    pool = PagePool(3)
    pages = pool.allocate(2, CacheKind.KV, "a")
    pool._slots._refs[pages[0]] += 1
    with pytest.raises(AssertionError, match="references"):
        pool.check_integrity()


def test_a_request_takes_the_longest_cached_prefix_but_always_computes_its_last_token():
    layout = MHA_LAYOUT
    cache = CacheManager(PagePool(20), layout, enable_prefix_caching=True)
    sp = SamplingParams(max_tokens=4)
    first = Request("a", list(range(100, 164)), sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
    assert cache.allocate(first, 64)
    first.num_computed_tokens = 64
    cache.name_computed_pages(first)
    assert first.num_named_pages == 4
    same = Request("b", list(range(100, 164)), sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
    assert cache.attach_prefix(same, CacheKind.KV) == 48  # 64 tokens: the 4th page holds the last one
    longer = Request("c", list(range(100, 140)) + [1, 2, 3], sp, max_total_tokens=1000, ttft_slo_ms=1e4,
                     tbt_slo_ms=1e3)
    assert cache.attach_prefix(longer, CacheKind.KV) == 32 and longer.page_ids == first.page_ids[:2]
    other_kind = Request("d", list(range(100, 164)), sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
    # A request in another kind takes the KV pages as its prefix segment (K/V read as they are).
    assert cache.attach_prefix(other_kind, CacheKind.HIDDEN) == 48
    assert (other_kind.prefix_kind, other_kind.num_prefix_pages, other_kind.num_prefix_tokens) == (CacheKind.KV, 3, 48)
    assert cache.allocate(other_kind, 64) and len(other_kind.page_ids) == 4
    other_kind.num_computed_tokens = 64
    cache.name_computed_pages(other_kind)  # its hidden page after the segment: not full (16 of 32)
    assert other_kind.num_named_pages == 3
    cache.check_integrity([first, same, longer, other_kind])
    hidden = Request("e", list(range(200, 265)), sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
    assert cache.allocate(hidden, 64, CacheKind.HIDDEN)
    hidden.num_computed_tokens = 64
    cache.name_computed_pages(hidden)
    again = Request("f", list(range(200, 265)), sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3)
    assert cache.attach_prefix(again, CacheKind.KV) == 0  # x would be projected every step: not taken
    assert cache.attach_prefix(again, CacheKind.HIDDEN) == 64
    for r in (first, same, longer, other_kind, hidden, again):
        cache.free(r)
    cache.check_integrity([])
    assert cache.pool.num_used_pages == 0 and cache.pool.num_cached_free_pages == 4 + 2


def test_a_cache_salt_keeps_a_tenants_pages_to_itself():
    cache = CacheManager(PagePool(20), MHA_LAYOUT, enable_prefix_caching=True)
    sp, tokens = SamplingParams(max_tokens=4), list(range(100, 164))

    def request(rid, salt):
        return Request(rid, tokens, sp, max_total_tokens=1000, ttft_slo_ms=1e4, tbt_slo_ms=1e3, cache_salt=salt)

    first = request("a", "tenant-1")
    assert cache.allocate(first, 64)
    first.num_computed_tokens = 64
    cache.name_computed_pages(first)
    assert cache.attach_prefix(request("b", None), CacheKind.KV) == 0  # unsalted: not its pages
    assert cache.attach_prefix(request("c", "tenant-2"), CacheKind.KV) == 0
    same = request("d", "tenant-1")
    assert cache.attach_prefix(same, CacheKind.KV) == 48 and same.page_ids == first.page_ids[:3]


# Greedy output with and without -------------------------------------------------------------------
def _generate(path, prompts, *, waves=True, **kw):
    """Greedy outputs of ``prompts`` (token ids; in waves: each one after the previous finished, so
    later ones find the earlier ones' pages), with the engine's integrity checked after every step."""
    llm = LLM(path, dtype="float32", num_pages=64, max_num_batched_tokens=64, calibrate_rho=False,
              swap_space=0, **kw)
    engine = llm.llm_engine
    outputs, cached = [], []
    for group in ([p] for p in prompts) if waves else [prompts]:
        for out in _drain(engine, group, GREEDY):
            outputs.append(out.outputs[0].token_ids)
            cached.append(out.num_cached_tokens)
    return outputs, cached, engine


def _drain(engine, prompts, params):
    """Add ``prompts`` and step until every request has finished, checking integrity after each step;
    their final outputs, in order."""
    requests = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
    return [done[r.request_id] for r in requests]


def _conversation(seed=0, system_len=70):
    """A shared system prompt, two users, and a second turn that re-sends the first with more."""
    system = _tokens(system_len, seed)
    first = system + _tokens(20, seed + 1)
    return [first, system + _tokens(33, seed + 2), first + _tokens(5, seed + 3) + _tokens(17, seed + 4)]


@pytest.mark.parametrize("shape", ["opt-tiny", "llama-tiny"])
def test_greedy_output_is_the_same_with_and_without_prefix_caching_kv(checkpoint, shape):
    path = checkpoint(shape)
    prompts = _conversation()
    on, cached, engine = _generate(path, prompts, policy="sarathi", enable_prefix_caching=True)
    off, cached_off, _ = _generate(path, prompts, policy="sarathi", enable_prefix_caching=False)
    assert on == off
    assert cached[0] == 0 and cached[1] == 64 and cached[2] >= 80 and cached_off == [0, 0, 0]
    stats = engine.cache.prefix_stats
    assert stats.hits["kv"] == sum(cached) and 0 < stats.hit_rate() < 1
    assert engine.cache_stats().num_cached_pages > 0


def test_requests_running_together_share_the_pages_one_of_them_computed(opt_tiny):
    system = _tokens(80, 5)
    prompts = [system + _tokens(9, 6 + i) for i in range(4)]
    llm = LLM(opt_tiny, dtype="float32", num_pages=64, max_num_batched_tokens=512, calibrate_rho=False,
              swap_space=0, policy="sarathi")
    engine = llm.llm_engine
    first = engine.add_request(prompts[0], GREEDY)
    engine.step()  # its prompt is computed and named
    later = [engine.add_request(p, GREEDY) for p in prompts[1:]]
    engine.step()
    shared = first.page_ids[:5]
    assert all(r.page_ids[:5] == shared for r in later)
    assert all(engine.cache.pool.refs(p) == 4 for p in shared)
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.cache.pool.num_used_pages == 0


@pytest.mark.parametrize("kind", ["hidden", "kv-int8", "hidden-int8"])
def test_compressed_kinds_share_their_own_pages_with_the_same_output(opt_tiny, kind):
    # Every request in ``kind`` (sarathi gives new requests the cheapest offered kind under the ratio):
    # a hit reads pages a forward pass of the same tokens wrote, so the output is the one without it.
    kw = dict(policy="sarathi", cache_kinds=[kind], cache_ratio=1.0)
    prompts = _conversation(seed=3, system_len=230)  # hidden-int8 pages hold 102 tokens here
    on, cached, engine = _generate(opt_tiny, prompts, enable_prefix_caching=True, **kw)
    off, _, _ = _generate(opt_tiny, prompts, enable_prefix_caching=False, **kw)
    assert on == off
    assert cached[1] > 0 and engine.cache.prefix_stats.hits[kind] == sum(cached)


@pytest.mark.parametrize("kind, exact", [("hidden", True), ("kv-int8", False)])
def test_a_kv_prefix_serves_a_request_in_another_kind_and_what_it_adds_is_found_next(opt_tiny, kind, exact):
    # A system prompt cached in KV pages; then (the ratio raised) requests admitted in ``kind``: they
    # take the KV pages as their prefix segment, write their own tokens in ``kind``, and name those
    # after the segment, so the conversation's next turn finds both.
    system = _tokens(96, 40)  # 6 KV pages of 16
    first, second = system + _tokens(9, 41), system + _tokens(60, 42)

    def run(prefix_caching):
        llm = LLM(opt_tiny, dtype="float32", num_pages=64, max_num_batched_tokens=64, calibrate_rho=False,
                  swap_space=0, policy="sarathi", cache_kinds=[kind], enable_prefix_caching=prefix_caching)
        engine = llm.llm_engine
        outs = _drain(engine, [first], GREEDY)  # cache_ratio 0: KV
        engine.adjust_cache_ratio(1.0)  # sarathi gives new requests the compressed kind from now on
        outs += _drain(engine, [second], GREEDY)
        third = second + list(outs[-1].outputs[0].token_ids) + _tokens(7, 43)
        outs += _drain(engine, [third], GREEDY)
        return outs, engine

    on, engine = run(True)
    off, _ = run(False)
    tpp = engine.cache.layout.tokens_per_page(CacheKind(kind))
    own = len(second) + GREEDY.max_tokens - 1 - 96  # its tokens in K/V or x when it finished
    assert own >= tpp and [o.num_cached_tokens for o in on] == [0, 96, 96 + own // tpp * tpp]
    if exact:  # the prefix read as K/V instead of projected from x: the same numbers
        assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    else:  # the prefix exact instead of quantised: it agrees with the all-int8 run on most tokens
        agree = sum(a == b for o1, o2 in zip(on, off) for a, b in zip(o1.outputs[0].token_ids, o2.outputs[0].token_ids))
        assert agree >= 0.75 * 3 * GREEDY.max_tokens
    stats = engine.cache.prefix_stats
    assert stats.hits["kv"] == 2 * 96 and stats.hits[kind] == on[2].num_cached_tokens - 96
    engine.check_integrity()


# Randomised bookkeeping ---------------------------------------------------------------------------
def test_randomised_arrivals_aborts_preemptions_swaps_and_compressions_keep_the_pool_sound():
    rng = random.Random(1)
    config = EngineConfig(policy="apt", cache_kinds=["hidden", "kv-int8", "hidden-int8"], cache_ratio=0.5,
                          max_num_batched_tokens=256, max_num_seqs=16, swap_space=0.05, enable_watermarks=True)
    sim = SimulatedEngine(config, num_pages=48, cost=CostModel(prefill_pair_s=1e-8))
    engine = sim.llm_engine
    systems = [[rng.randrange(10, 30000) for _ in range(rng.randrange(16, 120))] for _ in range(4)]
    histories: list[list[int]] = []
    segmented = set()  # requests that kept a shared prefix in another kind than their own pages
    for step in range(3000):
        if rng.random() < 0.4:
            if histories and rng.random() < 0.3:  # a next turn: a past prompt and more
                base = rng.choice(histories)
            else:
                base = list(rng.choice(systems))
            prompt = base + [rng.randrange(10, 30000) for _ in range(rng.randrange(1, 60))]
            prompt = prompt[: 400]
            histories.append(prompt)
            slo = rng.choice([(500.0, 100.0), (5000.0, 1000.0)])
            sim.add(0, rng.randrange(1, 80), prompt_token_ids=prompt, ttft_slo_ms=slo[0], tbt_slo_ms=slo[1],
                    priority=rng.choice([0, 10]))
        if rng.random() < 0.03 and engine.requests:
            engine.abort_request(rng.choice(list(engine.requests)))
        if step % 500 == 250:
            engine.cache.reset_prefix_cache()
        sim.step()
        engine.check_integrity()
        segmented.update(r.request_id for r in engine.scheduler.running if r.num_prefix_pages)
    sim.run_until_idle()
    engine.check_integrity()
    pool, sched = engine.cache.pool, engine.scheduler
    assert pool.num_used_pages == 0 and pool.num_free_pages == pool.num_pages
    # Measured at this seed: 37% of tokens found, 46 preemptions (25 into the tier), 718 compressions,
    # 749 requests with a prefix segment (before issue 44's admission promise: 96 preemptions, 58 into
    # the tier, 436 compressions: it starts fewer requests than will fit their steps).
    assert engine.cache.prefix_stats.hit_rate() > 0.1 and sum(engine.cache.prefix_stats.tier_hits.values()) > 0
    assert sched.num_preemptions > 30 and sched.num_swap_outs > 15
    assert sum(r.num_compressions for r in sim.finished) > 50 and len(segmented) > 50
    assert all(r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED) for r in sim.finished)


def test_prefix_caching_switch_is_validated():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(enable_prefix_caching="yes")
    assert EngineConfig().enable_prefix_caching is True


# Demote, don't drop -------------------------------------------------------------------------------
def test_an_evicted_prefix_waits_in_the_tier_and_comes_back_byte_for_byte(opt_tiny):
    history = _tokens(170, 21)  # 10 full pages once computed
    fillers = [_tokens(150, 30 + i) for i in range(2)]  # together they need most pages history sits in
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", num_pages=24, max_num_batched_tokens=256, calibrate_rho=False, policy="sarathi")

    def run(**extra):
        engine = LLM(opt_tiny, **kw, **extra).llm_engine
        outs = [out for group in ([history], fillers, [history + [5, 6, 7]]) for out in _drain(engine, group, sp)]
        return outs, engine

    with_tier, engine = run(swap_space=0.01)
    plain, _ = run(enable_prefix_caching=False, swap_space=0)
    assert [o.outputs[0].token_ids for o in with_tier] == [o.outputs[0].token_ids for o in plain]
    stats = engine.cache.prefix_stats
    # Its pages are evicted tail first: the head stays in memory, the rest comes back from the tier.
    assert stats.num_demoted >= 8 and stats.tier_hits["kv"] >= 96  # measured: 16 demoted, 7 pages back
    assert with_tier[-1].num_cached_tokens == 160  # its 10 full pages of history: in memory or from the tier
    engine.cache.reset_prefix_cache()
    assert engine.cache.num_tier_pages == 0
    engine.check_integrity()


def test_apt_sees_a_prefix_cached_in_a_compressed_kind_and_admits_in_that_kind():
    from apt_serve_ray.scheduler.candidates import KIND_CODE, Candidates
    from apt_serve_ray.scheduler.costs import StepCosts
    from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler
    from apt_serve_ray.scheduler.context import SchedulingContext

    config = EngineConfig(policy="sarathi", cache_kinds=["hidden"], cache_ratio=1.0, max_num_batched_tokens=512,
                          swap_space=0)
    sim = SimulatedEngine(config, num_pages=80)
    history = list(range(100, 260))
    sim.add(0, 4, prompt_token_ids=history)  # sarathi: new requests in the cheapest compressed kind
    sim.run_until_idle()
    assert sim.finished[0].last_kind is CacheKind.HIDDEN
    nxt = sim.add(0, 4, prompt_token_ids=history + [7] * 20)
    ctx = SchedulingContext(sim.scheduler, sim.now)
    c = Candidates.gather(ctx)
    assert c.hit_kind[0] == KIND_CODE[CacheKind.HIDDEN] and c.num_computed[0] == 160  # 5 pages of 32
    policy = AdaptiveScheduler(config=config)
    policy.set_costs(StepCosts(rho=1e-6))  # the hidden kind pays: apt offers it
    sim.llm_engine.set_policy(policy)
    sim.run_until_idle()
    # Admitted in hidden with its 160 tokens found (apt may upgrade it to KV afterwards, memory allowing).
    assert nxt.num_cached_tokens == 160 and (nxt.last_kind is CacheKind.HIDDEN or nxt.num_upgrades == 1)
    sim.llm_engine.check_integrity()
