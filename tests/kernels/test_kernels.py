"""Triton kernels against their PyTorch references (interpreter on CPU; the real thing on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_reference_in_interpreter():
    # TRITON_INTERPRET must be set before @triton.jit runs, so the check runs in a fresh interpreter.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "kernel_check.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("max err") == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernels_match_reference_on_cuda():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    code = ("import torch, runpy; torch.set_default_device('cuda'); "
            f"runpy.run_path({str(ROOT / 'tests' / 'kernels' / 'kernel_check.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("shape", ["opt-tiny-h32", "llama-tiny-h32"])
def test_engine_with_forced_kernel_matches_torch_path(checkpoint, shape):
    path = checkpoint(shape)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "engine_kernel_check.py"), path], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine kernel path matches" in proc.stdout


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_packed_linear_matches_f_linear_bit_for_bit_in_bf16_and_to_rounding_in_float32(monkeypatch):
    import torch.nn.functional as F

    from apt_serve_ray.models import linear
    from apt_serve_ray.models.linear import Linear, packing_available

    monkeypatch.setattr(linear, "bf16_panels_available", lambda: False)  # oneDNN's path (panels: test_cpu_panel.py)
    monkeypatch.setattr(linear, "panels_available", lambda: False)
    if not packing_available(torch.bfloat16):
        pytest.skip("oneDNN packed linear unavailable on this CPU (the engine then uses F.linear)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for bias in (b, None):
        layer = Linear(w, bias)
        layer.wide = False  # many rows as float32 where that is faster: test_wide_bf16_linear_... below
        assert layer.packed is not None and layer.weight is None  # the plain copy is dropped
        for rows in (1, 7, 64, 300):
            x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
            assert torch.equal(layer(x), F.linear(x, w, bias))
        x3 = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)  # other ranks: flattened to rows
        assert torch.equal(layer(x3), F.linear(x3, w, bias))
    # float32 is packed too; oneDNN sums in another order, so it matches F.linear to rounding only.
    wf, bf = w.float(), b.float()
    layer = Linear(wf, bf)
    assert packing_available(torch.float32) and layer.packed is not None
    for rows in (1, 7, 300):
        x = torch.randn(rows, 64, generator=g)
        assert torch.allclose(layer(x), F.linear(x, wf, bf), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
def test_wide_bf16_linear_is_the_float32_product_rounded_once_and_only_from_its_row_count(monkeypatch):
    """A bf16 layer's steps of many rows as a float32 GEMM over the weight unpacked from oneDNN's layout: the
    float32 product of the bf16 operands, rounded to bf16 once; fewer rows take oneDNN's bf16 GEMM, bit for bit."""
    import torch.nn.functional as F

    from apt_serve_ray.models import linear

    if not linear.packing_available(torch.bfloat16):
        pytest.skip("oneDNN packed linear unavailable on this CPU (the engine then uses F.linear)")
    monkeypatch.setattr(linear, "bf16_panels_available", lambda: False)  # oneDNN's path (panels: test_cpu_panel.py)
    monkeypatch.setattr(linear, "wide_rows", lambda threads: 200)  # as if measured: float32 from 200 rows
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    for bias in (b, None):
        layer = linear.Linear(w, bias)
        assert layer.wide and layer.weight is None  # no second copy of the weight is kept
        x = torch.randn(300, 64, generator=g).to(torch.bfloat16)
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = layer(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, exact.to(torch.bfloat16)) or torch.allclose(out.float(), exact, rtol=2 ** -7, atol=1e-3)
        few = x[:199]
        assert torch.equal(layer(few), F.linear(few, w, bias))  # under the row count: oneDNN's bf16 GEMM
    monkeypatch.setattr(linear, "wide_rows", lambda threads: None)
    layer = linear.Linear(w, b)
    assert not layer.wide and torch.equal(layer(x), F.linear(x, w, b))  # never faster here: bf16 throughout


def test_measure_wide_returns_a_row_count_it_tried_and_the_ratios_behind_it(monkeypatch):
    from apt_serve_ray.models import linear

    if not linear.packing_available(torch.bfloat16):
        pytest.skip("oneDNN packed linear unavailable on this CPU")
    found, ratios = linear.measure_wide()
    assert found is None or found in linear.WIDE_ROWS
    assert ratios and all(r > 0 for r in ratios.values()) and max(linear.WIDE_ROWS) in ratios
    if found is not None:  # every count from it up was faster by WIDE_GAIN
        assert all(ratios[r] < linear.WIDE_GAIN for r in linear.WIDE_ROWS if r >= found)
    linear.wide_rows.cache_clear()
    monkeypatch.setenv("APT_SERVE_WIDE_LINEAR", "0")
    assert linear.wide_rows(1) is None
    linear.wide_rows.cache_clear()
    monkeypatch.setenv("APT_SERVE_WIDE_LINEAR", "256")
    assert linear.wide_rows(1) == 256
    linear.wide_rows.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", ["opt-tiny-h32", "llama-tiny-h32"])
def test_engine_on_cuda_triton_matches_torch_path(checkpoint, shape):
    from apt_serve_ray import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = [[11, 12, 13, 14, 15], [21] * 40, [31] * 9]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(checkpoint(shape), device="cuda", dtype="float32", num_pages=64, cache_ratio=0.5,
                  attention_backend=backend, calibrate_rho=False, enable_watermarks=False)
        outs[backend] = llm.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["triton"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_fresh_one_kept(tmp_path):
    """torch's build lock is a bare file: a killed build leaves it, and every later engine start waited
    on it forever. One older than STALE_LOCK_S is removed; a fresh one (a build in progress) stays."""
    import os
    import time

    from apt_serve_ray.kernels import cpu_attention as ca

    lock = tmp_path / "lock"
    lock.touch()
    ca._clear_stale_lock(lock)
    assert lock.exists()
    old = time.time() - 2 * ca.STALE_LOCK_S
    os.utime(lock, (old, old))
    ca._clear_stale_lock(lock)
    assert not lock.exists()
    ca._clear_stale_lock(lock)  # none: nothing to do
