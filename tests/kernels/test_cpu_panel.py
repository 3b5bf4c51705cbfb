"""Panel linears (``kernels/csrc/cpu_panel.cpp``, ``models/linear.py``): float32 in 16-channel (AVX2) and 64-channel
(AVX-512) panels against ``F.linear``, bf16 in 64-channel panels against the float32 product rounded once, over rows,
odd shapes, bias or none; ``Linear`` sends them at most ``PANEL_MAX_ROWS`` rows, or every step where that was
measured no slower, keeps one copy of the weight then, and counts the panels' bytes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apt_serve_ray.kernels import cpu_attention as ca
from apt_serve_ray.models import linear


def _native() -> bool:
    if not ca.is_available():
        return False
    ca.load()
    return bool(torch.ops.apt_serve.panel_native())


pytestmark = pytest.mark.skipif(not _native(), reason="needs the C++ kernels built with AVX2 and FMA")


def _wide_native() -> bool:
    return ca.is_available() and bool(torch.ops.apt_serve.panel_wide_native())


WIDTHS = [16, pytest.param(64, marks=pytest.mark.skipif(not _wide_native(), reason="needs the kernels built with AVX-512"))]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("n,k", [(768, 768), (50, 37), (17, 3), (16, 8), (1, 5), (200, 3072), (130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_f_linear(n, k, with_bias, width):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = linear.pack_panels(w, width)
    assert panels.shape == (-(-n // width), k, width)
    for m in (0, 1, 2, 5, 6, 7, 8, 13, 40):
        x = torch.randn(m, k, generator=g)
        y = torch.ops.apt_serve.panel_linear(x, panels, b, n)
        # float32 sums of k terms in another order: rounding grows with sqrt(k)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * max(1.0, (k / 256) ** 0.5))


@pytest.mark.parametrize("width", WIDTHS)
def test_panel_linear_takes_a_strided_x_and_refuses_bad_shapes(width):
    w, x = torch.randn(40, 24), torch.randn(24, 3).t()  # not contiguous
    panels = linear.pack_panels(w, width)
    torch.testing.assert_close(torch.ops.apt_serve.panel_linear(x, panels, None, 40), F.linear(x, w))
    with pytest.raises(RuntimeError, match="n"):
        torch.ops.apt_serve.panel_linear(x.contiguous(), panels, None, 60 if width == 16 else 65)  # more than held
    with pytest.raises(RuntimeError, match="K"):
        torch.ops.apt_serve.panel_linear(torch.randn(3, 25), panels, None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.apt_serve.panel_linear(x.to(torch.bfloat16), panels, None, 40)


def _count_rows(monkeypatch, name: str) -> list[int]:
    """The row counts ``linear.<name>`` is called with from now on (it still runs)."""
    calls, real = [], getattr(linear, name)

    def spy(x, *args):
        calls.append(len(x))
        return real(x, *args)

    monkeypatch.setattr(linear, name, spy)
    return calls


def test_linear_sends_small_steps_to_the_panels(monkeypatch):
    monkeypatch.setattr(linear, "panels_available", lambda: True)
    monkeypatch.setattr(linear, "panels_all_rows", lambda dtype, threads: False)  # oneDNN's copy for more rows
    w, b = torch.randn(48, 32), torch.randn(48)
    layer = linear.Linear(w, b)
    assert layer.panels is not None
    calls = _count_rows(monkeypatch, "panel_linear")
    for m in (1, linear.PANEL_MAX_ROWS, linear.PANEL_MAX_ROWS + 1, 64):
        x = torch.randn(m, 32)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, linear.PANEL_MAX_ROWS]
    padded = -(-48 // linear.panel_width()) * linear.panel_width()
    assert linear.weight_bytes(layer) == (48 + padded) * 32 * 4  # oneDNN's copy (or the plain weight) and the panels


# bf16 -----------------------------------------------------------------------------------------------
bf16_only = pytest.mark.skipif(not _wide_native(), reason="needs the C++ kernels built with AVX-512")


def _bf16_reference(x, w, b):
    """The float32 product of the bf16 operands (and a float32 bias), rounded to bf16 once."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)


def _assert_rounded_once(y, ref):
    """Within one bf16 rounding of the float32 product: summation order may flip a last bit."""
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-2)


