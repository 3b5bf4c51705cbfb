"""bf16 linears of many rows as a float32 GEMM over the weight unpacked on the fly (``models/linear.py``,
``wide_rows``), against oneDNN's bf16 GEMM: one whole prefill step (``ModelRunner.execute``) of the chunks
``prefill_step.py`` times, the two ways alternated in one process (every layer's ``wide`` flag switched), and
what ``measure_wide`` decides at each thread count.

    python benchmarks/wide_linear.py [--shape opt-125m] [--rounds 5] [--json docs/benchmarks/engine_speed/wide_linear.json]

This machine's noise is larger than most differences: only the ratio within one run is a result.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, fake_step, fill_pages, time_step
from apt_serve_ray.models.linear import measure_wide, model_linears
from apt_serve_ray.request import CacheKind

CHUNKS = {"128 @ 0": [(128, 128)], "384 @ 0": [(384, 384)], "512 @ 1024": [(1536, 512)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="opt-125m")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path, default=None)
    add_cache_dir(p)
    args = p.parse_args()
    llm = build(random_checkpoint(args.shape, args.cache_dir, dtype="bfloat16"), "fast", True, "bfloat16", 512, "cpu")
    runner = llm.llm_engine.runner
    linears = [layer for layer in model_linears(runner.model) if layer.packed is not None]
    if not linears:
        raise SystemExit("no packed bf16 layers (oneDNN unavailable?)")
    fill_pages(runner.storage, CacheKind.KV, 200)
    rows, decisions = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        found, ratios = measure_wide()
        decisions[threads] = {"wide_from_rows": found, "layer_ratios": ratios}
        print(f"{threads}t: measure_wide -> {found} rows (float32 / bf16 on 3072x768: {ratios})", flush=True)
        for label, shape in CHUNKS.items():
            step = fake_step(runner, shape, CacheKind.KV)
            times = {"bf16": [], "wide": []}
            for _ in range(args.rounds):
                for way in ("bf16", "wide"):
                    for layer in linears:
                        layer.wide = way == "wide"
                    runner.execute(step)  # warm-up, and the row count's decision measured if new
                    times[way].append(time_step(runner, step) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"threads": threads, "chunk": label, "bf16_ms": med["bf16"], "wide_ms": med["wide"],
                         "ratio": med["wide"] / med["bf16"], "bf16_all_ms": times["bf16"], "wide_all_ms": times["wide"]})
            print(f"{threads}t {label:<11} bf16 {med['bf16']:7.1f} ms  wide {med['wide']:7.1f} ms  "
                  f"ratio {rows[-1]['ratio']:.3f}", flush=True)
    for layer in linears:
        layer.wide = True
    if args.json:
        write_json(args.json, {"shape": args.shape, "decisions": decisions, "rows": rows},
                   stamp(threads=None, dtype="bfloat16", model=args.shape, simulated=False))
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
