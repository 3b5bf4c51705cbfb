"""Float32 linears for small steps on AVX2 (``kernels/csrc/cpu_panel.cpp``, ``models/linear.py``): the kernel
against ``F.linear`` over rows, odd shapes, bias or none; ``Linear`` sends at most ``PANEL_MAX_ROWS`` rows
to it and counts the panels' bytes."""

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


@pytest.mark.parametrize("n,k", [(768, 768), (50, 37), (17, 3), (16, 8), (1, 5), (200, 3072)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_linear_matches_f_linear(n, k, with_bias):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    panels = linear.pack_panels(w)
    assert panels.shape == (-(-n // 16), k, 16)
    for m in (0, 1, 2, 5, 6, 7, 8, 13):
        x = torch.randn(m, k, generator=g)
        y = torch.ops.apt_serve.panel_linear(x, panels, b, n)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4)


def test_panel_linear_takes_a_strided_x_and_refuses_bad_shapes():
    w, x = torch.randn(40, 24), torch.randn(24, 3).t()  # not contiguous
    panels = linear.pack_panels(w)
    torch.testing.assert_close(torch.ops.apt_serve.panel_linear(x, panels, None, 40), F.linear(x, w))
    with pytest.raises(RuntimeError, match="n"):
        torch.ops.apt_serve.panel_linear(x.contiguous(), panels, None, 60)  # more channels than the panels hold
    with pytest.raises(RuntimeError, match="K"):
        torch.ops.apt_serve.panel_linear(torch.randn(3, 25), panels, None, 40)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.apt_serve.panel_linear(x.to(torch.bfloat16), panels, None, 40)


def test_linear_sends_small_steps_to_the_panels(monkeypatch):
    monkeypatch.setattr(linear, "panels_available", lambda: True)
    w, b = torch.randn(48, 32), torch.randn(48)
    layer = linear.Linear(w, b)
    assert layer.panels is not None
    calls = []
    real = linear.panel_linear

    def spy(x, *args):
        calls.append(len(x))
        return real(x, *args)

    monkeypatch.setattr(linear, "panel_linear", spy)
    for m in (1, linear.PANEL_MAX_ROWS, linear.PANEL_MAX_ROWS + 1, 64):
        x = torch.randn(m, 32)
        torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == [1, linear.PANEL_MAX_ROWS]
    assert linear.weight_bytes(layer) == 2 * 48 * 32 * 4  # oneDNN's copy (or the plain weight) and the panels


def test_panels_off_by_environment(monkeypatch):
    monkeypatch.setenv("APT_SERVE_PANEL_LINEAR", "0")
    linear.panels_available.cache_clear()
    try:
        assert not linear.panels_available()
        assert linear.Linear(torch.randn(8, 8)).panels is None
    finally:
        monkeypatch.delenv("APT_SERVE_PANEL_LINEAR")
        linear.panels_available.cache_clear()
