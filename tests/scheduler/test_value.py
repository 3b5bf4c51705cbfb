"""The value model: one weights type, one value and density, and the candidates' SLO state read in bulk."""

from __future__ import annotations

import math

import numpy as np
import pytest

from apt_serve_ray.bench.simulator import MHA_LAYOUT
from apt_serve_ray.cache.cache_manager import CacheManager
from apt_serve_ray.cache.page_pool import PagePool
from apt_serve_ray.config import EngineConfig
from apt_serve_ray.request import CacheKind, Request, RequestStatus
from apt_serve_ray.sampling.params import SamplingParams
from apt_serve_ray.scheduler.candidates import Candidates
from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler
from apt_serve_ray.scheduler.context import SchedulingContext
from apt_serve_ray.scheduler.scheduler import Scheduler
from apt_serve_ray.scheduler.value import ValueWeights, density, importance, urgency


def test_default_weights_are_the_measured_ones_and_zero_weights_give_the_papers_value():
    assert ValueWeights() == ValueWeights(time_weight=1.0, memory_weight=1.0, slo_weight=1.2, priority_weight=2.0)
    w = ValueWeights(slo_weight=0, priority_weight=0)
    pending = np.array([1.0, 2.0])
    assert w.value(pending).tolist() == [1.0, 2.0]  # urgency and importance not needed at weight 0
    assert w.density(np.array([4.0, 4.0]), np.array([2, 0])).tolist() == [2.0, 4.0]  # 0 pages count as 1


@pytest.mark.parametrize("field", ["time_weight", "memory_weight", "slo_weight", "priority_weight"])
@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, True, "1"])
def test_weights_errors_name_the_field(field, bad):
    with pytest.raises(ValueError, match=f"{field}: must be a finite number >= 0, got"):
        ValueWeights(**{field: bad})


def test_weighted_value_and_density():
    w = ValueWeights(time_weight=2.0, memory_weight=2.0, slo_weight=4.0, priority_weight=1.0)
    value = w.value(np.array([1.0, 2.0]), np.array([0.5, 1.0]), np.array([3.0, 0.0]))
    assert value.tolist() == [2.0 + 2.0 + 3.0, 4.0 + 4.0]
    assert w.density(value, np.array([1, 2])).tolist() == [7.0, 2.0]
    assert density(np.array([9.0]), np.array([3]), 0.0).tolist() == [9.0]


def test_missed_requests_keep_the_fairness_share_of_their_value():
    w = ValueWeights(slo_weight=1.0, priority_weight=0.0)
    value = w.value(np.array([10.0, 10.0]), np.array([1.0, 1.0]), missed=np.array([False, True]),
                    fairness_penalty=0.1)
    assert value.tolist() == pytest.approx([10.0 + 1.0, 1.0 + 0.1])


@pytest.mark.parametrize("kwargs, field", [
    (dict(urgency=[0.0]), "urgency"),
    (dict(importance=[0.0, 1.0, 2.0]), "importance"),
    (dict(pending_s=[-1.0, 0.0]), "pending_s"),
    (dict(pending_s=[math.nan, 0.0]), "pending_s"),
    (dict(urgency=None), "urgency"),
])
def test_value_errors_name_the_input(kwargs, field):
    args = dict(pending_s=[1.0, 2.0], urgency=[0.0, 0.0], importance=[0.0, 0.0])
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        ValueWeights(slo_weight=1.0, priority_weight=1.0).value(args["pending_s"], args["urgency"], args["importance"])


def test_urgency_rises_towards_the_deadline_and_importance_counts_levels_ahead():
    got = urgency(100.0, np.array([200.0, 104.0, 101.0, 100.0, 90.0]), 4.0)
    assert got.tolist() == [0.0, 0.0, 0.75, 1.0, 1.0]
    with pytest.raises(ValueError, match="slack_s"):
        urgency(0.0, [1.0], 0.0)
    assert importance([5, -1, 0]).tolist() == [0.0, 6.0, 5.0]
    assert importance([]).shape == (0,)


def test_the_adaptive_policy_keeps_its_four_weight_arguments_as_one_weights_value():
    policy = AdaptiveScheduler(time_weight=2, memory_weight=0.5, slo_weight=1, priority_weight=3)
    assert policy.weights == ValueWeights(2.0, 0.5, 1.0, 3.0)
    with pytest.raises(ValueError, match="priority_weight: must be a finite number >= 0"):
        AdaptiveScheduler(priority_weight=-1)


# Candidates ----------------------------------------------------------------------------------------
def _random_request(rng: np.random.Generator, i: int, now: float) -> Request:
    prompt = int(rng.integers(1, 200))
    r = Request(f"r{i}", [7] * prompt, SamplingParams(max_tokens=1000, ignore_eos=True),
                arrival_time=now - rng.uniform(0, 20), max_total_tokens=10_000, ttft_slo_ms=float(rng.choice([500.0, 2000.0, 8000.0])),
                tbt_slo_ms=float(rng.choice([50.0, 300.0, 1000.0])), priority=int(rng.integers(-2, 3)))
    t = r.arrival_time
    for _ in range(int(rng.integers(0, 6)) if rng.random() < 0.7 else 0):
        t = min(now, t + rng.uniform(0, 3))
        r.append_output_token(8, t)
    return r