@bf16_only
@pytest.mark.parametrize("n,k", [(768, 768), (50, 38), (65, 2), (64, 8), (1, 6), (200, 3072), (130, 770)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panel_linear_matches_the_float32_product_rounded_once(n, k, with_bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = linear.pack_panels_bf16(w)
    assert panels.shape == (-(-n // 64), k // 2, 64, 2) and panels.dtype == torch.bfloat16
    for m in (0, 1, 2, 5, 6, 7, 12, 13, 100):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        y = torch.ops.apt_serve.panel_linear_bf16(x, panels, b, n)
        _assert_rounded_once(y, _bf16_reference(x, w, b))


@bf16_only
def test_bf16_panel_linear_takes_a_strided_x_and_refuses_bad_shapes():
    w = torch.randn(40, 24).to(torch.bfloat16)
    x = torch.randn(24, 3).to(torch.bfloat16).t()  # not contiguous
    panels = linear.pack_panels_bf16(w)
    _assert_rounded_once(torch.ops.apt_serve.panel_linear_bf16(x, panels, None, 40), _bf16_reference(x, w, None))
    with pytest.raises(RuntimeError, match="n"):
        torch.ops.apt_serve.panel_linear_bf16(x.contiguous(), panels, None, 65)  # more channels than the panels hold
    with pytest.raises(RuntimeError, match="K"):
        torch.ops.apt_serve.panel_linear_bf16(torch.randn(3, 26).to(torch.bfloat16), panels, None, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.apt_serve.panel_linear_bf16(x.float(), panels, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.apt_serve.panel_linear_bf16(x, panels, torch.randn(40).to(torch.bfloat16), 40)


@bf16_only
@pytest.mark.parametrize("all_rows", [True, False])
def test_bf16_linear_uses_panels_for_small_steps_or_every_step(monkeypatch, all_rows):
    """Measured faster at every size: panels take every step and oneDNN's copy is not kept. Otherwise panels
    take steps of at most ``PANEL_MAX_ROWS`` rows and oneDNN's copy the rest."""
    monkeypatch.setattr(linear, "bf16_panels_available", lambda: True)
    monkeypatch.setattr(linear, "panels_all_rows", lambda dtype, threads: all_rows)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(96, generator=g).to(torch.bfloat16)
    layer = linear.Linear(w, b)
    assert layer.panels is not None and layer.all_rows == all_rows
    if all_rows:
        assert layer.packed is None and layer.weight is None  # one copy of the weight: the panels
        assert linear.weight_bytes(layer) == 128 * 64 * 2  # 96 channels padded to 128
    calls = _count_rows(monkeypatch, "panel_linear_bf16")
    rows = (1, linear.PANEL_MAX_ROWS, linear.PANEL_MAX_ROWS + 1, 300)
    for m in rows:
        x = torch.randn(m, 64, generator=g).to(torch.bfloat16)
        _assert_rounded_once(layer(x), _bf16_reference(x, w, b))
    x3 = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)  # other ranks: flattened to rows
    _assert_rounded_once(layer(x3), _bf16_reference(x3, w, b))
    if all_rows:
        assert calls == [*rows, 10]
    else:
        assert calls[:2] == [1, linear.PANEL_MAX_ROWS] and len(calls) == 2 + (layer.packed is None) * 3


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=bf16_only)])
def test_panels_for_every_step_decided_by_measurement_or_setting(monkeypatch, dtype):
    if linear.panel_width() != 64:
        assert not linear.panels_all_rows(torch.float32, 1)  # AVX2's panels: one pass of rows only
        return
    ratios = linear.measure_panels(dtype)
    assert set(ratios) == set(linear.PANEL_WIDE_ROWS) and all(r > 0 for r in ratios.values())
    for setting, expect in (("1", True), ("0", False)):
        monkeypatch.setenv("APT_SERVE_PANEL_ALL_ROWS", setting)
        linear.panels_all_rows.cache_clear()
        assert linear.panels_all_rows(dtype, 1) is expect
    linear.panels_all_rows.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panels_off_by_environment_in_either_dtype(monkeypatch, dtype):
    monkeypatch.setenv("APT_SERVE_PANEL_LINEAR", "0")
    linear.bf16_panels_available.cache_clear()
    linear.panels_available.cache_clear()
    try:
        assert not linear.bf16_panels_available() and not linear.panels_available()
        layer = linear.Linear(torch.randn(8, 8).to(dtype))
        assert layer.panels is None
    finally:
        monkeypatch.delenv("APT_SERVE_PANEL_LINEAR")
        linear.bf16_panels_available.cache_clear()
        linear.panels_available.cache_clear()
