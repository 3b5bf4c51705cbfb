"""The GPU roofline cost model: its terms, its data, and the costs it hands the adaptive policy."""

import json

import pytest

from apt_serve_ray.bench import gpu_cost
from apt_serve_ray.cache.kinds import CacheKind
from apt_serve_ray.config import EngineConfig


@pytest.fixture(scope="module")
def a100():
    return gpu_cost.GpuCostModel(gpu_cost.device("a100-80gb"), gpu_cost.model_shape("opt-13b"))


def test_devices_and_models_are_data_with_their_sources():
    data = json.loads(gpu_cost.SPECS_PATH.read_text())
    assert {"a100-80gb", "h100-80gb", "l4"} <= set(gpu_cost.devices())
    for name in gpu_cost.devices():
        assert data["devices"][name]["calibration"]  # every device says what its factors were set to meet
    shape = gpu_cost.model_shape("opt-13b")
    assert 12.5e9 < shape.linear_params < 13e9 and shape.weight_bytes == pytest.approx(25.7e9, rel=0.01)
    with pytest.raises(ValueError, match="device"):
        gpu_cost.device("tpu")
    with pytest.raises(ValueError, match="model"):
        gpu_cost.model_shape("gpt-5")
    with pytest.raises(ValueError, match="mem_eff"):
        gpu_cost.Device(**{**data["devices"]["l4"], "mem_eff": 1.5}, name="bad")


def test_single_stream_decode_is_bound_by_the_weights(a100):
    weights_s = a100.shape.linear_params * 2 / (a100.dev.mem_bw * a100.dev.mem_eff)
    one = a100.decode_s(1, 512)
    assert weights_s < one < weights_s + 0.004  # the rest: host overhead, lm head, a little attention
    assert 0.016 < one < 0.022  # ~50 tokens/s: the published single-stream figure the factors were set to
    # Memory-bound: 16 rows cost barely more than one; compute-bound prefill grows with its tokens.
    assert a100.decode_s(16, 512) < 1.6 * one
    assert a100.prefill_s(2048) > 3.5 * a100.prefill_s(512)
    # A chunk deep in a prompt costs more than the same chunk at its start (its query-key pairs).
    assert a100.prefill_s(512, start=1536) > a100.prefill_s(512)


def test_cache_kinds_cost_what_they_read_and_recompute(a100):
    kv = a100.decode_s(64, 1024)
    assert a100.decode_s(64, 1024, CacheKind.KV_INT8) < kv  # fewer bytes read
    assert a100.decode_s(64, 1024, CacheKind.HIDDEN) > kv  # K/V projected again: compute-bound
    assert a100.seconds_per_page(CacheKind.HIDDEN) > 0 and a100.seconds_per_page(CacheKind.KV_INT8) == 0
    assert a100.swap_out_s_per_page == pytest.approx(a100.layout.bytes_per_page / a100.dev.pcie_bw)


def test_a100_holds_about_60k_tokens_of_opt13b_kv(a100):
    pages = gpu_cost.kv_pages(a100.dev, a100.shape)
    assert 3000 < pages < 4500
    with pytest.raises(ValueError, match="does not fit"):
        gpu_cost.kv_pages(gpu_cost.device("l4"), gpu_cost.model_shape("opt-30b"))


def test_the_policy_gets_the_costs_the_engine_would_measure(a100):
    """The engine's own calibration fits its step-time model on the simulated runner's clock."""
    sim = gpu_cost.gpu_engine(EngineConfig(policy="apt", calibrate_rho=False, enable_watermarks=False), a100)
    costs = sim.scheduler.policy.costs
    model = costs.step_time
    assert model is not None and model.r2 > 0.9 and model.wall_s >= 0
    assert model.a == pytest.approx(a100.decode_s(1, 128), rel=0.3)  # the fixed part: the weights
    assert costs.rho == pytest.approx(a100.seconds_per_page(CacheKind.HIDDEN))
    for name, tokens, context, seconds, _ in model.points:  # each timed shape is the cost model's
        assert seconds > 0
    assert sim.runner.vocab_size == a100.shape.vocab_size


def test_gpu_cost_check_puts_the_prediction_beside_each_measured_step(tmp_path):
    """benchmarks/gpu_cost_check.py, as gpu_check.sh runs it on a lent GPU's output."""
    import subprocess
    import sys
    from pathlib import Path

    rows = [{"config": c, "batch": b, "context": 512, "step_ms": 5.0, "dtype": "bfloat16"}
            for c in ("torch kv", "fast kv", "fast hidden fused", "fast kv-int8") for b in (1, 32)]
    (tmp_path / "decode_step_13b.json").write_text(json.dumps({"device": "NVIDIA H100 80GB HBM3", "rows": rows}))
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "benchmarks/gpu_cost_check.py", str(tmp_path)], cwd=repo,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "cost_model_check.json").read_text())["rows"]
    assert len(result) == 6 and {r["device"] for r in result} == {"h100-80gb"}  # the reference path is skipped
    cost = gpu_cost.GpuCostModel(gpu_cost.device("h100-80gb"), gpu_cost.model_shape("opt-13b-2l"))
    hidden = next(r for r in result if r["config"] == "fast hidden fused" and r["batch"] == 32)
    assert hidden["predicted_ms"] == pytest.approx(1000 * cost.decode_s(32, 512, CacheKind.HIDDEN))
    assert hidden["measured_over_predicted"] == pytest.approx(5.0 / hidden["predicted_ms"])
