"""How well the step-time model the engine fits at start predicts steps it has not seen (issue 44,
item 4): calibrated with and without steps that carry a prefill chunk beside decode rows, then timed
on held-out random steps (decode-only, prefill-only and mixed, the shapes the adaptive policy plans)
on the same runner. Prints measured / predicted by step kind (median, P90, P99) for each fit.

    python benchmarks/step_model_fit.py --dtype bfloat16 --json docs/benchmarks/step_model_fit.json

The policy sizes every step from this model (scaled by the slowdown it observes while serving): a
model that under-predicts the steps it plans most breaks the gaps it promised, first of all in the
first minute after a start, before any slowdown has been observed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from apt_serve_ray.bench.engine_args import ONE_THREAD, Default, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import fake_step, time_steps
from apt_serve_ray.scheduler.costs import chunk_pairs


def held_out_shapes(rng: np.random.Generator, num: int, budget: int, max_len: int) -> list[tuple[str, list]]:
    """``num`` random steps of each kind: (kind, [(context after the step, new tokens)])."""
    shapes = []
    for _ in range(num):
        b = int(rng.integers(1, 49))
        shapes.append(("decode", [(int(rng.integers(64, 1024)), 1) for _ in range(b)]))
        n, start = int(rng.integers(32, budget + 1)), int(rng.integers(0, max_len - budget - 1))
        shapes.append(("prefill", [(start + n, n)]))
        b = int(rng.integers(1, 33))
        n, start = int(rng.integers(32, budget - b + 1)), int(rng.integers(0, max_len - budget - 1))
        shapes.append(("mixed", [(start + n, n)] + [(int(rng.integers(64, 1024)), 1) for _ in range(b)]))
    return shapes


def features(shape) -> tuple[int, int, int, int]:
    return (sum(n for _, n in shape), sum(c for c, _ in shape), 0, sum(chunk_pairs(c - n, n) for c, n in shape))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint (default: the random bf16 OPT-125m)")
    add_engine_args(p, "dtype", "num_threads", num_threads=ONE_THREAD,
                    dtype=Default("bfloat16", "the dtype the docs' fit was measured in", ("float32", "bfloat16")))
    p.add_argument("--num", type=int, default=20, help="held-out steps of each kind")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from apt_serve_ray import LLM
    from apt_serve_ray.worker.calibration import step_time_model

    torch.set_num_threads(args.num_threads)
    model = args.model or random_checkpoint("opt-125m")
    llm = LLM(str(model), dtype=args.dtype, num_pages=4096, num_threads=args.num_threads, calibrate_rho=False,
              max_model_len=2048)
    runner = llm.llm_engine.runner
    fits = {"without mixed steps": step_time_model(runner),
            "with mixed steps": step_time_model(runner, mixed=((384, 0, 8, 256), (256, 768, 16, 512), (448, 256, 32, 128)))}
    shapes = held_out_shapes(np.random.default_rng(args.seed), args.num, 512, 2048)
    measured = [time_steps(runner, fake_step(runner, s), args.repeats, reduce=np.median) for _, s in shapes]
    header = stamp(threads=args.num_threads, dtype=args.dtype, model=str(model), simulated=False,
                   held_out=len(shapes))
    result = {"fits": {}}
    print(f"{'fit':22s} {'kind':8s} {'n':>3s} {'median':>7s} {'P90':>6s} {'P99':>6s}   measured / predicted")
    for name, model_fit in fits.items():
        rows = {}
        for kind in ("decode", "prefill", "mixed"):
            ratios = np.array([m / model_fit.predict(*features(s)) for (k, s), m in zip(shapes, measured) if k == kind])
            rows[kind] = {"num": int(ratios.size), "median": float(np.median(ratios)),
                          "p90": float(np.percentile(ratios, 90)), "p99": float(np.percentile(ratios, 99))}
            r = rows[kind]
            print(f"{name:22s} {kind:8s} {r['num']:3d} {r['median']:7.2f} {r['p90']:6.2f} {r['p99']:6.2f}")
        result["fits"][name] = {"coefficients": [model_fit.a, model_fit.b, model_fit.c, model_fit.d],
                                "r2": model_fit.r2, "calibration_s": model_fit.wall_s, "ratios": rows}
    if args.json:
        write_json(args.json, result, header)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
