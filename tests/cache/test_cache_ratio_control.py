"""``cache_ratio`` is a real control under the adaptive policy: the ceiling of compressed pages that
``apt`` chooses below, moved by ``adjust_cache_ratio``, the monitor callback (the seed's recipe, as
written) and the watermarks, on the real engine."""

from __future__ import annotations

import random

from apt_serve_ray import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 49000) for _ in range(rng.randrange(60, 120))] for _ in range(n)]


def _llm(path: str, ratio: float, **kw) -> LLM:
    # calibrate_rho=False: the hidden kind's recompute is not priced (rho unknown), so memory pressure
    # alone decides whether apt wants compressed pages; the ceiling decides how many it may take.
    return LLM(path, dtype="float32", num_pages=48, cache_ratio=ratio, policy="apt", calibrate_rho=False,
               max_num_batched_tokens=256, attention_backend="torch", **kw)


class _PagesByKind:
    """The most compressed pages seen at any step, and the most ever allowed by the ceiling."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.max_compressed, self.max_over = llm, 0, 0
        llm.llm_engine.add_observer(self)

    def on_request_event(self, *args) -> None:
        pass

    def on_step(self, engine, stats, now) -> None:
        cache = stats.cache
        compressed = sum(n for kind, n in cache.pages_by_kind.items() if kind != "kv")
        self.max_compressed = max(self.max_compressed, compressed)
        self.max_over = max(self.max_over, compressed - int(cache.cache_ratio * cache.num_pages))


def test_apt_takes_no_compressed_pages_at_cache_ratio_zero_even_under_memory_pressure(opt_tiny):
    llm = _llm(opt_tiny, 0.0)
    seen = _PagesByKind(llm)
    outs = llm.generate(_prompts(12), PARAMS)
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    # Real pressure: 12 requests of 60-120 prompt + 48 output tokens need more than the 48 pages.
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert seen.max_compressed == 0


def test_the_seeds_monitor_callback_recipe_raises_the_ceiling_and_apt_uses_it(opt_tiny):
    llm = _llm(opt_tiny, 0.0)
    seen = _PagesByKind(llm)

    def on_usage(usage: float) -> None:  # the seed's recipe, as written
        if usage > 0.8:
            llm.adjust_cache_ratio(min(0.7, llm.cache_ratio + 0.1))

    llm.set_monitor_callback(on_usage)
    outs = llm.generate(_prompts(12), PARAMS)
    assert all(len(o.outputs[0].token_ids) == 48 for o in outs)
    assert 0.0 < llm.cache_ratio <= 0.7
    assert seen.max_compressed > 0  # apt chose hidden pages once the ceiling allowed them
    pool = llm.llm_engine.cache.pool
    pool.check_integrity()
    assert pool.num_free_pages == pool.num_pages


def test_a_higher_ceiling_lets_apt_hold_more_compressed_pages_and_never_more_than_it(opt_tiny):
    held = {}
    for ratio in (0.2, 0.6):
        llm = _llm(opt_tiny, ratio)
        seen = _PagesByKind(llm)
        llm.generate(_prompts(12, seed=1), PARAMS)
        held[ratio] = seen.max_compressed
        # Admissions never pass the ceiling; compressed requests already running may grow past it, by
        # at most the pages of their 48 new tokens (32 per hidden page: 2 pages each, 12 requests).
        assert seen.max_over <= 12 * 2
    assert 0 < held[0.2] < held[0.6], held
