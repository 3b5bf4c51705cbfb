"""The cost model is injected: the engine measures what a pricing policy was not given, on its own
model, and hands it over; the policy never sees the engine."""

from __future__ import annotations

import pytest

from apt_serve_ray import LLM, SamplingParams
from apt_serve_ray.bench.simulator import CostModel
from apt_serve_ray.request import CacheKind
from apt_serve_ray.scheduler.costs import StepCosts
from apt_serve_ray.scheduler.policies.apt import AdaptiveScheduler
from apt_serve_ray.scheduler.policies.base import SchedulingPolicy


def test_policies_have_no_handle_on_the_engine():
    assert not hasattr(SchedulingPolicy, "bind") and not hasattr(AdaptiveScheduler, "bind")
    assert SchedulingPolicy.costs is None  # a policy that prices nothing gets nothing measured


def test_given_costs_are_kept_and_validated():
    policy = AdaptiveScheduler(rho=0.5, step_model=CostModel())
    assert policy.costs == StepCosts(0.5, CostModel()) and policy.rho == 0.5
    policy.set_costs(StepCosts(rho=0.1))
    assert policy.rho == 0.1 and policy.step_model is None
    assert AdaptiveScheduler().rho == 0.0  # unknown rho prices the hidden kind at nothing
    with pytest.raises(ValueError, match="rho: must be >= 0"):
        StepCosts(rho=-1.0)


def test_the_engine_measures_the_missing_costs_and_injects_them(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=128, policy="apt")
    measured = llm.llm_engine.scheduler.policy.costs
    assert measured.rho is not None and measured.rho >= 0 and measured.step_time is not None
    given = AdaptiveScheduler(rho=0.5, step_model=CostModel())
    llm.set_scheduler(given)
    # Nothing measured over what was given; the in-place conversions it did not price are measured.
    assert (given.costs.rho, given.costs.step_time) == (0.5, CostModel())
    assert dict(given.costs.conversion_costs).keys() == {(CacheKind.HIDDEN, CacheKind.KV)}
    assert dict(measured.conversion_costs) and all(s >= 0 for s in dict(measured.conversion_costs).values())
    priced = AdaptiveScheduler(rho=0.5, step_model=CostModel())
    priced.set_costs(StepCosts(0.5, CostModel(), conversion_costs={("hidden", "kv"): 1e-6}))
    llm.set_scheduler(priced)
    assert priced.costs == StepCosts(0.5, CostModel(), conversion_costs={("hidden", "kv"): 1e-6})
    partial = AdaptiveScheduler(rho=0.25)
    llm.set_scheduler(partial)
    assert partial.rho == 0.25 and partial.step_model is not None  # only the step-time model measured
    llm.set_scheduler("fcfs")
    assert llm.llm_engine.scheduler.policy.costs is None
    out = llm.generate([[5, 6, 7]] * 3, SamplingParams(max_tokens=4))
    assert len(out) == 3


def test_without_calibration_nothing_is_measured(opt_tiny):
    llm = LLM(opt_tiny, dtype="float32", num_pages=128, policy="apt", calibrate_rho=False)
    assert llm.llm_engine.scheduler.policy.costs == StepCosts()
