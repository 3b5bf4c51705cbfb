"""k8s/rayservice.yaml: a valid KubeRay RayService that serves the same application as serve_config.yaml."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT.parent / "shared" / "schemas" / "ray.io_rayservices.yaml"

# App arguments that describe the machine, not the application: they may differ between the CPU
# config (serve_config.yaml) and the GPU cluster (k8s/rayservice.yaml). See k8s/README.md.
HARDWARE_ARGS = {"num_replicas", "num_cpus_per_replica", "num_gpus_per_replica", "num_threads", "dtype", "device",
                 "cache_budget_bytes", "num_pages", "max_num_batched_tokens",
                 "quantization"}  # weights kept quantized: our CPU kernels (a GPU serves full width)


def rayservice() -> dict:
    return yaml.safe_load((ROOT / "k8s" / "rayservice.yaml").read_text())


def serve_config_v2() -> dict:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


def strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused: the API server would silently prune them, so a
    misspelt field would otherwise pass validation and vanish."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.mark.skipif(not CRD.exists(), reason=f"{CRD} not present")
def test_rayservice_validates_against_the_kuberay_crd():
    import jsonschema

    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(version["schema"]["openAPIV3Schema"])
    manifest = rayservice()
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(manifest, schema)
    with pytest.raises(jsonschema.ValidationError):  # the strict check does catch a misspelt field
        broken = copy.deepcopy(manifest)
        broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParms"] = {}
        jsonschema.validate(broken, schema)


def test_serve_config_v2_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config_v2())


def test_serve_config_v2_is_the_same_application_as_serve_config_yaml():
    local = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cluster = serve_config_v2()
    assert {k: v for k, v in local.items() if k != "applications"} == \
        {k: v for k, v in cluster.items() if k != "applications"}
    (mine,), (theirs,) = local["applications"], cluster["applications"]
    for key in ("name", "route_prefix", "import_path"):
        assert mine[key] == theirs[key], key
    app_args = {k: v for k, v in mine["args"].items() if k not in HARDWARE_ARGS}
    cluster_args = {k: v for k, v in theirs["args"].items() if k not in HARDWARE_ARGS}
    assert app_args == cluster_args


def test_cluster_shape_head_without_work_one_engine_per_gpu_and_ports():
    from deployments.app import AppArgs

    spec = rayservice()["spec"]["rayClusterConfig"]
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (worker,) = spec["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = AppArgs.model_validate(serve_config_v2()["applications"][0]["args"])
    assert args.num_gpus_per_replica == 1 and args.num_replicas == worker["replicas"]
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]
    for c in [container, head["template"]["spec"]["containers"][0]]:
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["serve"] == 8000 and ports["metrics"] == 8080
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
