"""What the engine publishes (``stats.py``) and the engine core under the simulator: typed step and
cache stats that pickle, the load report's keys, time read only from the injected clock, no model."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from apt_serve_ray import AsyncLLMEngine, CacheTracker, EngineConfig, LLMEngine
from apt_serve_ray.bench.simulator import (IDLE_STEP_S, MHA_LAYOUT, CostModel, CostModelRunner, SimulatedClock,
                                           SimulatedEngine)
from apt_serve_ray.engine.stats import CacheStats, StepStats

# 10 ms a step + 1 ms a token: a 40-token prefill takes 50 ms, a decode 11 ms.
COST = CostModel(base_s=0.010, per_token_s=0.001, per_context_s=0.0, hidden_context_s=0.0)



def _sim(policy: str = "sarathi", num_pages: int = 20) -> SimulatedEngine:
    return SimulatedEngine(EngineConfig(policy=policy, calibrate_rho=False), num_pages=num_pages, cost=COST)


def test_a_step_publishes_typed_stats_with_the_cache_after_it():
    sim = _sim()
    engine = sim.llm_engine
    sim.step()
    assert engine.last_step is None  # nothing to run: no stats, and the clock still moves
    assert sim.now == IDLE_STEP_S
    sim.add(40, 3)
    sim.step()
    step = engine.last_step
    assert isinstance(step, StepStats) and isinstance(step.cache, CacheStats)
    assert (step.num_tokens, step.num_seqs, step.num_upgrades, step.preempt_causes) == (40, 1, 0, ())
    assert step.execute_s == pytest.approx(0.050) and step.total_s == pytest.approx(0.050)
    assert step.cache == engine.cache_stats()
    c = step.cache
    assert (c.num_pages, c.num_free_pages, c.num_kv_pages, c.num_hidden_pages) == (20, 17, 3, 0)
    assert (c.num_kv_tokens, c.num_running, c.num_waiting, c.admission_open) == (40, 1, 0, True)
    assert (c.kv_tokens_per_page, c.hidden_tokens_per_page) == (16, 32) and c.hidden_supported


def test_preemptions_are_counted_with_their_cause():
    sim = _sim("fcfs", num_pages=4)
    for _ in range(3):
        sim.add(16, 10)
    sim.step()  # three prefills, one page each
    sim.step()  # every decode needs a second page: one is free, the newest request gives way
    step = sim.llm_engine.last_step
    assert step.preempt_causes == ("memory",) and step.cache.num_preemptions == 1


def test_stats_are_frozen_pickle_and_feed_the_async_engine():
    sim = _sim()
    sim.add(40, 3)
    sim.step()
    step = sim.llm_engine.last_step
    assert pickle.loads(pickle.dumps(step)) == step  # the engine process sends them every step
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.cache.num_free_pages = 0
    cache = step.cache
    assert cache.max_running_priority == 0  # the one running request's (what the routers' hold reads)
    assert cache.pages_by_kind == {"kv": 3, "hidden": 0, "kv-int8": 0, "hidden-int8": 0}
    assert (cache.kv_tokens_per_page, cache.hidden_tokens_per_page) == (16, 32)
    # The async engine reports the same snapshot (the replica's LoadReport is built from it).
    async_engine = AsyncLLMEngine(sim.config, engine=sim.llm_engine)
    assert async_engine.cache_stats() == sim.llm_engine.cache_stats()
    assert async_engine.step_time_ms == 0.0 and async_engine.num_streams == 0


def test_the_engine_reads_time_only_from_its_clock():
    sim = _sim()
    sim.now = 100.0
    request = sim.add(40, 3)
    sim.run_until_idle()
    assert request.arrival_time == request.first_scheduled_time == 100.0
    assert request.token_times == pytest.approx([100.050, 100.061, 100.072])  # prefill, then two decodes
    assert request.finish_time == request.token_times[-1] and sim.finished == [request]


def test_observers_see_the_simulated_clock():
    sim = _sim()
    tracker = CacheTracker(sim)
    sim.add(40, 3)
    sim.run_until_idle()
    series = tracker.series()
    assert series["t"] == pytest.approx([0.050, 0.061, 0.072])
    assert series["kv"] == [3, 3, 0] and series["running"] == [1, 1, 0]


def test_the_simulator_loads_no_model(monkeypatch):
    import apt_serve_ray.engine.llm_engine as engine_module

    def refuse(*args, **kwargs):
        raise AssertionError("the simulator must not load a model")

    for name in ("ModelRunner", "resolve_model", "load_tokenizer"):
        monkeypatch.setattr(engine_module, name, refuse)
    sim = _sim()
    sim.add(20, 2)
    sim.run_until_idle()
    assert sim.llm_engine.source is None and len(sim.finished) == 1


def test_an_injected_runner_needs_a_tokenizer():
    clock = SimulatedClock()
    runner = CostModelRunner(MHA_LAYOUT, 10, 160, COST, clock)
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(EngineConfig(calibrate_rho=False), runner=runner, clock=clock)
