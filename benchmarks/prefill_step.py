"""One whole prefill step, chunk sizes and positions that TTFT is made of (issue 41, item 3): the median of
``--repeats`` timings of ``ModelRunner.execute`` for a chunk of 384 tokens at position 0 (a fresh prompt) and
one of 512 tokens at position 1,024 (a document's later chunk), per dtype and thread count.

    python benchmarks/prefill_step.py [--shape opt-125m] [--json docs/benchmarks/engine_speed/prefill_step.json]

Run it in two checkouts one after the other (and again, alternating) to compare code: the machines these
figures come from are noisy, so a change is judged side by side, never against a figure from another run.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import add_cache_dir, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, fake_step, fill_pages, time_step
from apt_serve_ray.request import CacheKind

CHUNKS = {"384 @ 0": [(384, 384)], "512 @ 1024": [(1536, 512)]}  # (context after the step, tokens computed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="opt-125m")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path, default=None)
    add_cache_dir(p)
    args = p.parse_args()
    rows = []
    for dtype in args.dtypes:
        llm = build(random_checkpoint(args.shape, args.cache_dir, dtype=dtype), "fast", True, dtype, 512, "cpu")
        runner = llm.llm_engine.runner
        fill_pages(runner.storage, CacheKind.KV, 200)
        for label, shape in CHUNKS.items():
            step = fake_step(runner, shape, CacheKind.KV)
            for threads in args.threads:
                torch.set_num_threads(threads)
                runner.execute(step)  # warm-up
                times = [time_step(runner, step) * 1e3 for _ in range(args.repeats)]
                rows.append({"dtype": dtype, "chunk": label, "threads": threads, "median_ms": statistics.median(times),
                             "min_ms": min(times)})
                print(f"{dtype:<9} {label:<11} {threads}t  median {rows[-1]['median_ms']:7.1f} ms  "
                      f"min {rows[-1]['min_ms']:7.1f} ms", flush=True)
        del llm, runner
    if args.json:
        write_json(args.json, {"shape": args.shape, "rows": rows}, stamp(threads=None, dtype=None, model=args.shape,
                                                                          simulated=False))
        print(f"written: {args.json}")


if __name__ == "__main__":
    main()