def test_candidates_read_the_same_slo_state_as_the_request_methods():
    rng = np.random.default_rng(3)
    now = 1000.0
    for _ in range(20):
        config = EngineConfig(policy="apt", calibrate_rho=False)
        sched = Scheduler(config, CacheManager(PagePool(4096), MHA_LAYOUT), None, True, 10_000)
        requests = [_random_request(rng, i, now) for i in range(int(rng.integers(1, 40)))]
        num_running = int(rng.integers(0, len(requests) + 1))
        for r in requests[:num_running]:  # running: computed all but the last token, holding pages
            r.num_computed_tokens = r.num_tokens - 1
            r.status = RequestStatus.RUNNING
            kind = CacheKind.HIDDEN if rng.random() < 0.5 else CacheKind.KV
            assert sched.cache.allocate(r, r.num_tokens, kind)
            sched.running.append(r)
        sched.waiting.extend(requests[num_running:])
        c = Candidates.gather(SchedulingContext(sched, now), with_urgency=True, with_importance=True)
        assert c.requests == requests and c.num_running == num_running
        assert c.pending_s.tolist() == [r.pending_time(now) for r in requests]
        assert c.missed.tolist() == [r.has_missed_slo(now) for r in requests]
        slack = [(r.ttft_slo_ms if r.last_token_time is None else r.tbt_slo_ms) / 1000.0 for r in requests]
        assert c.urgency.tolist() == urgency(now, [r.deadline() for r in requests], slack).tolist()
        assert c.importance.tolist() == importance([r.priority for r in requests]).tolist()
        assert c.is_decoding[:num_running].tolist() == [r.is_decoding for r in requests[:num_running]]
        assert c.is_hidden.tolist() == [r.kind is CacheKind.HIDDEN for r in requests]
        assert c.num_held.tolist() == [len(r.page_ids) for r in requests]
        assert c.mem_kv.tolist() == [MHA_LAYOUT.num_pages_for(r.num_tokens + 1, CacheKind.KV) for r in requests]
        assert c.mem_hidden.tolist() == [MHA_LAYOUT.num_pages_for(r.num_tokens + 1, CacheKind.HIDDEN) for r in requests]


def test_no_candidates_when_nothing_waits_or_runs():
    config = EngineConfig(policy="apt", calibrate_rho=False)
    sched = Scheduler(config, CacheManager(PagePool(16), MHA_LAYOUT), None, True, 1000)
    assert Candidates.gather(SchedulingContext(sched, 0.0)) is None


def test_cached_rows_read_what_a_fresh_read_reads_through_a_run_with_preemptions():
    """The policy keeps waiting requests' columns between decisions (``WaitingRows``): at every
    decision of a run under memory pressure (preemptions, re-admissions) they equal a fresh read."""
    from apt_serve_ray.bench.simulator import CostModel, SimulatedEngine

    config = EngineConfig(policy="apt", calibrate_rho=False, max_num_seqs=8, max_num_batched_tokens=128)
    policy = AdaptiveScheduler(time_weight=1.0, slo_weight=1.0, priority_weight=0.5, config=config, rho=1e-5,
                               step_model=CostModel(), evict_missed=True)
    sim = SimulatedEngine(config, num_pages=24, policy=policy)
    checked, original = [], Candidates.gather.__func__

    def gather(cls, ctx, waiting_rows=None, **kwargs):
        cached = original(cls, ctx, waiting_rows, **kwargs)
        fresh = original(cls, ctx, None, **kwargs)
        assert (cached is None) == (fresh is None)
        if cached is not None:
            assert cached.requests == fresh.requests
            for name in ("num_tokens", "pending_s", "missed", "tbt_slo_ms", "urgency", "importance", "arrival"):
                np.testing.assert_array_equal(getattr(cached, name), getattr(fresh, name), err_msg=name)
            checked.append(cached.num)
        return cached

    rng = np.random.default_rng(5)
    try:
        Candidates.gather = classmethod(gather)
        for i in range(60):
            sim.add(int(rng.integers(8, 120)), int(rng.integers(4, 150)), priority=int(rng.integers(0, 3)),
                    ttft_slo_ms=float(rng.choice([200, 2000])), tbt_slo_ms=float(rng.choice([50, 500])))
            for _ in range(int(rng.integers(0, 4))):
                sim.step()
        sim.run_until_idle()
    finally:
        Candidates.gather = classmethod(original)
    assert len(checked) > 50 and sim.scheduler.num_preemptions > 0
