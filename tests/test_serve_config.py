"""serve_config.yaml is a standard Ray Serve config whose app builder accepts its arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def load_config() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


def test_serve_config_validates_against_rays_schema():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(load_config())
    (app,) = config.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    assert config.http_options.port == 8000


def test_app_args_build_the_engine_config_of_the_default_model():
    from apt_serve_ray.model_loader import DEFAULT_MODEL
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
    ({"engine_options": {"num_pages": 4}}, "engine_options"),
    ({"policy": "apt", "policy_weights": {"slo_weight": -1}}, "slo_weight"),
    ({"policy": "sarathi", "policy_weights": {"slo_weight": 1}}, "sarathi"),
])
def test_bad_app_args_name_the_field(args, field):
    from deployments.app import build_app

    with pytest.raises(ValueError, match=field):
        build_app(args)
