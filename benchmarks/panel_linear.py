"""Panel linears against oneDNN's packed ones (issue 41): the layer linears alone and whole engine steps, at one
and two threads, quiet and beside other processes' wake-ups, in float32 or bf16.

    python benchmarks/panel_linear.py [--shape opt-125m] [--threads 1 2] [--dtype float32|bfloat16] \
        [--json docs/benchmarks/engine_speed/panel_linear_avx2.json]

float32: ``Linear`` layers keep their weight in panels of 16 channels (AVX2) or 64 (AVX-512) for steps of at most
``PANEL_MAX_ROWS`` rows (``kernels/csrc/cpu_panel.cpp``). bf16 (AVX-512; here also where the CPU has AMX): panels of
64 channels, for every step where ``panels_all_rows`` measured them faster than oneDNN (then oneDNN's copy is not
kept), else for the small ones. The engine without panels is built with ``APT_SERVE_PANEL_LINEAR=0``. Two tables:

- every linear layer of the model (its decoder layers' and the logits'), ``rows`` rows of x, through the
  panels and through oneDNN's packed weight: the kernel's choice alone;
- the whole decision: ``ModelRunner.execute`` of decode steps (batch 1 and 4, 400 tokens of context) and of a
  512-token prefill chunk, on two engines over the same checkpoint, one built with panels and one without
  (``APT_SERVE_PANEL_LINEAR=0`` at load), alternated in rounds.
  (The 512-token prefill runs through the panels only where they take every step: bf16 where measured so.)

Each is timed quiet and beside ``step_under_noise``'s noise (16 processes that each wake every 6 ms and
spin 60 us: the idle Serve app's wake-ups on these cores), the median of each round, the median of rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_under_noise import noise  # noqa: E402

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint  # noqa: E402
from apt_serve_ray.bench.report import stamp, write_json  # noqa: E402
from apt_serve_ray.bench.steps import build, fake_step, fill_pages, time_steps  # noqa: E402
from apt_serve_ray.models import linear  # noqa: E402
from apt_serve_ray.request import CacheKind  # noqa: E402
from apt_serve_ray.worker import cpu_affinity  # noqa: E402


def _clear_panel_caches() -> None:
    for fn in (linear.panels_available, linear.bf16_panels_available, linear.panels_all_rows):
        fn.cache_clear()


def engine(path: str, panels: bool, dtype: str):
    os.environ["APT_SERVE_PANEL_LINEAR"] = "1" if panels else "0"  # on where the kernels build, or off
    _clear_panel_caches()
    try:
        llm = build(path, "fast", True, dtype, 256, "cpu")
    finally:
        os.environ.pop("APT_SERVE_PANEL_LINEAR", None)
        _clear_panel_caches()
    runner = llm.llm_engine.runner
    fill_pages(runner.storage, CacheKind.KV, 64)
    return llm, runner


def in_features(layer) -> int:
    return layer.panels.shape[1] * (2 if layer.panels.dim() == 4 else 1)  # bf16 panels hold inputs in pairs


def time_layers(layers, oned, rows: int, use_panels: bool, repeats: int) -> float:
    """``layers`` (with panels) through their panels, or the same weights through ``oned``'s oneDNN copies."""
    dtype = layers[0].panels.dtype
    xs = {k: torch.randn(rows, k).to(dtype) for k in {in_features(layer) for layer in layers}}  # one x per width

    def run():
        for layer, other in zip(layers, oned):
            x = xs[in_features(layer)]
            if use_panels:
                linear.panel_call(x, layer.panels, layer.bias32, layer.out_features)
            else:
                torch.ops.mkldnn._linear_pointwise(x, other.packed, other.bias, "none", [], "")

    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def rounds(fns: dict, a, others) -> dict:
    """{name: {"quiet": ms, "noisy": ms, ...}}: each fn timed quiet then beside the noise, ``a.rounds`` times."""
    res = {k: {"quiet": [], "noisy": []} for k in fns}
    for _ in range(a.rounds):
        for k, f in fns.items():
            res[k]["quiet"].append(f())
        procs = noise(a.noise_procs, 60.0, 6.0, others)
        try:
            time.sleep(0.5)
            for k, f in fns.items():
                res[k]["noisy"].append(f())
        finally:
            for p in procs:
                p.kill()
                p.wait()
    return {k: {"quiet_ms": statistics.median(v["quiet"]), "noisy_ms": statistics.median(v["noisy"]),
                "quiet_rounds": v["quiet"], "noisy_rounds": v["noisy"]} for k, v in res.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="opt-125m")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--noise-procs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    add_cache_dir(ap)
    a = ap.parse_args(argv)
    _clear_panel_caches()
    available = linear.bf16_panels_available() if a.dtype == "bfloat16" else linear.panels_available()
    if not available:
        print(f"{a.dtype} panel linears are not available here (float32 needs AVX2 and FMA, bf16 AVX-512 and no AMX"
              " unless APT_SERVE_PANEL_LINEAR=1; or the kernels did not build)", file=sys.stderr)
        return 2
    path = random_checkpoint(a.shape, a.cache_dir)
    with_panels, runner_p = engine(path, True, a.dtype)
    without, runner_o = engine(path, False, a.dtype)
    layers, oned = linear.model_linears(runner_p.model), linear.model_linears(runner_o.model)
    assert layers and all(layer.panels is not None for layer in layers), "no panels"
    assert [o.out_features for o in oned] == [layer.out_features for layer in layers], "the models differ"
    assert all(o.packed is not None for o in oned), "no oneDNN copies"
    steps = {f"decode x{b} @ 400": [(400, 1)] * b for b in (1, 4)}
    steps["prefill 512 @ 0"] = [(512, 512)]
    cpus = cpu_affinity.available_cpus()
    rows_out = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        cpu_affinity.bind_compute_threads(threads, True, cpus[:threads])
        others = set(cpus[threads:]) or set(cpus)
        for rows in a.rows:
            res = rounds({"onednn": lambda: time_layers(layers, oned, rows, False, a.repeats),
                          "panels": lambda: time_layers(layers, oned, rows, True, a.repeats)}, a, others)
            rows_out.append({"what": "layer linears", "threads": threads, "rows": rows, **{
                f"{k}_{m}": v[m] for k, v in res.items() for m in ("quiet_ms", "noisy_ms")}, "detail": res})
        for label, shape in steps.items():
            sp, so = fake_step(runner_p, shape), fake_step(runner_o, shape)
            res = rounds({"onednn": lambda: 1e3 * time_steps(runner_o, so, a.repeats, reduce=statistics.median),
                          "panels": lambda: 1e3 * time_steps(runner_p, sp, a.repeats, reduce=statistics.median)},
                         a, others)
            rows_out.append({"what": label, "threads": threads, "rows": len(shape), **{
                f"{k}_{m}": v[m] for k, v in res.items() for m in ("quiet_ms", "noisy_ms")}, "detail": res})
        for r in rows_out:
            if r["threads"] == threads:
                print(f"{threads} thr  {r['what']:18s} rows {r['rows']:3d}   quiet: oneDNN {r['onednn_quiet_ms']:7.2f}"
                      f"  panels {r['panels_quiet_ms']:7.2f} ({r['panels_quiet_ms'] / r['onednn_quiet_ms']:.2f}x)"
                      f"   beside noise: oneDNN {r['onednn_noisy_ms']:7.2f}  panels {r['panels_noisy_ms']:7.2f}"
                      f" ({r['panels_noisy_ms'] / r['onednn_noisy_ms']:.2f}x)", flush=True)
    if a.json:
        print("wrote", write_json(a.json, {"rows": rows_out, "args": {k: str(v) for k, v in vars(a).items()}},
                                  stamp(threads=a.threads, dtype=a.dtype, model=a.shape, simulated=False)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
