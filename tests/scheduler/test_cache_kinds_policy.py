"""``apt`` over every cache kind: one value model prices KV, kv-int8, hidden and hidden-int8 by pages and
measured per-step cost, and ``cache_ratio`` is the ceiling of the pages its admissions put in compressed
kinds (0: none at all), moved at run time by ``adjust_cache_ratio`` (the monitor callback's and the
controller's path). On the simulator: the real scheduler, pool and policy; the runner computes nothing,
but its ``layout`` gives every kind its page geometry."""

from __future__ import annotations

import logging

import pytest
import torch

from apt_serve_ray import EngineConfig
from apt_serve_ray.bench.simulator import MHA_LAYOUT, CostModel, SimulatedEngine
from apt_serve_ray.worker.calibration import measure_costs
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler

ALL_KINDS = ("hidden", "kv-int8", "hidden-int8")
COMPRESSED = (CacheKind.HIDDEN, CacheKind.KV_INT8, CacheKind.HIDDEN_INT8)


def _compressed_pages(sim: SimulatedEngine) -> int:
    return sum(sim.cache.pool.num_used(k) for k in COMPRESSED)


def _run(costs: StepCosts, *, cache_ratio: float = 0.0, cache_kinds=ALL_KINDS, num_pages: int = 30,
         num_requests: int = 12, check_ceiling: bool = True, prompt: int = 60,
         output: int = 30) -> tuple[SimulatedEngine, dict[CacheKind, int]]:
    """A burst of ``num_requests`` (60 prompt + 30 output tokens, 6 KV pages each) on ``num_pages``: memory
    binds. ``cache_ratio`` is set after start-up, as the controller would. Returns the engine and, per
    kind, the pages held summed over the steps. With ``check_ceiling``, every step's admissions in
    compressed kinds are held to the ceiling (the pages already held, not counting the running
    requests' own growth, plus the admitted ones' pages <= cache_ratio x pool)."""
    config = EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False, max_num_batched_tokens=4096,
                          cache_kinds=cache_kinds)
    policy = AdaptiveScheduler(config=config)
    policy.set_costs(costs)
    sim = SimulatedEngine(config, num_pages=num_pages, policy=policy)
    sim.llm_engine.adjust_cache_ratio(cache_ratio)
    for _ in range(num_requests):
        sim.add(prompt, output)
    sim.now += 1.0
    held = dict.fromkeys(CacheKind, 0)
    limit = int(cache_ratio * num_pages)
    while sim.scheduler.num_unfinished:
        before = _compressed_pages(sim)
        running = set(map(id, sim.scheduler.running))
        out = sim.step()
        # A compressed copy coming back from the tier in its kind is held memory, admitted under the
        # ceiling before (it may come back past it, as a running compressed request grows past it).
        back = {p.request_id for p in out.swap_in if not p.is_conversion}
        admitted = [c.request for c in out.chunks if id(c.request) not in running and c.request.kind in COMPRESSED
                    and c.request.request_id not in back]
        if check_ceiling and admitted:
            assert before + sum(len(r.page_ids) for r in admitted) <= limit
        for kind in CacheKind:
            held[kind] += sim.cache.pool.num_used(kind)
        sim.cache.pool.check_integrity()
    assert len(sim.finished) == num_requests and sim.cache.pool.num_free_pages == num_pages
    return sim, held


CHEAP = StepCosts(rho=1e-6, kind_costs={"kv-int8": 1e-6, "hidden-int8": 1e-6})  # every kind pays when memory binds


def test_at_cache_ratio_zero_apt_takes_no_compressed_page_even_under_heavy_pressure():
    _, held = _run(CHEAP, cache_ratio=0.0, num_requests=20)
    assert all(held[k] == 0 for k in COMPRESSED)
    _, free = _run(CHEAP, cache_ratio=1.0, num_requests=20)  # the same burst with no ceiling: it does
    assert sum(free[k] for k in COMPRESSED) > 0


def test_raising_cache_ratio_lets_apt_hold_more_compressed_pages_and_never_past_the_ceiling():
    totals = []
    for ratio in (0.0, 0.1, 0.3, 1.0):
        _, held = _run(CHEAP, cache_ratio=ratio)  # _run checks every admission against the ceiling
        totals.append(sum(held[k] for k in COMPRESSED))
    assert totals[0] == 0 and totals == sorted(totals) and totals[-1] > totals[1] > 0


def test_lowering_cache_ratio_mid_run_stops_compressed_admissions():
    config = EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False, max_num_batched_tokens=4096,
                          cache_kinds=ALL_KINDS, cache_ratio=1.0)
    sim = SimulatedEngine(config, num_pages=30, policy=AdaptiveScheduler(config=config))
    sim.scheduler.policy.set_costs(CHEAP)
    for _ in range(16):
        sim.add(60, 30)
    while _compressed_pages(sim) == 0:
        sim.step()
    sim.llm_engine.adjust_cache_ratio(0.0)  # the controller's heavy-to-light move, or the operator
    assert sim.scheduler.cache_ratio == 0.0
    while sim.scheduler.num_unfinished:
        running = set(map(id, sim.scheduler.running))
        out = sim.step()
        # A compressed copy in the tier may come back in its kind (it is held memory admitted under the
        # ceiling before, as a running compressed request keeps its kind when the ratio drops); nothing new.
        assert not [c for c in out.chunks if id(c.request) not in running and c.request.kind in COMPRESSED
                    and not c.request.num_swaps]
    assert len(sim.finished) == 16


