"""serve_config.yaml is a standard Ray Serve config whose app builder accepts its arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_serve_config_validates_against_rays_schema():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(load_config())
    (app,) = config.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    assert config.http_options.port == 8000


def test_app_args_build_the_engine_config_of_the_default_model():
    from apt_serve_ray.models.loader import DEFAULT_MODEL
    from deployments.app import AppArgs

    (app,) = load_config()["applications"]
    args = AppArgs.model_validate(app["args"])
    config = args.engine_config()
    assert config.model == DEFAULT_MODEL and config.device == "auto"
    assert config.enable_watermarks is False  # the controller steers them cluster-wide
    assert args.num_replicas == 1 and args.num_gpus_per_replica == 0


def test_build_app_returns_an_application_with_the_three_deployments():
    from ray.serve import Application

    from deployments.app import build_app

    (app,) = load_config()["applications"]
    application = build_app(app["args"])
    assert isinstance(application, Application)
    weighted = build_app({**app["args"], "policy_weights": {"time_weight": 1.0, "slo_weight": 0.5}})
    assert isinstance(weighted, Application)


@pytest.mark.parametrize("args, field", [
    ({"modle": "x"}, "modle"),
    ({"num_replicas": 0}, "num_replicas"),
    ({"light_watermark": 0.9, "heavy_watermark": 0.5}, "heavy_watermark"),
    ({"policy": "round-robin"}, "policy"),
    ({"dtype": "float8"}, "dtype"),
    ({"engine_options": {"no_such_field": 1}}, "engine_options"),
    ({"num_pages": 8, "engine_options": {"num_pages": 4}}, "engine_options"),
    ({"engine_options": {"model": "x"}}, "engine_options"),
    ({"enable_watermarks": True}, "enable_watermarks"),
    ({"attention_backend": "numpy"}, "attention_backend"),
    ({"num_threads": 0}, "num_threads"),
    ({"hidden_ratio_step": 0}, "hidden_ratio_step"),
    ({"stream_items_per_s": -1}, "stream_items_per_s"),
    ({"stream_interval_s": -0.1}, "stream_interval_s"),
    ({"policy": "apt", "policy_weights": {"slo_weight": -1}}, "slo_weight"),
    ({"policy": "sarathi", "policy_weights": {"slo_weight": 1}}, "sarathi"),
    ({"default_service_class": "gold"}, "default_service_class"),
    ({"service_classes": {"gold": {"ttft_slo_ms": -1}}, "default_service_class": "gold"}, "ttft_slo_ms"),
    ({"service_classes": {"gold": {"ttft": 100}}, "default_service_class": "gold"}, "ttft"),
    ({"service_classes": {"gold": {"priority": "high"}}, "default_service_class": "gold"}, "priority"),
])
def test_bad_app_args_name_the_field(args, field):
    from deployments.app import build_app

    with pytest.raises(ValueError, match=field):
        build_app(args)


def test_every_engine_field_is_an_app_argument_and_engine_options_still_work():
    import dataclasses

    from apt_serve_ray.config import EngineConfig
    from deployments.app import AppArgs

    arguments = set(AppArgs.model_fields)
    assert {f.name for f in dataclasses.fields(EngineConfig)} - arguments == {"enable_watermarks"}
    top_level = AppArgs.model_validate({"attention_backend": "torch", "calibrate_rho": False, "cache_ratio": 0.2})
    older = AppArgs.model_validate({"engine_options": {"attention_backend": "torch", "calibrate_rho": False},
                                    "cache_ratio": 0.2})
    assert top_level.engine_config() == older.engine_config()
    config = top_level.engine_config()
    assert config.attention_backend == "torch" and config.calibrate_rho is False and config.cache_ratio == 0.2
    assert config.engine_process is True and config.max_num_seqs == EngineConfig.max_num_seqs  # unset: the default


def test_deployments_have_no_defaults_of_their_own():
    """Every setting of a deployment comes from the app's arguments: the options each deployment takes
    are built by ``build_app`` and name every field (a default there would be a second source)."""
    import inspect

    from deployments.controller import Controller, ControllerOptions
    from deployments.engine_replica import EngineReplica, ReplicaOptions
    from deployments.router import Router
    from deployments.router_options import RouterOptions

    for options in (RouterOptions, ReplicaOptions, ControllerOptions):
        defaulted = [name for name, field in options.model_fields.items() if not field.is_required()]
        assert not defaulted, f"{options.__name__} has defaults of its own: {defaulted}"
    for deployment in (Router, EngineReplica, Controller):
        init = inspect.signature(deployment.func_or_class.__init__)
        defaulted = [p.name for p in init.parameters.values() if p.default is not inspect.Parameter.empty]
        assert not defaulted, f"{deployment.name}.__init__ has defaults of its own: {defaulted}"


def test_the_app_merges_policy_options_once_and_every_replica_gets_them():
    from deployments.app import AppArgs, policy_kwargs

    args = AppArgs.model_validate({"policy_options": {"fairness_penalty": 0.5, "slo_weight": 2.0},
                                   "policy_weights": {"slo_weight": 3.0}})
    assert policy_kwargs(args, args.engine_config()) == {"fairness_penalty": 0.5, "slo_weight": 3.0}


def test_the_watermarks_have_one_default_and_the_app_passes_its_own_to_the_engines():
    from apt_serve_ray.config import EngineConfig
    from apt_serve_ray.scheduler import watermarks
    from deployments.app import AppArgs

    default = AppArgs.model_validate({}).engine_config()
    assert default.light_watermark == watermarks.LIGHT_WATERMARK
    assert default.heavy_watermark == watermarks.HEAVY_WATERMARK
    assert EngineConfig().max_hidden_ratio == watermarks.Watermarks().cap == watermarks.MAX_HIDDEN_RATIO
    chosen = AppArgs.model_validate({"light_watermark": 0.6, "heavy_watermark": 0.85}).engine_config()
    assert (chosen.light_watermark, chosen.heavy_watermark) == (0.6, 0.85)  # the controller's and the timeline's


def test_the_shipped_service_classes_and_the_default_one():
    from deployments.app import AppArgs
    from deployments.service_classes import ServiceClass

    (app,) = load_config()["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.service_classes == {"default": ServiceClass(),
                                    "interactive": ServiceClass(ttft_slo_ms=1000, tbt_slo_ms=100, priority=0),
                                    "batch": ServiceClass(ttft_slo_ms=30000, tbt_slo_ms=1000, priority=10)}
    # A request that names no class keeps the engine's configured default_* targets, as before classes.
    assert args.default_service_class == "default" == AppArgs.model_validate({}).default_service_class
    own = AppArgs.model_validate({"service_classes": {"gold": {"priority": -1}}, "default_service_class": "gold"})
    assert own.service_classes == {"gold": ServiceClass(priority=-1)}  # replaces the shipped ones


def test_list_arguments_also_take_the_comma_separated_strings_serve_run_passes():
    from deployments.app import AppArgs

    args = AppArgs.model_validate({"cache_kinds": "[hidden,kv-int8]", "cpu_affinity": "0,1"})
    assert args.engine_config().cache_kinds == ("hidden", "kv-int8") and args.cpu_affinity == (0, 1)
    assert AppArgs.model_validate({"cache_kinds": ["kv-int8"]}).engine_config().cache_kinds == ("kv-int8",)
    with pytest.raises(ValueError, match="cache_kinds"):
        AppArgs.model_validate({"cache_kinds": "fp8"}).engine_config()


def test_a_dict_argument_also_comes_as_json_from_serve_run():
    from pydantic import ValidationError

    from deployments.app import AppArgs

    # `serve run deployments.app:build_app policy_options='{"admission_share": null}'` passes a string.
    args = AppArgs.model_validate({"policy_options": '{"admission_share": null, "tbt_headroom": 0.7}'})
    assert args.policy_options == {"admission_share": None, "tbt_headroom": 0.7}
    with pytest.raises(ValidationError, match="policy_options"):
        AppArgs.model_validate({"policy_options": "{admission_share"})


def test_the_replica_takes_its_engine_client_injected(tmp_path, monkeypatch, opt_tiny):
    """engine_client "module:callable" builds the replica's client (a fake here); None builds the engine;
    a malformed or missing path fails naming the field, in the app's arguments or in the replica."""
    from apt_serve_ray import AsyncLLMEngine, EngineConfig
    from deployments.app import AppArgs
    from deployments.engine_replica import make_engine_client

    (tmp_path / "fake_engine_client.py").write_text(
        "class Fake:\n"
        "    def __init__(self, config, **kwargs):\n"
        "        self.config, self.kwargs = config, kwargs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = EngineConfig(model=opt_tiny, engine_process=False, dtype="float32", num_pages=16)
    fake = make_engine_client("fake_engine_client:Fake", config, observers=None, metrics_backend="m")
    assert type(fake).__name__ == "Fake" and fake.config is config and fake.kwargs == {"observers": None,
                                                                                        "metrics_backend": "m"}
    assert isinstance(make_engine_client(None, config), AsyncLLMEngine)
    with pytest.raises(ValueError, match="engine_client"):
        make_engine_client("no_colon", config)
    with pytest.raises(ValueError, match="engine_client"):
        make_engine_client("fake_engine_client:Missing", config)
    with pytest.raises(ValueError, match="engine_client"):
        AppArgs(engine_client="no_colon")
    assert AppArgs(engine_client="fake_engine_client:Fake").engine_client == "fake_engine_client:Fake"


@pytest.mark.parametrize("value", [None, True, False])
def test_yield_to_engines_reaches_every_engine_replica_and_is_off_by_default(value):
    from deployments.app import build_app
    from deployments.engine_replica import ReplicaOptions

    (app,) = load_config()["applications"]
    args = dict(app["args"]) if value is None else {**app["args"], "yield_to_engines": value}
    router = build_app(args)._bound_deployment
    engine = router.init_args[0]._bound_deployment  # Router(engine, controller, options)
    (options,) = [a for a in engine.init_args if isinstance(a, ReplicaOptions)]
    assert options.yield_to_engines is bool(value)
