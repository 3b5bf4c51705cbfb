"""Decode-step time of every architecture we serve, at one shape, side by side (issue 29).

    python benchmarks/architectures.py [--batches 1 8 32] [--context 400] [--dtype float32] \\
        [--json docs/benchmarks/architectures.json]

Each architecture's random-weight checkpoint at OPT-125m's sizes (``<arch>-125m``), one whole engine
step on KV pages timed as ``decode_step.py`` does, architectures interleaved per batch (fastest of
``--repeats``); each one's time over Llama's. Results and why they differ: docs/benchmarks.md
("Models and the sampler's extra work").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from apt_serve_ray.bench.engine_args import ONE_THREAD, Default, add_cache_dir, add_engine_args, random_checkpoint
from apt_serve_ray.bench.report import stamp, write_json
from apt_serve_ray.bench.steps import build, decode_batch, time_step
from apt_serve_ray.request import CacheKind

ARCHITECTURES = ["llama", "opt", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--architectures", nargs="+", default=ARCHITECTURES, choices=ARCHITECTURES)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=400)
    add_engine_args(p, "dtype", "num_threads", num_threads=ONE_THREAD,
                    dtype=Default("float32", "the architectures side by side in one dtype every CPU runs fast",
                                  ("float32", "bfloat16")))
    p.add_argument("--repeats", type=int, default=5)
    add_cache_dir(p)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    num_pages = max(args.batches) * (-(-args.context // 16)) + 8
    engines = {}
    for arch in args.architectures:
        shape = "opt-125m" if arch == "opt" else f"{arch}-125m"
        path = random_checkpoint(shape, args.cache_dir, dtype=args.dtype)
        engines[arch] = build(path, "fast", True, args.dtype, num_pages, "cpu")
    header = stamp(threads=args.num_threads, dtype=args.dtype, model="<arch>-125m shapes, random weights",
                   simulated=False)
    print(header["machine"], f"dtype {args.dtype}, {args.num_threads} thread(s), context {args.context}, KV pages, "
          "fast backend")
    rows = []
    for batch in args.batches:
        outs = {arch: decode_batch(llm, batch, args.context, CacheKind.KV) for arch, llm in engines.items()}
        best = {arch: float("inf") for arch in engines}
        for arch, llm in engines.items():  # warm-up
            time_step(llm.llm_engine.runner, outs[arch])
        for _ in range(args.repeats):
            for arch, llm in engines.items():
                best[arch] = min(best[arch], time_step(llm.llm_engine.runner, outs[arch]))
        base = best.get("llama")
        for arch in engines:
            rows.append({"architecture": arch, "batch": batch, "step_ms": best[arch] * 1e3,
                         "over_llama": best[arch] / base if base else None})
            ratio = f"{best[arch] / base:5.2f}x" if base else "-"
            print(f"batch {batch:3d}  {arch:12s} {best[arch] * 1e3:8.2f} ms  {ratio} Llama's")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows}, header)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