def test_cheap_int8_is_chosen_over_the_hidden_kind():
    # 20 + 9 tokens: 2 KV pages, 1 page in either kv-int8 (30 tokens a page) or hidden (32). At equal
    # pages the cheaper kind is worth more. (Where hidden saves a page more, the value model weighs the
    # page against the recompute: that is a trade-off, not a preference.)
    burst = dict(cache_ratio=1.0, num_pages=14, num_requests=12, prompt=20, output=9)
    _, alone = _run(StepCosts(rho=2e-4), cache_kinds=("hidden",), **burst)
    assert alone[CacheKind.HIDDEN] > 0  # hidden pays here when it is the only compressed kind
    _, both = _run(StepCosts(rho=2e-4, kind_costs={"kv-int8": 1e-6}), cache_kinds=("hidden", "kv-int8"), **burst)
    assert both[CacheKind.KV_INT8] > 0 and both[CacheKind.HIDDEN] == 0


@pytest.mark.parametrize("kind", ["hidden", "kv-int8", "hidden-int8"])
def test_requests_of_every_compressed_kind_go_back_to_kv_in_place_when_pages_allow(kind):
    # A compressed kind is a remedy for memory pressure, not a state: as the shorter requests finish,
    # the longer ones still running are upgraded (the cache manager copies from any compressed kind).
    config = EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False, max_num_batched_tokens=4096,
                          cache_kinds=(kind,), cache_ratio=1.0)
    sim = SimulatedEngine(config, num_pages=14, policy=AdaptiveScheduler(config=config))
    sim.scheduler.policy.set_costs(CHEAP)
    requests = [sim.add(20, 2 + 3 * (i % 4)) for i in range(12)]
    sim.now += 1.0
    sim.run_until_idle()
    assert any(r.num_upgrades and r.last_kind is CacheKind.KV for r in requests)
    assert any(r.last_kind is CacheKind(kind) for r in requests)  # and some ran in the kind to the end


def test_on_a_cpu_like_cost_model_hidden_kinds_are_never_offered_but_cheap_int8_is():
    # a = 4 ms fixed per step; hidden recompute 0.1 ms per KV page of context: a pool of 30 pages held
    # hidden adds 6 ms per step (> a, tokens per second fall); kv-int8 dequantisation 2 us per page: 0.1 ms.
    cpu_like = StepCosts(rho=1e-4, step_time=CostModel(base_s=0.004),
                         kind_costs={"kv-int8": 2e-6, "hidden-int8": 1.2e-4})
    policy = AdaptiveScheduler(rho=1e-4, step_model=CostModel(base_s=0.004))
    assert not policy.kind_pays_for_throughput(30, 0.5, 1e-4)
    assert policy.kind_pays_for_throughput(30, 16 / 30, 2e-6)
    _, held = _run(cpu_like, cache_ratio=1.0)
    assert held[CacheKind.HIDDEN] == held[CacheKind.HIDDEN_INT8] == 0 and held[CacheKind.KV_INT8] > 0


def test_a_kind_the_runner_could_not_time_is_never_offered():
    costs = StepCosts(rho=1e-6, kind_costs={"hidden-int8": 1e-6}, unavailable={CacheKind.KV_INT8})
    _, held = _run(costs, cache_ratio=1.0)
    assert held[CacheKind.KV_INT8] == 0 and held[CacheKind.HIDDEN] + held[CacheKind.HIDDEN_INT8] > 0


class _RunnerWithoutInt8:
    """What calibration reads of a runner, with an attention backend that has no int8 decode yet."""

    layout, storage, device, dtype = MHA_LAYOUT, None, torch.device("cpu"), torch.float32
    max_model_len, num_pages = 1024, 64

    class model:  # noqa: N801 -- stands for the runner's model object
        class shape:  # noqa: N801
            num_heads, head_dim = 12, 64

    attention = object()


def test_a_kind_whose_calibration_fails_is_marked_unavailable_and_start_up_goes_on(caplog):
    known = StepCosts(rho=1e-5, step_time=CostModel())
    with caplog.at_level(logging.WARNING, logger="apt_serve_ray"):
        costs = measure_costs(_RunnerWithoutInt8(), None, known, hidden_allowed=True,
                              kinds=(CacheKind.KV_INT8, CacheKind.HIDDEN))
    assert costs.unavailable == {CacheKind.KV_INT8} and costs.rho == 1e-5 and not costs.known(CacheKind.KV_INT8)
    assert "kv-int8" in caplog.text


def test_step_costs_keep_one_cost_per_compressed_kind():
    costs = StepCosts(rho=0.5, kind_costs={"kv-int8": 0.01, CacheKind.HIDDEN_INT8: 0.7})
    assert costs.seconds_per_page(CacheKind.HIDDEN) == 0.5 and costs.seconds_per_page(CacheKind.KV_INT8) == 0.01
    assert costs.seconds_per_page(CacheKind.KV) == 0.0
    assert costs == StepCosts(0.5, None, {"hidden-int8": 0.7, "kv-int8": 0.01})  # order-free, hashable
    assert hash(costs) == hash(StepCosts(0.5, None, {"kv-int8": 0.01, "hidden-int8": 0.7}))
    assert StepCosts().seconds_per_page(CacheKind.KV_INT8) == 0.0 and not StepCosts().known(CacheKind.KV_INT8)
    for bad in ({"hidden": 0.1}, {"kv-int8": -1.0}, {"fp4": 1.0}):
        with pytest.raises(ValueError, match="kind_costs"):
            StepCosts(kind_costs=bad)
