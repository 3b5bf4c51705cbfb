"""Float32 panel linears against oneDNN's packed ones (issue 41): the layer linears alone and a whole
decode step, at one and two threads, quiet and beside other processes' wake-ups.

    python benchmarks/panel_linear.py [--shape opt-125m] [--threads 1 2] \
        [--json docs/benchmarks/engine_speed/panel_linear_avx2.json]

On a CPU without AVX-512, float32 ``Linear`` layers keep their weight in panels of 16 channels for steps of
at most ``PANEL_MAX_ROWS`` rows (``kernels/csrc/cpu_panel.cpp``). Two tables:

- every linear layer of the model (its decoder layers' and the logits'), ``rows`` rows of x, through the
  panels and through oneDNN's packed weight: the kernel's choice alone;
- the whole decision: ``ModelRunner.execute`` of a decode step (batch 1 and 4, 400 tokens of context) on
  two engines over the same checkpoint, one built with panels and one without
  (``APT_SERVE_PANEL_LINEAR=0`` at load), alternated in rounds.

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


def engine(path: str, panels: bool):
    os.environ["APT_SERVE_PANEL_LINEAR"] = "auto" if panels else "0"
    linear.panels_available.cache_clear()
    try:
        llm = build(path, "fast", True, "float32", 256, "cpu")
    finally:
        os.environ.pop("APT_SERVE_PANEL_LINEAR", None)
        linear.panels_available.cache_clear()
    runner = llm.llm_engine.runner
    fill_pages(runner.storage, CacheKind.KV, 64)
    return llm, runner


def time_layers(layers, rows: int, use_panels: bool, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k in {layer.panels.shape[1] for layer in layers}}  # one x per input width

    def run():
        for layer in layers:
            x = xs[layer.panels.shape[1]]
            if use_panels:
                linear.panel_linear(x, layer.panels, layer.bias, layer.out_features)
            else:
                torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")

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
    ap.add_argument("--noise-procs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    add_cache_dir(ap)
    a = ap.parse_args(argv)
    linear.panels_available.cache_clear()
    if not linear.panels_available():
        print("panel linears are not available here (AVX-512 present, or the kernels did not build):"
              " set APT_SERVE_PANEL_LINEAR=1 to measure them anyway", file=sys.stderr)
        return 2
    path = random_checkpoint(a.shape, a.cache_dir)
    with_panels, runner_p = engine(path, True)
    without, runner_o = engine(path, False)
    layers = linear.model_linears(runner_p.model)
    assert layers and all(layer.panels is not None and layer.packed is not None for layer in layers), "no panels"
    steps = {f"decode x{b} @ 400": [(400, 1)] * b for b in (1, 4)}
    cpus = cpu_affinity.available_cpus()
    rows_out = []
    for threads in a.threads:
        torch.set_num_threads(threads)
        cpu_affinity.bind_compute_threads(threads, True, cpus[:threads])
        others = set(cpus[threads:]) or set(cpus)
        for rows in a.rows:
            res = rounds({"onednn": lambda: time_layers(layers, rows, False, a.repeats),
                          "panels": lambda: time_layers(layers, rows, True, a.repeats)}, a, others)
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
                                  stamp(threads=a.threads, dtype="float32", model=a.shape, simulated=False)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
