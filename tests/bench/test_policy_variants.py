"""Policy variants by name: the engine settings each benchmark variant runs with."""

import pytest

from apt_serve_ray.bench.policy_variants import cache_options, policy_of
from apt_serve_ray.config import EngineConfig


@pytest.mark.parametrize("name, policy, kinds, ratio", [
    ("fcfs", "fcfs", ("hidden",), 0.0), ("sarathi", "sarathi", ("hidden",), 0.0), ("apt", "apt", ("hidden",), 0.0),
    ("apt-hidden", "apt", ("hidden",), 0.5), ("apt-hidden@0.3", "apt", ("hidden",), 0.3),
    ("apt-all@0.7", "apt", ("hidden", "kv-int8", "hidden-int8"), 0.7), ("sarathi-int8", "sarathi", ("kv-int8",), 0.5),
])
def test_each_variant_is_an_engine_config(name, policy, kinds, ratio):
    config = EngineConfig(policy=policy_of(name), **cache_options(name))
    assert (config.policy, config.cache_kinds, config.cache_ratio) == (policy, kinds, ratio)
    assert config.enable_hybrid_cache == (name not in ("fcfs", "sarathi", "priority", "apt-kv"))


def test_an_unknown_variant_is_refused_by_name():
    with pytest.raises(ValueError, match="apt-turbo"):
        cache_options("apt-turbo")


def test_a_ratio_on_a_variant_that_takes_none_is_refused():
    with pytest.raises(ValueError, match="apt@0.3"):
        cache_options("apt@0.3")
