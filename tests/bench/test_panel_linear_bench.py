"""benchmarks/panel_linear.py: the layer table times the same weights both ways, in either dtype; flags it cannot
run say so."""

import pytest
import torch

from apt_serve_ray.models import linear
from tests.bench.scripts import load_script


def load():
    return load_script("benchmarks/panel_linear.py")


def test_unknown_dtype_exits_2():
    with pytest.raises(SystemExit) as exc:
        load().main(["--dtype", "float16"])
    assert exc.value.code == 2


def test_without_panels_it_says_so_and_exits_2(monkeypatch, capsys):
    bench = load()
    monkeypatch.setattr(linear, "bf16_panels_available", lambda: False)
    monkeypatch.setattr(bench, "_clear_panel_caches", lambda: None)
    assert bench.main(["--dtype", "bfloat16"]) == 2
    assert "not available" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_time_layers_runs_the_panels_or_the_onednn_copies(monkeypatch, dtype):
    bench = load()
    if not (linear.panels_available() if dtype == torch.float32 else linear.bf16_panels_available()):
        pytest.skip("no panel kernels here")
    if not linear.packing_available(dtype):
        pytest.skip("no oneDNN packing here")
    monkeypatch.setattr(linear, "panels_all_rows", lambda d, threads: False)
    g = torch.Generator().manual_seed(0)
    layers = [linear.Linear(torch.randn(n, k, generator=g).to(dtype)) for n, k in ((96, 64), (64, 96))]
    assert [bench.in_features(layer) for layer in layers] == [64, 96]
    calls = {"panels": 0}
    real_call = linear.panel_call

    def panel_call(*args):
        calls["panels"] += 1
        return real_call(*args)

    monkeypatch.setattr(linear, "panel_call", panel_call)
    for use_panels in (True, False):
        assert bench.time_layers(layers, layers, 3, use_panels, repeats=2) > 0
    assert calls["panels"] == 2 * 3  # one warm-up and two timed runs over two layers, and none through oneDNN
